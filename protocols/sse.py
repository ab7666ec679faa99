"""Server-sent-events framing (protocols.md section 1.1): `event:` line (optional), one
`data:` line of compact JSON, blank line. orjson never writes raw newlines, so one `data:` line
always suffices."""

from __future__ import annotations

from typing import Optional

import orjson

DONE = b"data: [DONE]\n\n"
KEEPALIVE_COMMENT = b": keep-alive\n\n"


def sse_event(payload: dict, event: Optional[str] = None) -> bytes:
    data = orjson.dumps(payload)
    if event:
        return b"event: " + event.encode() + b"\ndata: " + data + b"\n\n"
    return b"data: " + data + b"\n\n"


def typed_event(payload: dict) -> bytes:
    """An event whose name repeats the payload's `type` (Responses, Anthropic)."""
    return sse_event(payload, payload["type"])
