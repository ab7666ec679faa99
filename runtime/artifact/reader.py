"""Reading `.infernix` files: `open_artifact()` checks the header, the directory and the shard
files it needs, without reading the payload; tensors are then zero-copy NumPy views of a
read-only memory map. Every problem is an `ArtifactError` naming the file.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import stat
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import numpy as np

from runtime.artifact import spec
from runtime.artifact.spec import ArtifactError, Header


@dataclass(frozen=True)
class PartEntry:
    """Where one stored array of a tensor lives. `offset` is absolute within `path`."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    path: Path
    file: int
    offset: int
    nbytes: int
    crc32: Optional[str]


@dataclass(frozen=True)
class TensorEntry:
    """A tensor's directory entry: logical shape, format, row groups (quantised formats: how
    many equal row groups, e.g. gate|up, have their own scales) and its stored parts."""

    name: str
    shape: tuple[int, ...]
    format: str
    row_groups: int
    parts: dict[str, PartEntry]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts.values())

    @property
    def scale_layout(self) -> Optional[str]:
        """A short description of the scales (docs/artifact.md has the exact rules)."""
        if self.format == "fp8_e4m3":
            return "fp32 per 128x128 block, row-major [*lead, R*ceil(Ng/128), ceil(K/128)]"
        if self.format == "nvfp4":
            return "e4m3 per 16 along K [*lead, N, K/16]; fp32 global per row group [*lead, R]"
        return None


class _Files:
    """The artifact's files: validated lazily per shard, memory-mapped on first tensor access."""

    def __init__(self, main: Path, header: Header, files: list[dict]):
        self.main = main
        self.header = header
        self.table = files
        self.paths = [main] + [main.with_name(f["name"]) for f in files[1:]]
        self.payload_offsets: dict[int, int] = {}    # of the files checked so far
        self.maps: dict[int, mmap.mmap] = {}

    def check(self, index: int) -> None:
        """Validate shard `index` (header and exact length) before anything is read from it."""
        if index in self.payload_offsets:
            return
        path = self.paths[index]
        expected_payload = self.table[index]["payload_bytes"]
        if index == 0:
            header = self.header
        else:
            with open_regular(path, f"shard {index} of {self.main.name} cannot be "
                                    "opened") as handle:
                raw = handle.read(spec.HEADER_BYTES)
            header = Header.unpack(raw, str(path))
            if header.artifact_id != self.header.artifact_id:
                raise ArtifactError(f"{path}: shard belongs to a different artifact (id "
                                    f"{header.artifact_id.hex()}, {self.main.name} has "
                                    f"{self.header.artifact_id.hex()})")
            if header.shard_index != index or header.shard_count != len(self.table):
                raise ArtifactError(f"{path}: header says shard {header.shard_index} of "
                                    f"{header.shard_count}, expected shard {index} of "
                                    f"{len(self.table)}")
            if header.payload_offset % spec.PAYLOAD_ALIGN:
                raise ArtifactError(f"{path}: payload offset {header.payload_offset} is not "
                                    f"{spec.PAYLOAD_ALIGN}-aligned")
        if header.payload_bytes != expected_payload:
            raise ArtifactError(f"{path}: header says {header.payload_bytes} payload bytes, "
                                f"the directory says {expected_payload}")
        size = os.stat(path).st_size
        expected = header.payload_offset + header.payload_bytes
        if size != expected:
            problem = "truncated" if size < expected else "has trailing bytes"
            raise ArtifactError(f"{path}: {problem}: {size} bytes, expected {expected}")
        self.payload_offsets[index] = header.payload_offset

    def view(self, part: PartEntry) -> np.ndarray:
        if part.file not in self.maps:
            with open(self.paths[part.file], "rb") as handle:
                self.maps[part.file] = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        count = math.prod(part.shape)
        return np.frombuffer(self.maps[part.file], dtype=part.dtype, count=count,
                             offset=part.offset).reshape(part.shape)

    def close(self) -> None:
        for mapping in self.maps.values():
            try:
                mapping.close()
            except BufferError:
                pass    # views are still alive; the mapping goes when they do
        self.maps.clear()


