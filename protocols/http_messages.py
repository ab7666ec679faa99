"""The HTTP layer's records: a received request, the two kinds of answer, and the callables
the server is built from (the application handler, the error renderer, the head check).
Kept apart from the connection machinery in `protocols/http.py` so the application imports
the shapes it produces without the socket code."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Optional, Sequence, Union
from urllib.parse import parse_qsl

SERVER_NAME = "infernix"
REASONS = {
    100: "Continue", 200: "OK", 204: "No Content", 400: "Bad Request", 401: "Unauthorized",
    403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout",
    413: "Payload Too Large", 415: "Unsupported Media Type", 429: "Too Many Requests",
    431: "Request Header Fields Too Large", 500: "Internal Server Error",
    501: "Not Implemented", 503: "Service Unavailable", 529: "Overloaded",
}


@dataclass
class HttpRequest:
    """One received request. Header names are lower-case; repeated headers are joined by ", "."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes
    http_version: str = "1.1"
    peer: str = ""
    # time.monotonic() when the head was parsed / the body's last byte arrived.
    head_at: float = field(default_factory=time.monotonic)
    received_at: float = field(default_factory=time.monotonic)

    def header(self, name: str, default: str = "") -> str:
        return self.headers.get(name, default)

    def query_params(self) -> dict[str, str]:
        return dict(parse_qsl(self.query, keep_blank_values=True))


@dataclass
class HttpResponse:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: Sequence[tuple[str, str]] = ()


@dataclass
class StreamingResponse:
    """A streamed body. Each chunk must be complete on its own (whole SSE events), because the
    stream may be cut after any chunk. The iterator is closed (`aclose`) however the response
    ends, so its `finally` blocks release the generation."""

    chunks: AsyncIterator[bytes]
    status: int = 200
    content_type: str = "text/event-stream"
    headers: Sequence[tuple[str, str]] = ()


Response = Union[HttpResponse, StreamingResponse]
Handler = Callable[[HttpRequest], Awaitable[Response]]
ErrorRenderer = Callable[[str, int, str], HttpResponse]
"""(request path or "", status, message) -> an error response in the API's own shape."""
HeadCheck = Callable[[HttpRequest], Optional[HttpResponse]]
"""Called with a request whose body has not been read yet (`body` is empty): a response to
send instead of reading the body (then the connection closes), or None to go on. The
application checks the API key here, so an unauthenticated client never holds a slot while
its body arrives."""
