"""Programmatic dependent launch (PDL) over a decode or verification step's launches (`chain`).

A decode step is hundreds of small dependent kernels; between two of them the GPU drains one grid
before it starts the next. With the launch attribute `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`
the next kernel's CTAs start while the previous grid drains (or once it says
`griddepcontrol.launch_dependents`), run their prologue (index math, L2 prefetches of weights)
and wait at `griddepcontrol.wait` for its memory (cute_kernels/_pdl.py has the kernels' side).

`chain` gives the attribute to every launch of a kernel built with `pdl` whose predecessor in the
plan is one of our kernels too: never to the plan's first launch (in a graph it follows a copy or
the previous replay, ordered as usual) nor to one after a collective (another library's kernel).
A kernel without `pdl` keeps the plain launch, and as it starts only when its predecessor has
completed, the next PDL kernel's wait covers every kernel before it. Stream capture turns the
attribute into programmatic graph edges, so decode graphs keep it.
"""

from __future__ import annotations

from runtime.cuda.kernels import BoundLaunch


def chain(launches: list) -> list:
    """The plan with PDL launches where allowed (module docstring); other entries as they are."""
    out = []
    for i, launch in enumerate(launches):
        if i and isinstance(launch, BoundLaunch) and isinstance(launches[i - 1], BoundLaunch) \
                and launch.kernel.entry.pdl:
            launch = launch.programmatic()
        out.append(launch)
    return out