class Component:
    """One component (`text`, `mtp`, ...): its config, resources and tensors."""

    def __init__(self, name: str, config: dict, resources: dict[str, PartEntry],
                 tensors: dict[str, TensorEntry], files: _Files):
        self.name = name
        self.config = config
        self._resource_entries = resources
        self._tensors = tensors
        self._files = files
        self._resources: Optional[dict[str, bytes]] = None

    @property
    def resources(self) -> dict[str, bytes]:
        """Resource files by name ("tokenizer.json", "chat_template.jinja", ...), read once."""
        if self._resources is None:
            resources = {}
            for key, entry in self._resource_entries.items():
                data = self._files.view(entry).tobytes()
                # Checked at load (they are small): a flipped byte in the chat template or the
                # tokenizer would otherwise change every prompt silently.
                if entry.crc32 is not None and f"{zlib.crc32(data):08x}" != entry.crc32:
                    raise ArtifactError(f"{entry.path}: {self.name} resource {key!r}: "
                                        f"checksum {zlib.crc32(data):08x}, directory says "
                                        f"{entry.crc32} (corrupt)")
                resources[key] = data
            self._resources = resources
        return self._resources

    def tensor_names(self) -> tuple[str, ...]:
        return tuple(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def entry(self, name: str) -> TensorEntry:
        try:
            return self._tensors[name]
        except KeyError:
            raise ArtifactError(f"{self._files.main}: component {self.name!r} has no tensor "
                                f"{name!r}") from None

    def raw(self, name: str, part: str = "data") -> np.ndarray:
        """Zero-copy read-only view of one stored part (bf16 as uint16, fp8/fp4 codes as
        uint8)."""
        entry = self.entry(name)
        if part not in entry.parts:
            raise ArtifactError(f"{self._files.main}: tensor {self.name}/{name} ({entry.format})"
                                f" has no part {part!r} (parts: {', '.join(entry.parts)})")
        return self._files.view(entry.parts[part])

    def f32(self, name: str) -> np.ndarray:
        """New float32 array of the tensor's values, dequantised whatever the format."""
        entry = self.entry(name)
        parts = {key: self._files.view(p) for key, p in entry.parts.items()}
        return spec.decode(parts, entry.format, entry.row_groups)

    def verify(self) -> None:
        """Read every byte of this component and compare with the stored checksums."""
        items = [(f"resource {key}", e) for key, e in self._resource_entries.items()]
        items += [(f"tensor {t.name} part {p.name}", p)
                  for t in self._tensors.values() for p in t.parts.values()]
        for what, part in items:
            if part.crc32 is None:
                continue
            actual = f"{zlib.crc32(self._files.view(part)):08x}"
            if actual != part.crc32:
                raise ArtifactError(f"{part.path}: {self.name} {what}: checksum {actual}, "
                                    f"directory says {part.crc32} (payload corrupt)")


class Artifact:
    """An opened `.infernix` file. Use as a context manager or call `close()`."""

    def __init__(self, path: Path, root: dict, files: _Files, components: dict[str, Component]):
        self.path = path
        self.metadata: dict = root.get("metadata", {})
        self.artifact_id: str = root["artifact_id"]
        self.all_component_names = tuple(root["components"])
        self._files = files
        self._components = components

    @property
    def component_names(self) -> tuple[str, ...]:
        """The enabled components."""
        return tuple(self._components)

    @property
    def files(self) -> tuple[Path, ...]:
        return tuple(self._files.paths)

    def component(self, name: str) -> Component:
        if name not in self._components:
            state = "not enabled" if name in self.all_component_names else "not present"
            raise ArtifactError(f"{self.path}: component {name!r} is {state} (enabled: "
                                f"{', '.join(self._components) or 'none'})")
        return self._components[name]

    def verify(self) -> None:
        for component in self._components.values():
            component.verify()

    def close(self) -> None:
        self._files.close()

    def __enter__(self) -> "Artifact":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_artifact(path: Union[str, os.PathLike],
                  components: Optional[Iterable[str]] = None) -> Artifact:
    """Open and check an artifact. `components`: None for all present, or the names to enable;
    tensors of other components are never read (their shards need not even exist)."""
    path = Path(path)
    where = str(path)
    with open_regular(path, "cannot open") as handle:
        size = os.fstat(handle.fileno()).st_size
        header = Header.unpack(handle.read(spec.HEADER_BYTES), where)
        if header.shard_index != 0:
            raise ArtifactError(f"{where}: this is shard {header.shard_index} of an artifact; "
                                "open the main file")
        check_header_bounds(header, size, where)
        raw = handle.read(header.json_bytes)
    if len(raw) < header.json_bytes:
        raise ArtifactError(f"{where}: truncated inside the directory ({len(raw)} of "
                            f"{header.json_bytes} bytes)")
    if zlib.crc32(raw) != header.json_crc32:
        raise ArtifactError(f"{where}: directory checksum mismatch (corrupt directory)")
    if header.payload_offset % spec.PAYLOAD_ALIGN or \
            header.payload_offset < spec.HEADER_BYTES + header.json_bytes:
        raise ArtifactError(f"{where}: bad payload offset {header.payload_offset}")
    try:
        root = json.loads(raw)
    except ValueError as exc:
        raise ArtifactError(f"{where}: directory is not valid JSON: {exc}") from None
    return _build(path, header, root, components)


def open_regular(path: Path, failure: str):
    """Open `path` for reading if it is a regular file. Opened without blocking, so a FIFO
    (or a device) named like an artifact is refused instead of hanging the loader."""
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise ArtifactError(f"{path}: {failure}: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise ArtifactError(f"{path}: {failure}: not a regular file")
    os.set_blocking(descriptor, True)
    return os.fdopen(descriptor, "rb")


def check_header_bounds(header: Header, size: int, where: str) -> None:
    """Header fields must fit in the file before anything is read or allocated from them."""
    for name, value, limit in (("directory length", header.json_bytes,
                                size - spec.HEADER_BYTES),
                               ("payload offset", header.payload_offset, size),
                               ("payload length", header.payload_bytes, size)):
        if value > limit:
            raise ArtifactError(f"{where}: truncated inside the directory or a corrupt header: "
                                f"header field {name} is {value}, beyond the file's {size} "
                                "bytes")
    if header.shard_count == 0 or header.shard_index >= header.shard_count:
        raise ArtifactError(f"{where}: header says shard {header.shard_index} of "
                            f"{header.shard_count} (corrupt header)")


def _build(path: Path, header: Header, root: Any,
           wanted: Optional[Iterable[str]]) -> Artifact:
    where = str(path)

    def fail(problem: str) -> ArtifactError:
        return ArtifactError(f"{where}: {problem}")

    if not isinstance(root, dict) or root.get("format") != "infernix":
        raise fail("directory is not an infernix directory")
    if root.get("version") != header.version:
        raise fail(f"directory version {root.get('version')} differs from header version "
                   f"{header.version}")
    if root.get("artifact_id") != header.artifact_id.hex():
        raise fail("directory artifact id differs from the header's")
    table = root.get("files")
    if not isinstance(table, list) or not table or len(table) != header.shard_count:
        raise fail(f"file table lists {len(table) if isinstance(table, list) else 'no'} files,"
                   f" header says {header.shard_count}")
    for i, f in enumerate(table):
        if not isinstance(f, dict) or not isinstance(f.get("payload_bytes"), int) or \
                not isinstance(f.get("name"), str) or "/" in f["name"] or f["name"] in ("", ".", ".."):
            raise fail(f"file table entry {i} is malformed")
    all_components = root.get("components")
    if not isinstance(all_components, dict) or "text" not in all_components:
        raise fail("directory has no 'text' component")
    if isinstance(wanted, str):
        wanted = (wanted,)
    names = tuple(all_components) if wanted is None else tuple(wanted)
    for name in names:
        if name not in all_components:
            raise fail(f"component {name!r} is not present (present: "
                       f"{', '.join(all_components)})")

    files = _Files(path, header, table)
    files.check(0)
    spans: dict[int, list[tuple[int, int, str]]] = {}

    def part_entry(what: str, part_name: str, raw_part: Any, dtype: np.dtype,
                   shape: Optional[tuple[int, ...]]) -> PartEntry:
        """Check one placement; shape None means a resource (bytes of its own length)."""
        if not isinstance(raw_part, dict):
            raise fail(f"{what}: malformed entry")
        file, offset, nbytes = raw_part.get("file"), raw_part.get("offset"), raw_part.get("nbytes")
        if not all(isinstance(v, int) and v >= 0 for v in (file, offset, nbytes)) or \
                file >= len(table):
            raise fail(f"{what}: bad placement {{file: {file}, offset: {offset}, "
                       f"nbytes: {nbytes}}}")
        if shape is None:
            shape = (nbytes,)
        expected = math.prod(shape) * dtype.itemsize
        if nbytes != expected:
            raise fail(f"{what}: {nbytes} bytes, but {spec.DTYPE_NAMES[dtype]} {list(shape)} "
                       f"needs {expected}")
        if offset % spec.TENSOR_ALIGN:
            raise fail(f"{what}: offset {offset} is not {spec.TENSOR_ALIGN}-byte aligned")
        if offset + nbytes > table[file]["payload_bytes"]:
            raise fail(f"{what}: bytes [{offset}, {offset + nbytes}) lie outside the payload "
                       f"of file {file} ({table[file]['payload_bytes']} bytes)")
        crc = raw_part.get("crc32")
        if crc is not None and (not isinstance(crc, str) or len(crc) != spec.CRC_WIDTH):
            raise fail(f"{what}: malformed checksum {crc!r}")
        spans.setdefault(file, []).append((offset, offset + nbytes, what))
        files.check(file)
        return PartEntry(part_name, dtype, shape, files.paths[file], file,
                         files.payload_offsets[file] + offset, nbytes, crc)

    components: dict[str, Component] = {}
    for cname in names:
        raw_comp = all_components[cname]
        if not isinstance(raw_comp, dict) or not isinstance(raw_comp.get("config"), dict):
            raise fail(f"component {cname!r} has no config")
        if not isinstance(raw_comp.get("resources", {}), dict) or \
                not isinstance(raw_comp.get("tensors", {}), dict):
            raise fail(f"component {cname!r}: resources and tensors must be JSON objects")
        resources = {}
        for key, raw_part in (raw_comp.get("resources") or {}).items():
            resources[key] = part_entry(f"{cname} resource {key!r}", key, raw_part,
                                        np.dtype(np.uint8), None)
        tensors = {}
        for tname, raw_t in (raw_comp.get("tensors") or {}).items():
            tensors[tname] = _tensor_entry(f"tensor {cname}/{tname}", tname, raw_t, fail,
                                           part_entry)
        components[cname] = Component(cname, raw_comp["config"], resources, tensors, files)

    for file, items in spans.items():
        items.sort()
        for (_, end, first), (begin, _, second) in zip(items, items[1:]):
            if begin < end:
                raise fail(f"{first} and {second} overlap in file {file}")
    return Artifact(path, root, files, components)


def _tensor_entry(what: str, name: str, raw_t: Any, fail, part_entry) -> TensorEntry:
    if not isinstance(raw_t, dict) or not isinstance(raw_t.get("shape"), list) or \
            not all(isinstance(d, int) and d >= 0 for d in raw_t["shape"]):
        raise fail(f"{what}: malformed entry")
    fmt = raw_t.get("format")
    row_groups = raw_t.get("row_groups", 1)
    shape = tuple(raw_t["shape"])
    if not isinstance(row_groups, int):
        raise fail(f"{what}: malformed row_groups")
    try:
        specs = spec.part_specs(fmt, shape, row_groups)
    except ValueError as exc:
        raise fail(f"{what}: {exc}") from None
    raw_parts = raw_t.get("parts")
    if not isinstance(raw_parts, dict) or set(raw_parts) != {s.name for s in specs}:
        raise fail(f"{what}: parts {sorted(raw_parts) if isinstance(raw_parts, dict) else None}"
                   f" do not match format {fmt} ({', '.join(s.name for s in specs)})")
    parts = {}
    for s in specs:
        stored = raw_parts[s.name]
        if isinstance(stored, dict) and (stored.get("dtype") != s.dtype_name or
                                         tuple(stored.get("shape", ())) != s.shape):
            raise fail(f"{what} part {s.name}: stored as {stored.get('dtype')} "
                       f"{stored.get('shape')}, format {fmt} needs {s.dtype_name} "
                       f"{list(s.shape)}")
        parts[s.name] = part_entry(f"{what} part {s.name}", s.name, stored, s.dtype, s.shape)
    return TensorEntry(name, shape, fmt, row_groups, parts)
