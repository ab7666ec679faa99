"""One CUDA device: context, memory, streams, events, pinned buffers, modules, launches, graphs.

`CudaDevice` talks to the driver through `driver.call` only. `NullDevice` (in `null.py`) offers
the same methods without a GPU, so the layers above (arenas, kernel library, graphs) are tested on
CPU. The methods the rest of the runtime may use are exactly the public ones below.

The context is the device's primary context (so tests and benchmarks can share it with a peer
library such as torch), created with the scheduling policy of `INFERNIX_CUDA_SYNC`:

    spin      busy-wait for the GPU (lowest latency, one CPU core at 100 %)
    yield     spin but yield the thread between polls
    blocking  sleep on an OS primitive until the GPU finishes (least CPU)
    auto      the driver's heuristic (the default when the variable is unset)

An empty or unknown value is a startup error.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .driver import bindings, call, check
from .errors import CudaUnavailable, DeviceOutOfMemory, SyncPolicyError, gib

__all__ = [
    "SYNC_POLICIES",
    "sync_policy_from_env",
    "arch_for",
    "Stream",
    "Event",
    "PinnedBuffer",
    "Graph",
    "CudaDevice",
    "capture_graph",
]

SYNC_POLICIES = ("spin", "yield", "blocking", "auto")
_SYNC_FLAG_NAMES = {
    "spin": "CU_CTX_SCHED_SPIN",
    "yield": "CU_CTX_SCHED_YIELD",
    "blocking": "CU_CTX_SCHED_BLOCKING_SYNC",
    "auto": "CU_CTX_SCHED_AUTO",
}
_SCHED_MASK = 0x7


def sync_policy_from_env(environ: Mapping[str, str] | None = None) -> str:
    """The context scheduling policy from INFERNIX_CUDA_SYNC; unset means "auto"."""
    env = os.environ if environ is None else environ
    if "INFERNIX_CUDA_SYNC" not in env:
        return "auto"
    value = env["INFERNIX_CUDA_SYNC"].strip().lower()
    if value not in SYNC_POLICIES:
        raise SyncPolicyError(
            f"INFERNIX_CUDA_SYNC={env['INFERNIX_CUDA_SYNC']!r} is not one of {', '.join(SYNC_POLICIES)}"
        )
    return value


def arch_for(major: int, minor: int) -> str:
    """The kernel build target for a compute capability ("sm_90a" for an H100/H200)."""
    if (major, minor) == (9, 0):
        return "sm_90a"
    if (major, minor) == (10, 0):
        return "sm_100a"
    if major == 12:
        return "sm_120a"
    return f"sm_{major}{minor}"


@dataclass
class Stream:
    """A CUDA stream. `handle` is what driver calls take (0 means the legacy stream)."""

    handle: Any
    device: Any

    def synchronize(self) -> None:
        self.device.stream_synchronize(self)


@dataclass
class Event:
    handle: Any
    device: Any

    def record(self, stream: Stream) -> None:
        self.device.event_record(self, stream)

    def synchronize(self) -> None:
        self.device.event_synchronize(self)

    def query(self) -> bool:
        """Whether the work before the record has completed (never blocks)."""
        return self.device.event_query(self)

    def elapsed_ms(self, start: "Event") -> float:
        """Milliseconds from `start` to this event (both recorded and complete)."""
        return self.device.event_elapsed_ms(start, self)


@dataclass
class PinnedBuffer:
    """Page-locked host memory, viewable as a NumPy array, for fast async copies."""

    ptr: int
    nbytes: int
    device: Any
    _keepalive: Any = None

    def array(self, dtype: Any = np.uint8, count: int | None = None) -> np.ndarray:
        itemsize = np.dtype(dtype).itemsize
        n = self.nbytes // itemsize if count is None else count
        if n * itemsize > self.nbytes:
            raise ValueError(f"pinned buffer holds {self.nbytes} bytes, not {n} x {itemsize}")
        raw = (ctypes.c_uint8 * (n * itemsize)).from_address(self.ptr)
        return np.frombuffer(raw, dtype=dtype, count=n)

    def free(self) -> None:
        if self.ptr:
            self.device.free_pinned(self)
            self.ptr = 0


class Graph:
    """An instantiated CUDA graph captured from one stream; `replay` launches it."""

    def __init__(self, device: Any, graph: Any, exec_handle: Any, nodes: int):
        self.device = device
        self.graph = graph
        self.exec_handle = exec_handle
        self.nodes = nodes

    def replay(self, stream: Stream) -> None:
        self.device.graph_launch(self, stream)

    def destroy(self) -> None:
        if self.exec_handle is not None:
            self.device.graph_destroy(self)
            self.exec_handle = None


class CudaDevice:
    """The GPU `ordinal` with its primary context made current on the calling thread."""

    is_null = False

    def __init__(self, ordinal: int = 0, sync: str | None = None):
        drv = bindings()
        self._drv = drv
        self.sync = sync if sync is not None else sync_policy_from_env()
        if self.sync not in SYNC_POLICIES:
            raise SyncPolicyError(f"sync policy {self.sync!r} is not one of {', '.join(SYNC_POLICIES)}")
        call("cuInit", 0)
        count = call("cuDeviceGetCount")
        if count == 0:
            raise CudaUnavailable("no CUDA device is visible")
        if not 0 <= ordinal < count:
            raise CudaUnavailable(f"--device {ordinal} asked for, but only {count} CUDA device(s) are visible (0..{count - 1})")
        self.ordinal = ordinal
        self.handle = call("cuDeviceGet", ordinal)
        self.name = call("cuDeviceGetName", 256, self.handle).split(b"\0")[0].decode()
        attr = drv.CUdevice_attribute
        self.cc = (self._attr(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                   self._attr(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))
        self.arch = arch_for(*self.cc)
        self.sm_count = self._attr(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        self.smem_optin = self._attr(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        self.total_memory = int(call("cuDeviceTotalMem", self.handle))
        self.context = self._primary_context()

    def _attr(self, a: Any) -> int:
        return int(call("cuDeviceGetAttribute", a, self.handle))

    def _primary_context(self) -> Any:
        drv = self._drv
        want = int(getattr(drv.CUctx_flags, _SYNC_FLAG_NAMES[self.sync]))
        flags, active = call("cuDevicePrimaryCtxGetState", self.handle)
        if not active:
            call("cuDevicePrimaryCtxSetFlags", self.handle, want)
        elif (int(flags) & _SCHED_MASK) != want and self.sync != "auto":
            # Another library created the context first; its policy cannot change under it.
            raise SyncPolicyError(
                f"the CUDA context of device {self.ordinal} already exists with scheduling flags "
                f"{int(flags) & _SCHED_MASK:#x}; INFERNIX_CUDA_SYNC={self.sync} needs {want:#x}"
            )
        ctx = call("cuDevicePrimaryCtxRetain", self.handle)
        call("cuCtxSetCurrent", ctx)
        return ctx

    def make_current(self) -> None:
        call("cuCtxSetCurrent", self.context)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ordinal": self.ordinal,
            "compute_capability": f"{self.cc[0]}.{self.cc[1]}",
            "arch": self.arch,
            "sms": self.sm_count,
            "memory": gib(self.total_memory),
            "driver": int(call("cuDriverGetVersion")),
            "sync": self.sync,
        }

    # ------------------------------------------------------------------ memory
    def free_memory(self) -> int:
        free, _ = call("cuMemGetInfo")
        return int(free)

    def mem_alloc(self, nbytes: int, purpose: str = "buffer") -> int:
        try:
            return int(call("cuMemAlloc", max(int(nbytes), 1)))
        except DeviceOutOfMemory:
            free = self.free_memory()
            raise DeviceOutOfMemory(
                f"out of device memory allocating {purpose}: {gib(nbytes)} requested, "
                f"{gib(free)} free of {gib(self.total_memory)} on {self.name}",
                "cuMemAlloc",
                "CUDA_ERROR_OUT_OF_MEMORY",
            ) from None

    def mem_free(self, ptr: int) -> None:
        call("cuMemFree", ptr)

    def memcpy_htod(self, dst: int, src: np.ndarray, stream: Stream | None = None) -> None:
        src = np.ascontiguousarray(src)
        if stream is None:
            call("cuMemcpyHtoD", dst, src.ctypes.data, src.nbytes)
        else:
            call("cuMemcpyHtoDAsync", dst, src.ctypes.data, src.nbytes, stream.handle)

    def memcpy_dtoh(self, dst: np.ndarray, src: int, stream: Stream | None = None) -> np.ndarray:
        if not dst.flags.c_contiguous:
            raise ValueError("memcpy_dtoh needs a contiguous destination array")
        if stream is None:
            call("cuMemcpyDtoH", dst.ctypes.data, src, dst.nbytes)
        else:
            call("cuMemcpyDtoHAsync", dst.ctypes.data, src, dst.nbytes, stream.handle)
        return dst

    def memcpy_dtod(self, dst: int, src: int, nbytes: int, stream: Stream) -> None:
        call("cuMemcpyDtoDAsync", dst, src, nbytes, stream.handle)

    def memcpy2d_dtod(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int,
                      stream: Stream) -> None:
        """`height` rows of `width` bytes from src to dst, rows `src_pitch` / `dst_pitch` bytes
        apart (strided rows in one copy, graph-capturable)."""
        drv = self._drv
        copy = drv.CUDA_MEMCPY2D()
        copy.srcMemoryType = copy.dstMemoryType = drv.CUmemorytype.CU_MEMORYTYPE_DEVICE
        copy.srcDevice, copy.srcPitch = src, src_pitch
        copy.dstDevice, copy.dstPitch = dst, dst_pitch
        copy.WidthInBytes, copy.Height = width, height
        call("cuMemcpy2DAsync", copy, stream.handle)

    def memset_d8(self, ptr: int, value: int, nbytes: int, stream: Stream) -> None:
        # Always the async form on our stream: the sync form runs on the legacy stream, which
        # does not order with non-blocking streams.
        call("cuMemsetD8Async", ptr, value & 0xFF, nbytes, stream.handle)

    def memset_d16(self, ptr: int, value: int, count: int, stream: Stream) -> None:
        call("cuMemsetD16Async", ptr, value & 0xFFFF, count, stream.handle)

    def pinned(self, nbytes: int) -> PinnedBuffer:
        ptr = int(call("cuMemHostAlloc", max(int(nbytes), 1), 0))
        return PinnedBuffer(ptr=ptr, nbytes=int(nbytes), device=self)

    def free_pinned(self, buf: PinnedBuffer) -> None:
        call("cuMemFreeHost", buf.ptr)

    # ------------------------------------------------------------------ streams and events
    def create_stream(self, priority: int = 0) -> Stream:
        flags = int(self._drv.CUstream_flags.CU_STREAM_NON_BLOCKING)
        return Stream(call("cuStreamCreateWithPriority", flags, priority), self)

    def destroy_stream(self, stream: Stream) -> None:
        call("cuStreamDestroy", stream.handle)

    def stream_synchronize(self, stream: Stream) -> None:
        call("cuStreamSynchronize", stream.handle)

    def synchronize(self) -> None:
        call("cuCtxSynchronize")

    def create_event(self, timing: bool = True) -> Event:
        flags = 0 if timing else int(self._drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        return Event(call("cuEventCreate", flags), self)

    def event_record(self, event: Event, stream: Stream) -> None:
        call("cuEventRecord", event.handle, stream.handle)

    def event_synchronize(self, event: Event) -> None:
        call("cuEventSynchronize", event.handle)

    def event_query(self, event: Event) -> bool:
        drv = self._drv
        result = drv.cuEventQuery(event.handle)
        err = result[0] if isinstance(result, tuple) else result
        if err == drv.CUresult.CUDA_ERROR_NOT_READY:  # not an error: the work is still running
            return False
        check(result, "cuEventQuery")
        return True

    def destroy_event(self, event: Event) -> None:
        call("cuEventDestroy", event.handle)

    def event_elapsed_ms(self, start: Event, end: Event) -> float:
        return float(call("cuEventElapsedTime", start.handle, end.handle))

    def stream_wait_event(self, stream: Stream, event: Event) -> None:
        call("cuStreamWaitEvent", stream.handle, event.handle, 0)

    # ------------------------------------------------------------------ modules and launches
    def load_module(self, image: bytes) -> Any:
        return call("cuModuleLoadData", image)

    def get_function(self, module: Any, name: str) -> Any:
        return call("cuModuleGetFunction", module, name.encode())

    def set_dynamic_smem(self, func: Any, nbytes: int) -> None:
        attr = self._drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        call("cuFuncSetAttribute", func, attr, int(nbytes))

    def blocks_per_sm(self, func: Any, threads: int, dynamic_smem: int) -> int:
        """How many CTAs of this function the driver fits on one SM (registers, shared memory)."""
        return int(call("cuOccupancyMaxActiveBlocksPerMultiprocessor", func, threads, dynamic_smem))

    def param_sizes(self, func: Any, count: int) -> list[int] | None:
        """Each parameter's size as the driver sees it, or None if the driver cannot say."""
        if not hasattr(self._drv, "cuFuncGetParamInfo"):
            return None
        sizes = []
        for i in range(count):
            _, size = call("cuFuncGetParamInfo", func, i)
            sizes.append(int(size))
        extra = self._drv.cuFuncGetParamInfo(func, count)[0]
        if extra == self._drv.CUresult.CUDA_SUCCESS:
            sizes.append(-1)  # more parameters than the manifest lists
        return sizes

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
        """A 128-byte TMA descriptor from `cuTensorMapEncodeTiled` (dims innermost first)."""
        drv = self._drv
        tmap = call(
            "cuTensorMapEncodeTiled",
            getattr(drv.CUtensorMapDataType, "CU_TENSOR_MAP_DATA_TYPE_" + dtype),
            len(dims),
            address,
            [drv.cuuint64_t(int(d)) for d in dims],
            [drv.cuuint64_t(int(s)) for s in strides_bytes],
            [drv.cuuint32_t(int(b)) for b in box],
            [drv.cuuint32_t(int(e)) for e in elem_strides],
            getattr(drv.CUtensorMapInterleave, "CU_TENSOR_MAP_INTERLEAVE_" + interleave),
            getattr(drv.CUtensorMapSwizzle, "CU_TENSOR_MAP_SWIZZLE_" + swizzle),
            getattr(drv.CUtensorMapL2promotion, "CU_TENSOR_MAP_L2_PROMOTION_" + l2),
            getattr(drv.CUtensorMapFloatOOBfill, "CU_TENSOR_MAP_FLOAT_OOB_FILL_" + oob),
        )
        return ctypes.string_at(tmap.getPtr(), 128)

    def launch_config(self, grid: Sequence[int], block: Sequence[int], smem: int, cluster: Sequence[int],
                      pdl: bool = False) -> Any:
        """A reusable CUlaunchConfig; the cluster attribute is set only for clusters > 1 CTA; pdl:
        programmatic stream serialization (the kernel may start while the previous kernel in the
        stream drains and must wait for it itself: only for kernels built with `pdl`)."""
        drv = self._drv
        cfg = drv.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = (int(g) for g in grid)
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = (int(b) for b in block)
        cfg.sharedMemBytes = int(smem)
        attrs = []
        if tuple(cluster) != (1, 1, 1):
            a = drv.CUlaunchAttribute()
            a.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            a.value.clusterDim.x, a.value.clusterDim.y, a.value.clusterDim.z = (int(c) for c in cluster)
            attrs.append(a)
        if pdl:
            a = drv.CUlaunchAttribute()
            a.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            a.value.programmaticStreamSerializationAllowed = 1
            attrs.append(a)
        cfg.attrs = attrs
        cfg.numAttrs = len(attrs)
        return cfg

    def launch(self, func: Any, config: Any, stream: Stream, params_address: int, param_sizes: Sequence[int] = ()) -> None:
        config.hStream = stream.handle
        call("cuLaunchKernelEx", config, func, params_address, 0)

    # ------------------------------------------------------------------ graphs
    def begin_capture(self, stream: Stream) -> None:
        mode = self._drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        call("cuStreamBeginCapture", stream.handle, mode)

    def end_capture(self, stream: Stream) -> Graph:
        graph = call("cuStreamEndCapture", stream.handle)
        counted = call("cuGraphGetNodes", graph, 0)  # (nodes, count) with no room for nodes
        nodes = int(counted[-1]) if isinstance(counted, tuple) else int(counted)
        exec_handle = call("cuGraphInstantiate", graph, 0)
        return Graph(self, graph, exec_handle, nodes)

    def graph_launch(self, graph: Graph, stream: Stream) -> None:
        call("cuGraphLaunch", graph.exec_handle, stream.handle)

    def graph_destroy(self, graph: Graph) -> None:
        call("cuGraphExecDestroy", graph.exec_handle)
        call("cuGraphDestroy", graph.graph)


def capture_graph(device: Any, stream: Stream, record: Any) -> Graph:
    """Capture everything `record()` launches on `stream` into an instantiated graph.

    If `record` raises, the capture is ended and discarded so the stream is usable again.
    """
    device.begin_capture(stream)
    try:
        record()
    except BaseException:
        try:
            device.end_capture(stream).destroy()
        except Exception:  # the capture may already be invalidated; the first error matters
            pass
        raise
    return device.end_capture(stream)
