"""`ArtifactWriter`: builds a `.infernix` file (plus numbered shards past a size limit).

Writing is two-phase so that memory stays bounded by the largest tensor: tensors are first
*declared* (format, shape and, for streaming, a function producing the encoded parts), then
`finish()` lays out the directory, and calls each producer once, in order, writing its bytes
before asking for the next. Everything goes to `*.tmp` names first and is renamed at the end,
with the header written last, so an interrupted write never leaves a file that opens.
"""

from __future__ import annotations

import json
import os
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

import numpy as np

from runtime.artifact import spec
from runtime.artifact.spec import ArtifactError, Header, PartSpec

Parts = dict[str, np.ndarray]
PartsSource = Union[Parts, Callable[[], Parts], None]


@dataclass
class _Placement:
    file: int = 0
    offset: int = 0
    nbytes: int = 0
    crc32: Optional[str] = None
    hole: bool = False          # never written (sparse): no checksum to verify

    def to_json(self) -> dict:
        # Before the payload is written the checksum is a placeholder of the final width.
        crc = None if self.hole else (self.crc32 or "0" * spec.CRC_WIDTH)
        return {"file": self.file, "offset": self.offset, "nbytes": self.nbytes, "crc32": crc}


@dataclass
class _Tensor:
    component: str
    name: str
    fmt: str
    shape: tuple[int, ...]
    row_groups: int
    specs: tuple[PartSpec, ...]
    source: PartsSource
    placements: dict[str, _Placement] = field(default_factory=dict)


@dataclass
class _Component:
    config: dict
    resources: dict[str, bytes]
    resource_placements: dict[str, _Placement] = field(default_factory=dict)


def shard_name(main_name: str, index: int) -> str:
    """File name of shard `index` (>= 1) next to the main file."""
    return f"{main_name}.part-{index:04d}"


