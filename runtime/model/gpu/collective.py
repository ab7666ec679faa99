"""The collective a tensor-parallel rank's forward pass calls: the interface, not a binding.

A rank's launch list (`layers.Forward.bind`) holds an `AllReduce` after each layer's mixer output
projection (`o_proj`, `out_proj`) and after its MLP's `down`, summing the ranks' partial rows in
the residual delta buffer in place before `add_norm` reads them. It is a callable like a bound
kernel, so it is launched and captured into CUDA graphs with the kernels around it (NCCL's
all-reduce on a stream is graph-capturable). One GPU has no collective: `Forward` gets None and
appends nothing, so the single-GPU launch sequence is unchanged.

The NCCL binding behind the protocol (libnccl through ctypes, loaded by cuda-pathfinder; the
choice is argued in docs/architecture.md, "Tensor parallel") is not written yet: it needs a
machine with several GPUs to run on.
"""

from __future__ import annotations

from typing import Any, Protocol


class Collective(Protocol):
    """One rank's view of the communicator of all ranks of a model.

    rank, world_size: this rank and the number of ranks (>= 2: one GPU uses no collective).
    all_reduce: queue on `stream` the in-place sum over all ranks of `count` elements of
        `dtype` ("bf16" for the residual deltas) at device address `buffer_ptr`; every rank
        calls it in the same order with the same count.
    """

    rank: int
    world_size: int

    def all_reduce(self, buffer_ptr: int, count: int, dtype: str, stream: Any) -> None: ...


class AllReduce:
    """One all-reduce point of a launch list: calling it on a stream queues the collective."""

    __slots__ = ("collective", "buffer_ptr", "count", "dtype")

    def __init__(self, collective: Collective, buffer_ptr: int, count: int, dtype: str):
        self.collective = collective
        self.buffer_ptr = buffer_ptr
        self.count = count
        self.dtype = dtype

    def __call__(self, stream: Any) -> None:
        self.collective.all_reduce(self.buffer_ptr, self.count, self.dtype, stream)
