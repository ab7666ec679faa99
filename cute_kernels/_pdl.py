"""Programmatic dependent launch (PDL) in the decode kernels (imports the CuTe DSL; build time only).

A decode step is a chain of small kernels, each reading what the one before wrote. Launched with
`CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`, a kernel's CTAs may start while its
predecessor drains; they run what needs none of the predecessor's output (index math, L2
prefetches of the weights) and then block at `griddepcontrol.wait` until the predecessor has
completed and its memory is visible. The contract of a kernel built with config `pdl: True`
(`build_kernels.py` checks the PTX for the wait; the runtime sets the attribute only on those):

- every thread executes `wait()` before it reads anything an earlier kernel of the step writes
  and before it writes anything an earlier kernel reads; no thread returns before its wait, so
  the grid never completes before its predecessor (the next kernel's wait then covers both);
- what may come before the wait: weights, and the step's metadata (positions, slots, page
  tables: uploaded by the host before the step; a PDL kernel starts only after its predecessor
  started, and the step's first kernel is launched without the attribute, so after the upload);
  the GDN state slots too (only that layer's GDN launch of a step writes them);
- `launch_dependents()` is a hint: once every CTA has issued it (or exited), the next kernel's
  CTAs may be scheduled. It never makes the next kernel read early: that one waits for this
  grid's completion all the same.

Both instructions are no-ops in a grid launched without the attribute (PTX ISA,
"griddepcontrol"), so one cubin serves both launches and its numbers do not depend on it.
"""

from __future__ import annotations

from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import nvvm


def wait() -> None:
    """Block until the preceding grid has completed and its writes are visible (see above)."""
    cute.arch.griddepcontrol_wait()


def launch_dependents() -> None:
    """Let the next kernel's CTAs be scheduled once every CTA of this grid has said so."""
    cute.arch.griddepcontrol_launch_dependents()


def prefetch_l2(address: Any, nbytes: int) -> None:
    """Start bringing `nbytes` (a multiple of 16) from a 16-byte aligned global address (a
    cute.Pointer) into L2: one `cp.async.bulk.prefetch.L2` for the whole range, no register result
    (it never stalls the thread): the weights a kernel will stream, issued before `wait()`."""
    nvvm.cp_async_bulk_prefetch(address.to_llvm_ptr(), cutlass.Int32(nbytes).ir_value())
