"""Loading compiled kernels from a manifest and launching them.

    lib = KernelLibrary.open(device, required=["rmsnorm/zc_h5120", "gemm_sm90/n5120_k6144"])
    norm = lib.kernel("rmsnorm", "zc_h5120")
    launch = norm.bind(buffers={"x": x, "w": w, "out": y}, sizes={"M": 7})   # checked, packed once
    launch(stream)                                                          # ~6 us of host time

At open, every required kernel must be in the manifest (else `KernelMissing`, naming family and
key), its cubin must hash to the manifest's value, and, where the `cute_kernels/` sources are
present next to the runtime (a repository checkout), they must hash to what the kernel was built
from (else `KernelStale`). The runtime never compiles.

`bind` checks sizes and launch constraints, evaluates the grid rule, checks buffer sizes when it
knows them, encodes each TMA descriptor once per (buffer, shape) through `cuTensorMapEncodeTiled`,
and packs the parameter bytes. Binding once and relaunching is what CUDA graph capture needs:
the parameters are baked in at capture time.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .errors import KernelMissing, KernelStale, LaunchError
from .expr import FormulaError, evaluate
from .manifest import DTYPE_BYTES, KernelEntry, Manifest, Param, file_sha256

__all__ = ["KernelLibrary", "Kernel", "BoundLaunch", "default_build_dir"]

REPO = Path(__file__).resolve().parents[2]


def default_build_dir() -> Path:
    return REPO / "build" / "kernels"


class BoundLaunch:
    """One kernel with its parameters packed; calling it launches on a stream."""

    __slots__ = ("kernel", "grid", "sizes", "pdl", "_buffers", "_array", "_config", "_param_sizes")

    def __init__(self, kernel: Kernel, grid: tuple[int, int, int], sizes: Mapping[str, int], blobs: list[bytes],
                 pdl: bool = False):
        if pdl and not kernel.entry.pdl:
            raise LaunchError(f"kernel {kernel.name} was not built with pdl: it must not be launched with "
                              "programmatic stream serialization (it does not wait for its predecessor)")
        self.kernel = kernel
        self.grid = grid
        self.sizes = dict(sizes)
        self.pdl = pdl
        # Keep every parameter's bytes alive as long as this launch (and any graph built from it).
        self._buffers = [ctypes.create_string_buffer(b, len(b)) for b in blobs]
        self._array = (ctypes.c_void_p * len(blobs))(*[ctypes.addressof(b) for b in self._buffers])
        self._param_sizes = [len(b) for b in blobs]
        e = kernel.entry
        self._config = kernel.library.device.launch_config(grid, e.block, e.dynamic_smem, e.cluster, pdl)

    def __call__(self, stream: Any) -> None:
        self.kernel.library.device.launch(
            self.kernel.function, self._config, stream, ctypes.addressof(self._array), self._param_sizes
        )

    def param_bytes(self) -> list[bytes]:
        return [bytes(b.raw) for b in self._buffers]

    def programmatic(self) -> BoundLaunch:
        """The same launch with programmatic stream serialization (PDL): it may start while the
        previous kernel in the stream drains. Only for kernels built with `pdl` (LaunchError)."""
        return BoundLaunch(self.kernel, self.grid, self.sizes, self.param_bytes(), pdl=True)


class Kernel:
    """A loaded kernel: its manifest entry, module and function."""

    def __init__(self, library: KernelLibrary, entry: KernelEntry, image: bytes):
        self.library = library
        self.entry = entry
        device = library.device
        self.module = device.load_module(image)
        self.function = device.get_function(self.module, entry.entry)
        if entry.dynamic_smem > 48 * 1024:
            device.set_dynamic_smem(self.function, entry.dynamic_smem)
        sizes = device.param_sizes(self.function, len(entry.params))
        if sizes is not None and sizes != [p.size for p in entry.params]:
            raise KernelStale(
                f"kernel {entry.name}: the cubin's parameters are {sizes} bytes but the manifest lists "
                f"{[p.size for p in entry.params]}; rebuild with build_kernels.py"
            )

    @property
    def name(self) -> str:
        return self.entry.name

    def bind(self, buffers: Mapping[str, Any], sizes: Mapping[str, int] | None = None) -> BoundLaunch:
        """Check and pack one launch. Buffers are device addresses (ints) or objects with `.ptr`
        (and `.nbytes`, which is then checked against the buffer's declared shape)."""
        e = self.entry
        sizes = {k: int(v) for k, v in (sizes or {}).items()}
        missing = [s for s in e.sizes if s not in sizes]
        if missing:
            raise LaunchError(f"kernel {e.name}: sizes {missing} not given (it needs {list(e.sizes)})")
        extra = set(sizes) - set(e.sizes)
        if extra:
            raise LaunchError(f"kernel {e.name}: unknown sizes {sorted(extra)} (it takes {list(e.sizes)})")
        for rule in e.requires:
            if not evaluate(rule, sizes):
                raise LaunchError(f"kernel {e.name}: launch needs {rule}, got {sizes}")
        addresses: dict[str, int] = {}
        for name, spec in e.tensors.items():
            if name not in buffers:
                raise LaunchError(f"kernel {e.name}: buffer {name!r} not given (it needs {sorted(e.tensors)})")
            buf = buffers[name]
            addr = int(getattr(buf, "ptr", buf))
            if addr % 16:
                raise LaunchError(f"kernel {e.name}: buffer {name!r} at {addr:#x} is not 16-byte aligned")
            nbytes = getattr(buf, "nbytes", None)
            if nbytes is not None:
                need = DTYPE_BYTES[spec.dtype] * int(np.prod([evaluate(d, sizes) for d in spec.shape], dtype=np.int64))
                if nbytes < need:
                    raise LaunchError(f"kernel {e.name}: buffer {name!r} has {nbytes} bytes, needs {need} for "
                                      f"{spec.dtype}{list(spec.shape)} at {sizes}")
            addresses[name] = addr
        unknown = set(buffers) - set(e.tensors)
        if unknown:
            raise LaunchError(f"kernel {e.name}: unknown buffers {sorted(unknown)}")
        grid = tuple(int(evaluate(g, sizes)) for g in e.grid)
        if any(g < 1 for g in grid) or grid[0] >= 2**31 or grid[1] > 65535 or grid[2] > 65535:
            raise LaunchError(f"kernel {e.name}: grid {grid} from sizes {sizes} is empty or too large")
        blobs = [self._pack(p, addresses, sizes) for p in e.params]
        return BoundLaunch(self, grid, sizes, blobs)  # type: ignore[arg-type]

    def launch(self, stream: Any, buffers: Mapping[str, Any], sizes: Mapping[str, int] | None = None) -> BoundLaunch:
        bound = self.bind(buffers, sizes)
        bound(stream)
        return bound

    def _pack(self, p: Param, addresses: Mapping[str, int], sizes: Mapping[str, int]) -> bytes:
        try:
            if p.kind == "ptr":
                return struct.pack("<Q", addresses[p.buffer])  # type: ignore[index]
            if p.kind == "i32":
                v = int(evaluate(p.value, sizes))  # type: ignore[arg-type]
                if not -(2**31) <= v < 2**31:
                    raise LaunchError(f"kernel {self.name}: parameter {p.name} = {v} overflows int32")
                return struct.pack("<i", v)
            if p.kind == "f32":
                return struct.pack("<f", float(evaluate(p.value, sizes)))  # type: ignore[arg-type]
            if p.kind == "const":
                return bytes.fromhex(p.hex)  # type: ignore[arg-type]
            assert p.kind == "tma" and p.encode is not None and p.buffer is not None
            return self.library.tma_descriptor(addresses[p.buffer], p, sizes)
        except FormulaError as exc:
            raise LaunchError(f"kernel {self.name}: parameter {p.name}: {exc}") from None


class KernelLibrary:
    """The kernels of one manifest, loaded onto one device."""

    def __init__(self, device: Any, manifest: Manifest, root: Path):
        self.device = device
        self.manifest = manifest
        self.root = root
        self._kernels: dict[tuple[str, str], Kernel] = {}
        self._tma_cache: dict[tuple[Any, ...], bytes] = {}

    @classmethod
    def open(
        cls,
        device: Any,
        build_dir: str | Path | None = None,
        arch: str | None = None,
        required: Iterable[str | tuple[str, str]] | None = None,
        source_root: str | Path | None | bool = True,
    ) -> KernelLibrary:
        """Load the manifest for the device's arch and every required kernel (default: all).

        source_root: the repository whose `cute_kernels/` the kernels must match; True means
        this checkout when its sources are present, False/None skips the source check.
        """
        arch = arch or device.arch
        root = Path(build_dir or default_build_dir()) / arch
        manifest = Manifest.load(root / "manifest.json")
        if manifest.arch != arch:
            raise KernelStale(f"{root / 'manifest.json'} is for {manifest.arch}, not {arch}")
        if manifest.arch != device.arch:
            # An explicit `arch` may name another build, but its cubins cannot load on this GPU.
            raise KernelStale(f"{root / 'manifest.json'} holds kernels built for {manifest.arch}; this device is "
                              f"{device.arch}: run `python build_kernels.py --arch {device.arch}`")
        lib = cls(device, manifest, root)
        if source_root is True:
            source_root = REPO if (REPO / "cute_kernels").is_dir() else None
        wanted = list(manifest.kernels) if required is None else [_split(r) for r in required]
        for family, key in wanted:
            lib._load(family, key, Path(source_root) if source_root else None)
        return lib

    def _load(self, family: str, key: str, source_root: Path | None) -> Kernel:
        entry = self.manifest.kernels.get((family, key))
        if entry is None:
            have = sorted(k for f, k in self.manifest.kernels if f == family)
            hint = f"built keys of {family}: {', '.join(have)}" if have else f"no {family} kernels were built"
            raise KernelMissing(
                f"kernel {family}/{key} is not in {self.root / 'manifest.json'} ({hint}); "
                f"run `python build_kernels.py --arch {self.manifest.arch}`"
            )
        if source_root is not None:
            changed = []
            for rel, digest in entry.sources.items():
                path = source_root / rel
                if not path.exists() or file_sha256(path) != digest:
                    changed.append(rel)
            if changed:
                raise KernelStale(
                    f"kernel {family}/{key} is stale: {', '.join(changed)} changed since it was built; "
                    f"run `python build_kernels.py --arch {self.manifest.arch}`"
                )
        path = self.root / entry.cubin
        try:
            image = path.read_bytes()
        except FileNotFoundError:
            raise KernelMissing(f"kernel {family}/{key}: cubin {path} is missing; rebuild the kernels") from None
        import hashlib

        if hashlib.sha256(image).hexdigest() != entry.cubin_sha256:
            raise KernelStale(f"kernel {family}/{key}: cubin {path} does not match the manifest; rebuild the kernels")
        kernel = Kernel(self, entry, image)
        self._kernels[(family, key)] = kernel
        return kernel

    def kernel(self, family: str, key: str) -> Kernel:
        """A loaded kernel; one not loaded at open is loaded now (and checked the same way)."""
        k = self._kernels.get((family, key))
        if k is None:
            src = REPO if (REPO / "cute_kernels").is_dir() else None
            k = self._load(family, key, src)
        return k

    def __contains__(self, name: str | tuple[str, str]) -> bool:
        return _split(name) in self.manifest.kernels

    def keys(self, family: str) -> list[str]:
        return sorted(k for f, k in self.manifest.kernels if f == family)

    def tma_descriptor(self, address: int, p: Param, sizes: Mapping[str, int]) -> bytes:
        """The TMA descriptor of one buffer, encoded once per (address, settings, shape)."""
        enc = p.encode
        assert enc is not None
        dims = tuple(int(evaluate(d, sizes)) for d in enc.dims)
        strides = tuple(int(evaluate(s, sizes)) for s in enc.strides_bytes)
        key = (address, enc, dims, strides)
        blob = self._tma_cache.get(key)
        if blob is None:
            blob = self.device.encode_tma(enc.dtype, address, dims, strides, enc.box, enc.elem_strides,
                                          enc.swizzle, enc.l2, enc.oob, enc.interleave)
            self._tma_cache[key] = blob
        return blob


def _split(name: str | tuple[str, str]) -> tuple[str, str]:
    if isinstance(name, tuple):
        return name
    family, _, key = name.partition("/")
    if not key:
        raise ValueError(f"kernel name {name!r} must be 'family/key'")
    return family, key
