"""`--request-log FILE.jsonl`: one JSON line per finished (or rejected) request.

Lines (`event` field):
- `server_start`: model, limits, time, argv-free settings summary (the API key is never written);
- `request_done`: id, api, stream, seed, tag (the `x-request-tag` header, if any), status,
  prompt / cached / completion / reasoning tokens, queue wait, TTFT, decode time and tok/s,
  speculative rounds / drafted / accepted tokens (0 without speculation), total time, finish
  reason, error, and the request's phases (`protocols.generation.PHASES`) with its prefill
  steps, their runner time and its first decode step;
- `request_rejected`: id, api, HTTP status, error code, param, message.

`bench/agentic_ab` joins `request_done` lines with its client log on `seed`. Lines are written
and flushed whole from the event-loop thread, so a reader never sees half a line.
"""

from __future__ import annotations

import time
from typing import IO, Optional

import orjson

SCHEMA = "infernix_request_log"
VERSION = 1


class RequestLog:
    def __init__(self, path: Optional[str]):
        self.path = path
        self._file: Optional[IO[bytes]] = open(path, "ab") if path else None

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def write(self, event: str, **fields) -> None:
        if self._file is None:
            return
        record = {"schema": SCHEMA, "version": VERSION, "event": event,
                  "time": round(time.time(), 3), **fields}
        self._file.write(orjson.dumps(record, option=orjson.OPT_NON_STR_KEYS) + b"\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def rounded(value: Optional[float], digits: int = 4) -> Optional[float]:
    return None if value is None else round(value, digits)
