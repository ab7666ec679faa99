"""Device arenas: all device memory is reserved once at startup, then handed out by offset.

`DeviceArenas.reserve(device, weights=..., kv_pages=..., state_slots=..., workspace=...)` takes one
allocation per arena (in that order, largest commitments first) and fails with a message in GiB
that says which arena did not fit, how much was free, and what was already reserved. Requests never
allocate device memory: they take space from an arena with `Arena.take`, and the phase-reused
workspace is `reset()` between phases.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import DeviceOutOfMemory, gib

__all__ = ["ARENA_NAMES", "Buffer", "Arena", "DeviceArenas"]

ARENA_NAMES = ("weights", "kv_pages", "state_slots", "workspace")
ALIGN = 256  # every buffer starts 256-byte aligned (TMA needs 16, vector loads 16)


@dataclass(frozen=True)
class Buffer:
    """A device buffer: address, size, and (optionally) the NumPy dtype and shape it holds."""

    ptr: int
    nbytes: int
    name: str = ""
    dtype: Any = None
    shape: tuple[int, ...] = ()

    def __int__(self) -> int:
        return self.ptr


@dataclass
class Arena:
    """A bump allocator over one device allocation."""

    name: str
    base: int
    capacity: int
    used: int = 0
    high_water: int = 0
    buffers: list[Buffer] = field(default_factory=list)

    def take(self, nbytes: int, name: str = "", dtype: Any = None, shape: tuple[int, ...] = ()) -> Buffer:
        nbytes = int(nbytes)
        start = (self.used + ALIGN - 1) // ALIGN * ALIGN
        if start + nbytes > self.capacity:
            raise DeviceOutOfMemory(
                f"the {self.name} arena is full: {name or 'a buffer'} needs {gib(nbytes)}, "
                f"{gib(self.capacity - start)} of {gib(self.capacity)} left"
            )
        buf = Buffer(self.base + start, nbytes, name, dtype, tuple(shape))
        self.used = start + nbytes
        self.high_water = max(self.high_water, self.used)
        self.buffers.append(buf)
        return buf

    def take_array(self, name: str, shape: tuple[int, ...], dtype: Any) -> Buffer:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        return self.take(nbytes, name, np.dtype(dtype), tuple(shape))

    def reset(self) -> None:
        """Forget every buffer (the workspace between phases); the memory stays reserved."""
        self.used = 0
        self.buffers.clear()

    @property
    def free(self) -> int:
        return self.capacity - self.used


class DeviceArenas:
    """The startup reservation: one `Arena` per name in ARENA_NAMES (sizes in bytes)."""

    def __init__(self, device: Any, arenas: Mapping[str, Arena]):
        self.device = device
        self.arenas = dict(arenas)

    @classmethod
    def reserve(cls, device: Any, **sizes: int) -> DeviceArenas:
        unknown = set(sizes) - set(ARENA_NAMES)
        if unknown:
            raise ValueError(f"unknown arena(s) {sorted(unknown)}; arenas are {', '.join(ARENA_NAMES)}")
        taken: dict[str, Arena] = {}
        try:
            for name in ARENA_NAMES:
                nbytes = int(sizes.get(name, 0))
                if nbytes <= 0:
                    continue
                free = device.free_memory()
                if nbytes > free:
                    raise DeviceOutOfMemory(cls._message(device, name, nbytes, free, taken))
                try:
                    base = device.mem_alloc(nbytes, f"the {name} arena")
                except DeviceOutOfMemory:
                    raise DeviceOutOfMemory(cls._message(device, name, nbytes, device.free_memory(), taken)) from None
                taken[name] = Arena(name, base, nbytes)
        except BaseException:
            for arena in taken.values():
                device.mem_free(arena.base)
            raise
        return cls(device, taken)

    @staticmethod
    def _message(device: Any, name: str, nbytes: int, free: int, taken: Mapping[str, Arena]) -> str:
        done = ", ".join(f"{a.name} {gib(a.capacity)}" for a in taken.values()) or "nothing yet"
        return (
            f"cannot reserve the {name} arena: {gib(nbytes)} requested but only {gib(free)} free of "
            f"{gib(device.total_memory)} on {device.name} (already reserved: {done}); "
            f"lower --kv-capacity or the lane count, or use a smaller weight format"
        )

    def __getitem__(self, name: str) -> Arena:
        try:
            return self.arenas[name]
        except KeyError:
            raise KeyError(f"no {name} arena was reserved (reserved: {', '.join(self.arenas) or 'none'})") from None

    def release(self) -> None:
        for arena in self.arenas.values():
            self.device.mem_free(arena.base)
        self.arenas.clear()

    def summary(self) -> dict[str, str]:
        return {n: f"{gib(a.used)} used of {gib(a.capacity)}" for n, a in self.arenas.items()}
