"""Storage operations the prefix cache asks for, and the engine thread's executor of them.

The scheduler and the prefix cache are pure bookkeeping: they decide that a lane's state goes to
a snapshot slot, that a page's K/V goes to host memory, and so on, and queue one record per
copy. The engine applies the queue on the runner, in order, at three points: after `schedule()`
(before the step's compute: restores, demotions of pages about to be reused, pauses), after
`update()` (captures of the state a chunk just reached) and after `finish()` (the end-of-output
snapshot). Order within the queue is decision order, which is what makes reuse safe: a page or
slot is always read by an earlier record before a later one overwrites it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

from runtime.model.runner import HostArrays, HostReady, HostTransfer, ModelRunner


class HostCopy:
    """Host memory holding one slot's state or one page's K/V. `nbytes` is known when the copy
    is decided (for the host budget); `data` is set when the record that makes it runs: the
    runner's `HostTransfer`, perhaps still in flight (nothing here waits for it: a load is
    ordered after it by the runner; only the file and disk tiers wait, to read the bytes)."""

    __slots__ = ("nbytes", "data")

    def __init__(self, nbytes: int, data: Optional[HostTransfer] = None):
        self.nbytes = nbytes
        self.data = data

    @classmethod
    def of(cls, arrays: HostArrays) -> "HostCopy":
        """A copy of arrays already on the host (read from the cache file or the disk tier)."""
        ready = HostReady(tuple(arrays))
        return cls(ready.nbytes, ready)


@dataclass(frozen=True)
class CopySlot:
    src: int
    dst: int


@dataclass(frozen=True)
class SaveSlot:
    slot: int
    into: HostCopy


@dataclass(frozen=True)
class LoadSlot:
    source: HostCopy
    slot: int


@dataclass(frozen=True)
class SavePages:
    pages: tuple[int, ...]
    into: HostCopy


@dataclass(frozen=True)
class LoadPages:
    source: HostCopy
    pages: tuple[int, ...]


@dataclass(frozen=True)
class SpillSnapshot:
    """A shared snapshot the host tier gives up, for the disk tier (`runtime.engine.disk_tier`):
    where its state and its chain's blocks are at this point of the queue (a slot and pages
    that later records may reuse are read before they run). blocks: per chain block, its page
    id or its host copy (the disk tier reads those it has no file of yet)."""

    name: str
    position: int
    chain: tuple[bytes, ...]
    tail: tuple[int, ...]
    hits: int
    slot: Optional[int]
    state: Optional[HostCopy]
    tail_copy: Optional[HostCopy]
    blocks: tuple[Union[int, HostCopy], ...]


CacheOp = Union[CopySlot, SaveSlot, LoadSlot, SavePages, LoadPages, SpillSnapshot]

# The disk tier's writer: runs a `SpillSnapshot`, returns the bytes it read from the device.
Spill = Callable[[ModelRunner, SpillSnapshot], int]


@dataclass
class Traffic:
    """Bytes moved by applied records (the /metrics host<->device counters)."""

    device_to_host_bytes: int = 0
    host_to_device_bytes: int = 0
    device_copies: int = 0


def apply_ops(runner: ModelRunner, ops: Sequence[CacheOp], traffic: Traffic,
              spill: Optional[Spill] = None) -> None:
    """Run the records on the runner, in order (`SpillSnapshot`s through `spill`: the prefix
    cache queues them only when it has a disk tier)."""
    for op in ops:
        if isinstance(op, CopySlot):
            runner.copy_slot(op.src, op.dst)
            traffic.device_copies += 1
        elif isinstance(op, SaveSlot):
            op.into.data = runner.save_slot(op.slot)
            traffic.device_to_host_bytes += op.into.nbytes
        elif isinstance(op, LoadSlot):
            runner.load_slot(op.slot, _data(op.source))
            traffic.host_to_device_bytes += op.source.nbytes
        elif isinstance(op, SavePages):
            op.into.data = runner.read_pages(op.pages)
            traffic.device_to_host_bytes += op.into.nbytes
        elif isinstance(op, LoadPages):
            runner.write_pages(op.pages, _data(op.source))
            traffic.host_to_device_bytes += op.source.nbytes
        elif isinstance(op, SpillSnapshot) and spill is not None:
            traffic.device_to_host_bytes += spill(runner, op)
        else:
            raise TypeError(f"unknown cache operation {op!r}")


def _data(copy: HostCopy) -> HostTransfer:
    if copy.data is None:
        raise AssertionError("a host copy is read before the record that fills it ran")
    return copy.data