class ArtifactWriter:
    """Collects components and tensors, then writes them with `finish()`.

    `max_file_bytes` bounds each file's payload (None: one file); a tensor never straddles two
    files, so a single tensor larger than the limit gets a file of its own.
    """

    def __init__(self, path: Union[str, os.PathLike], *, max_file_bytes: Optional[int] = None,
                 metadata: Optional[dict] = None):
        self.path = Path(path)
        self.max_file_bytes = max_file_bytes
        self.metadata = dict(metadata or {})
        self._components: dict[str, _Component] = {}
        self._tensors: list[_Tensor] = []
        self._names: set[tuple[str, str]] = set()
        self._finished = False

    # ---- declaring ------------------------------------------------------------------------

    def add_component(self, name: str, config: dict[str, Any],
                      resources: Optional[dict[str, bytes]] = None) -> None:
        if name in self._components:
            raise ValueError(f"component {name!r} added twice")
        if not name.replace("_", "").isalnum() or name != name.lower():
            raise ValueError(f"component name {name!r}: use lower-case letters, digits, '_'")
        json.dumps(config, allow_nan=False)     # fail here, not in finish(), on a bad config
        self._components[name] = _Component(dict(config), {k: bytes(v) for k, v in
                                                           (resources or {}).items()})

    def add_tensor(self, component: str, name: str, values: np.ndarray, fmt: str = "bf16",
                   row_groups: int = 1) -> None:
        """Add real-valued `values`, encoded (rounded or quantised) into `fmt` right away."""
        values = np.asarray(values)
        self.add_encoded(component, name, fmt, values.shape,
                         spec.encode(values, fmt, row_groups), row_groups)

    def add_encoded(self, component: str, name: str, fmt: str, shape: tuple[int, ...],
                    parts: PartsSource, row_groups: int = 1) -> None:
        """Add an already-encoded tensor. `parts` is the dict of stored arrays, or a function
        returning it (called once during `finish()`: the streaming path), or None to leave the
        bytes as a zero-filled hole (sparse files for tests and benchmarks)."""
        if component not in self._components:
            raise ValueError(f"tensor {name!r}: add component {component!r} first")
        if (component, name) in self._names:
            raise ValueError(f"tensor {component}/{name} added twice")
        if fmt not in spec.QUANTIZED:
            row_groups = 1
        try:
            specs = spec.part_specs(fmt, tuple(shape), row_groups)
        except ValueError as exc:
            raise ValueError(f"tensor {component}/{name}: {exc}") from None
        if isinstance(parts, dict):
            parts = self._checked(component, name, specs, parts)
        self._names.add((component, name))
        self._tensors.append(_Tensor(component, name, fmt, tuple(int(d) for d in shape),
                                     row_groups, specs, parts))

    @staticmethod
    def _checked(component: str, name: str, specs: tuple[PartSpec, ...], parts: Parts) -> Parts:
        if set(parts) != {s.name for s in specs}:
            raise ValueError(f"tensor {component}/{name}: parts {sorted(parts)}, expected "
                             f"{sorted(s.name for s in specs)}")
        out = {}
        for s in specs:
            array = np.asarray(parts[s.name])
            if array.dtype != s.dtype or array.shape != s.shape:
                raise ValueError(f"tensor {component}/{name}: part {s.name!r} is {array.dtype} "
                                 f"{list(array.shape)}, expected {s.dtype} {list(s.shape)}")
            out[s.name] = np.ascontiguousarray(array)
        return out

    # ---- writing --------------------------------------------------------------------------

    def _layout(self) -> list[int]:
        """Assign file and offset to every resource and part; returns payload bytes per file."""
        sizes = [0]

        def place(nbytes_list: list[int]) -> list[tuple[int, int]]:
            total = sum(spec.align_up(n, spec.TENSOR_ALIGN) for n in nbytes_list)
            if (self.max_file_bytes is not None and sizes[-1] > 0
                    and sizes[-1] + total > self.max_file_bytes):
                sizes.append(0)
            spots = []
            for n in nbytes_list:
                spots.append((len(sizes) - 1, sizes[-1]))
                sizes[-1] += spec.align_up(n, spec.TENSOR_ALIGN)
            return spots

        # Resources first and in the main file: they are small and read at every start.
        for comp in self._components.values():
            for key, blob in comp.resources.items():
                (file, offset), = place([len(blob)])
                comp.resource_placements[key] = _Placement(file, offset, len(blob))
        for tensor in self._tensors:
            spots = place([s.nbytes for s in tensor.specs])
            for s, (file, offset) in zip(tensor.specs, spots):
                tensor.placements[s.name] = _Placement(file, offset, s.nbytes,
                                                       hole=tensor.source is None)
        return sizes

    def _directory(self, artifact_id: bytes, sizes: list[int]) -> bytes:
        files = [{"name": self.path.name if i == 0 else shard_name(self.path.name, i),
                  "payload_bytes": size} for i, size in enumerate(sizes)]
        components = {}
        for cname, comp in self._components.items():
            components[cname] = {
                "config": comp.config,
                "resources": {k: p.to_json() for k, p in comp.resource_placements.items()},
                "tensors": {},
            }
        for t in self._tensors:
            entry: dict[str, Any] = {"shape": list(t.shape), "format": t.fmt}
            if t.fmt in spec.QUANTIZED:
                entry["row_groups"] = t.row_groups
            entry["parts"] = {s.name: {"dtype": s.dtype_name, "shape": list(s.shape),
                                       **t.placements[s.name].to_json()} for s in t.specs}
            components[t.component]["tensors"][t.name] = entry
        root = {"format": "infernix", "version": spec.VERSION, "artifact_id": artifact_id.hex(),
                "files": files, "components": components, "metadata": self.metadata}
        return json.dumps(root, allow_nan=False, separators=(",", ":")).encode()

    def finish(self) -> Path:
        """Write everything; returns the main file's path."""
        if self._finished:
            raise ValueError("finish() called twice")
        self._finished = True
        if "text" not in self._components:
            raise ValueError("an artifact needs a 'text' component")
        artifact_id = uuid.uuid4().bytes
        sizes = self._layout()
        directory_len = len(self._directory(artifact_id, sizes))
        offsets = [spec.align_up(spec.HEADER_BYTES + directory_len, spec.PAYLOAD_ALIGN)]
        offsets += [spec.PAYLOAD_ALIGN] * (len(sizes) - 1)
        final = [self.path] + [self.path.with_name(shard_name(self.path.name, i))
                               for i in range(1, len(sizes))]
        temporary = [p.with_name(p.name + ".tmp") for p in final]
        handles = [open(p, "wb") for p in temporary]
        try:
            for i, handle in enumerate(handles):
                handle.truncate(offsets[i] + sizes[i])     # holes stay sparse on disk

            def write(placement: _Placement, data: bytes | memoryview) -> None:
                handle = handles[placement.file]
                handle.seek(offsets[placement.file] + placement.offset)
                handle.write(data)
                placement.crc32 = f"{zlib.crc32(data):08x}"

            for comp in self._components.values():
                for key, blob in comp.resources.items():
                    write(comp.resource_placements[key], blob)
            for tensor in self._tensors:
                parts = tensor.source() if callable(tensor.source) else tensor.source
                tensor.source = None                       # let the arrays go once written
                if parts is None:
                    continue
                parts = self._checked(tensor.component, tensor.name, tensor.specs, parts)
                for s in tensor.specs:
                    write(tensor.placements[s.name], parts[s.name].reshape(-1).view(np.uint8))
            directory = self._directory(artifact_id, sizes)
            assert len(directory) == directory_len, "directory length changed while writing"
            for i, handle in enumerate(handles):
                header = Header(spec.VERSION, i, len(handles),
                                zlib.crc32(directory) if i == 0 else 0,
                                directory_len if i == 0 else 0, offsets[i], sizes[i], artifact_id)
                if i == 0:
                    handle.seek(spec.HEADER_BYTES)
                    handle.write(directory)
                handle.seek(0)
                handle.write(header.pack())
        except BaseException:
            for handle, path in zip(handles, temporary):
                handle.close()
                path.unlink(missing_ok=True)
            raise
        for handle in handles:
            handle.close()
        for tmp, path in zip(temporary, final):
            os.replace(tmp, path)
        return self.path

    def __enter__(self) -> "ArtifactWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and not self._finished:
            self.finish()


__all__ = ["ArtifactWriter", "ArtifactError", "shard_name"]
