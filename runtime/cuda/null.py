"""A device without a GPU, for CPU tests of the CUDA layer.

`NullDevice` has `CudaDevice`'s methods. Memory is real host memory (so uploads and downloads
round-trip and tests can check them), modules are accepted when they look like cubins (ELF), and
kernels do not run: each launch is recorded in `launches` with its function name, grid, block,
shared memory, cluster and the exact parameter bytes the driver would receive. Graph capture
records the launches made while capturing; a replay records them again. TMA descriptors are a
deterministic packing of the encode arguments, so tests can check what would have been encoded.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .device import SYNC_POLICIES, Event, Graph, PinnedBuffer, Stream
from .errors import DeviceOutOfMemory, SyncPolicyError, gib

__all__ = ["NullDevice", "RecordedLaunch"]

_BASE = 0x7F00_0000_0000


@dataclass
class RecordedLaunch:
    function: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    cluster: tuple[int, int, int]
    params: list[bytes]
    stream: int
    graph_replay: bool = False
    pdl: bool = False  # launched with programmatic stream serialization


@dataclass
class _Config:
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    cluster: tuple[int, int, int]
    pdl: bool


class NullDevice:
    """A pretend H200 (sm_90a) with `total_memory` bytes; see the module docstring."""

    is_null = True

    def __init__(self, total_memory: int = 8 << 30, arch: str = "sm_90a", sync: str = "auto"):
        if sync not in SYNC_POLICIES:
            raise SyncPolicyError(f"sync policy {sync!r} is not one of {', '.join(SYNC_POLICIES)}")
        self.sync = sync
        self.ordinal = 0
        self.name = "null device"
        self.arch = arch
        self.cc = (9, 0)
        self.sm_count = 132
        self.smem_optin = 232448
        self.total_memory = int(total_memory)
        self.launches: list[RecordedLaunch] = []
        self._next = _BASE
        self._allocs: dict[int, np.ndarray] = {}
        self._sizes: dict[int, int] = {}
        self._used = 0
        self._capturing: dict[int, list[RecordedLaunch]] = {}
        self._streams = 0
        self._functions: dict[int, str] = {}
        self._smem_attr: dict[int, int] = {}

    def make_current(self) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "arch": self.arch, "memory": gib(self.total_memory), "sync": self.sync}

    # ------------------------------------------------------------------ memory
    def free_memory(self) -> int:
        return self.total_memory - self._used

    def mem_alloc(self, nbytes: int, purpose: str = "buffer") -> int:
        nbytes = max(int(nbytes), 1)
        if nbytes > self.free_memory():
            raise DeviceOutOfMemory(
                f"out of device memory allocating {purpose}: {gib(nbytes)} requested, "
                f"{gib(self.free_memory())} free of {gib(self.total_memory)} on {self.name}",
                "cuMemAlloc",
                "CUDA_ERROR_OUT_OF_MEMORY",
            )
        ptr = self._next
        self._next += (nbytes + 0xFFFF) & ~0xFFFF
        # Host memory stands in for device memory only up to 64 MiB per allocation; larger
        # ones (arena sizing tests) are address space only.
        self._allocs[ptr] = np.zeros(nbytes if nbytes <= (64 << 20) else 0, np.uint8)
        self._used += nbytes
        self._sizes[ptr] = nbytes
        return ptr

    def mem_free(self, ptr: int) -> None:
        self._allocs.pop(ptr)
        self._used -= self._sizes.pop(ptr)

    def _view(self, ptr: int, nbytes: int) -> np.ndarray:
        for base, mem in self._allocs.items():
            if base <= ptr and ptr + nbytes <= base + len(mem):
                return mem[ptr - base : ptr - base + nbytes]
        raise ValueError(f"null device: [{ptr:#x}, +{nbytes}) is not inside one host-backed allocation")

    def memcpy_htod(self, dst: int, src: np.ndarray, stream: Stream | None = None) -> None:
        data = np.ascontiguousarray(src).view(np.uint8).reshape(-1)
        self._view(dst, data.nbytes)[:] = data

    def memcpy_dtoh(self, dst: np.ndarray, src: int, stream: Stream | None = None) -> np.ndarray:
        dst.reshape(-1).view(np.uint8)[:] = self._view(src, dst.nbytes)
        return dst

    def memcpy_dtod(self, dst: int, src: int, nbytes: int, stream: Stream) -> None:
        self._view(dst, nbytes)[:] = self._view(src, nbytes).copy()

    def memcpy2d_dtod(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int,
                      stream: Stream) -> None:
        rows = [self._view(src + r * src_pitch, width).copy() for r in range(height)]
        for r, row in enumerate(rows):
            self._view(dst + r * dst_pitch, width)[:] = row

    def memset_d8(self, ptr: int, value: int, nbytes: int, stream: Stream) -> None:
        self._view(ptr, nbytes)[:] = value & 0xFF

    def memset_d16(self, ptr: int, value: int, count: int, stream: Stream) -> None:
        self._view(ptr, 2 * count).view(np.uint16)[:] = value & 0xFFFF

    def pinned(self, nbytes: int) -> PinnedBuffer:
        buf = ctypes.create_string_buffer(max(int(nbytes), 1))
        return PinnedBuffer(ptr=ctypes.addressof(buf), nbytes=int(nbytes), device=self, _keepalive=buf)

    def free_pinned(self, buf: PinnedBuffer) -> None:
        buf._keepalive = None

    # ------------------------------------------------------------------ streams and events
    def create_stream(self, priority: int = 0) -> Stream:
        self._streams += 1
        return Stream(self._streams, self)

    def destroy_stream(self, stream: Stream) -> None:
        pass

    def stream_synchronize(self, stream: Stream) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def create_event(self, timing: bool = True) -> Event:
        return Event(handle=[None], device=self)

    def event_record(self, event: Event, stream: Stream) -> None:
        event.handle[0] = len(self.launches)

    def event_synchronize(self, event: Event) -> None:
        pass

    def event_query(self, event: Event) -> bool:
        return True  # nothing runs asynchronously here

    def destroy_event(self, event: Event) -> None:
        pass

    def event_elapsed_ms(self, start: Event, end: Event) -> float:
        return 0.0

    def stream_wait_event(self, stream: Stream, event: Event) -> None:
        pass

    # ------------------------------------------------------------------ modules and launches
    def load_module(self, image: bytes) -> Any:
        if bytes(image[:4]) != b"\x7fELF":
            raise ValueError("null device: module image is not an ELF cubin")
        return ("module", len(image))

    def get_function(self, module: Any, name: str) -> Any:
        handle = len(self._functions) + 1
        self._functions[handle] = name
        return handle

    def set_dynamic_smem(self, func: Any, nbytes: int) -> None:
        self._smem_attr[func] = int(nbytes)

    def blocks_per_sm(self, func: Any, threads: int, dynamic_smem: int) -> int:
        return 1

    def param_sizes(self, func: Any, count: int) -> list[int] | None:
        return None

    def encode_tma(
        self,
        dtype: str,
        address: int,
        dims: Sequence[int],
        strides_bytes: Sequence[int],
        box: Sequence[int],
        elem_strides: Sequence[int],
        swizzle: str,
        l2: str,
        oob: str,
        interleave: str = "NONE",
    ) -> bytes:
        r = len(dims)
        blob = struct.pack("<Q", address)
        blob += struct.pack(f"<{r}Q", *dims) + struct.pack(f"<{max(r - 1, 0)}Q", *strides_bytes)
        if any(not 1 <= b <= 256 for b in box):
            # cuTensorMapEncodeTiled rejects boxes outside 1..256 per dimension; so do we.
            raise ValueError(f"null device: TMA box {tuple(box)} has a side outside 1..256")
        blob += struct.pack(f"<{len(box)}I", *box) + f"{dtype}|{swizzle}|{l2}|{oob}".encode()
        return blob[:128].ljust(128, b"\0")

    def launch_config(self, grid: Sequence[int], block: Sequence[int], smem: int, cluster: Sequence[int],
                      pdl: bool = False) -> Any:
        return _Config(tuple(grid), tuple(block), int(smem), tuple(cluster), bool(pdl))  # type: ignore[arg-type]

    def launch(self, func: Any, config: Any, stream: Stream, params_address: int, param_sizes: Sequence[int] = ()) -> None:
        sizes = list(param_sizes)
        ptrs = (ctypes.c_void_p * len(sizes)).from_address(params_address) if sizes else []
        params = [ctypes.string_at(p, n) for p, n in zip(ptrs, sizes)]
        if config.smem > 48 * 1024 and self._smem_attr.get(func, 0) < config.smem:
            raise ValueError(f"null device: {self._functions[func]} launched with {config.smem} B of shared "
                             "memory without raising its limit first")
        rec = RecordedLaunch(self._functions[func], config.grid, config.block, config.smem, config.cluster, params,
                             stream.handle, pdl=config.pdl)
        if stream.handle in self._capturing:
            self._capturing[stream.handle].append(rec)
        else:
            self.launches.append(rec)

    # ------------------------------------------------------------------ graphs
    def begin_capture(self, stream: Stream) -> None:
        if stream.handle in self._capturing:
            raise RuntimeError("null device: stream is already capturing")
        self._capturing[stream.handle] = []

    def end_capture(self, stream: Stream) -> Graph:
        recorded = self._capturing.pop(stream.handle)
        return Graph(self, recorded, exec_handle=recorded, nodes=len(recorded))

    def graph_launch(self, graph: Graph, stream: Stream) -> None:
        for rec in graph.exec_handle:
            self.launches.append(
                RecordedLaunch(rec.function, rec.grid, rec.block, rec.smem, rec.cluster, rec.params, stream.handle, True,
                               rec.pdl)
            )

    def graph_destroy(self, graph: Graph) -> None:
        pass
