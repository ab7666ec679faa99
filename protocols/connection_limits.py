"""The HTTP layer's limits and the two decisions made from them that are not h11 plumbing:
how long a request body may take, and which connection gives up its slot when the server is
at its connection ceiling.

Why the body deadline grows with the body: a fixed deadline long enough for a large upload
lets a slow sender hold a slot for that long with one byte (64 such sockets once locked every
client out for 300 s). The deadline is a short grace plus the time the body needs at a minimum
rate, counted from the end of the head; each byte buys only 1 / rate seconds, so dribbling
never keeps a connection alive.

Why eviction: idle keep-alive connections are closed first, but half-sent requests are not
idle; without eviction they fill the ceiling and every newcomer (`/health` included) gets a
503. At the ceiling the connection receiving its request at the lowest rate is answered 408
and closed, once it has had `eviction_min_age_s` to show its rate, so a fresh fast client is
never the one evicted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Protocol


@dataclass(frozen=True)
class HttpLimits:
    """Connection limits. Times are seconds, sizes bytes, rates bytes per second.

    max_header_bytes: request line plus headers (431).
    max_body_bytes: request body (413; refused from Content-Length before it is read).
    header_timeout_s: the whole head must arrive within this time of its first byte (and a new
        connection must start sending within it).
    body_grace_s, body_min_rate: the body must arrive within `body_grace_s` plus its length
        (declared, or received so far when chunked) divided by `body_min_rate`, counted from
        the end of the head (408)...
    body_timeout_s: ...and never later than this after the head.
    keepalive_timeout_s: idle time allowed between requests on one connection (advertised in a
        `Keep-Alive: timeout=N` header).
    write_stall_timeout_s: longest wait for a client to take our output before disconnecting it.
    max_clients: open connections; beyond it an idle one is closed, else the slowest sender
        evicted, else the newcomer gets a 503.
    eviction_min_age_s: a request must have been arriving for this long before its connection
        may be evicted for slowness.
    disconnect_probe_s: after a client half-closes its side while its answer is prepared, how
        often the server checks (with an interim `102 Processing`) that it is still there.
    max_pipelined_bytes: bytes of a next request buffered while the current one is answered.
    """

    max_header_bytes: int = 64 * 1024
    max_body_bytes: int = 64 << 20
    header_timeout_s: float = 30.0
    body_grace_s: float = 10.0
    body_min_rate: float = 64 * 1024
    body_timeout_s: float = 300.0
    keepalive_timeout_s: float = 360.0
    write_stall_timeout_s: float = 60.0
    shutdown_grace_s: float = 10.0
    max_clients: int = 64
    eviction_min_age_s: float = 1.0
    disconnect_probe_s: float = 0.5
    max_pipelined_bytes: int = 1 << 20
    read_size: int = 64 * 1024


def body_deadline(limits: HttpLimits, head_done_at: float, declared: Optional[int],
                  received: int) -> float:
    """The loop time by which the body must be complete (see the module docstring)."""
    expected = max(declared or 0, received)
    return head_done_at + min(limits.body_grace_s + expected / limits.body_min_rate,
                              limits.body_timeout_s)


class Receiving(Protocol):
    """What eviction needs to know of a connection."""

    receiving_since: Optional[float]  # loop time the current request's first byte came
    request_bytes: int                # bytes of the current request received so far


def slowest_sender(connections: Iterable[Receiving], now: float,
                   limits: HttpLimits) -> Optional[Receiving]:
    """The connection receiving a request at the lowest rate, among those receiving one for at
    least `eviction_min_age_s`; None when there is none."""
    slowest, slowest_rate = None, 0.0
    for connection in connections:
        since = connection.receiving_since
        if since is None or now - since < limits.eviction_min_age_s:
            continue
        rate = connection.request_bytes / (now - since)
        if slowest is None or rate < slowest_rate:
            slowest, slowest_rate = connection, rate
    return slowest
