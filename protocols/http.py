"""HTTP/1.1 on asyncio streams and h11: connections, limits, keep-alive, SSE, backpressure.

No framework: one `_Connection` per socket drives an `h11.Connection` and calls the application
handler once per request. The handler returns an `HttpResponse` (complete body) or a
`StreamingResponse` (an async iterator of already-framed chunks, sent with chunked encoding);
those records are in `protocols/http_messages.py`, the limits in `protocols/connection_limits.py`.

What the layer guarantees (protocols.md section 5):
- the request head is capped in bytes (431) and must arrive within one deadline from its first
  byte (408, slowloris); h11's own incomplete-event limit misses a large head arriving in one
  read, so the size is counted here;
- the body is capped (413, rejected from `Content-Length` before it is read) and must arrive
  within a deadline; `Content-Length` together with `Transfer-Encoding` is refused (400);
- `Expect: 100-continue` is answered; keep-alive with an advertised idle window; pipelined
  requests are answered in order;
- while a request is being answered a watcher reads the socket: EOF means the client went away,
  and the handler task is cancelled (which cancels the generation and frees its lane);
- every write is followed by `drain()`; a client that stops reading for longer than the stall
  limit is disconnected rather than buffered without bound;
- at most `max_clients` connections: beyond that an idle keep-alive connection is closed to make
  room, or the newcomer gets a 503;
- `shutdown()` stops accepting, closes idle connections and lets busy ones finish within a grace
  period before cancelling them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Callable, Optional, Sequence
from urllib.parse import unquote

import h11

from protocols.connection_limits import HttpLimits, body_deadline, slowest_sender
from protocols.http_messages import (REASONS, SERVER_NAME, ErrorRenderer, Handler, HeadCheck,
                                     HttpRequest, HttpResponse, StreamingResponse)
from runtime.log import get_logger

log = get_logger("http")

# The layer's public names: the server, its limits and the records (defined in their own
# modules) that handlers receive and return.
__all__ = ["HttpLimits", "HttpRequest", "HttpResponse", "HttpServer", "StreamingResponse"]

class _Fatal(Exception):
    """A request that cannot be answered normally: send this status and close the connection."""

    def __init__(self, status: int, message: str, path: str = "",
                 response: Optional[HttpResponse] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.path = path
        self.response = response  # ready-made (the head check's), else rendered from status


def _plain_error(path: str, status: int, message: str) -> HttpResponse:
    return HttpResponse(status, message.encode() + b"\n", "text/plain; charset=utf-8")


class HttpServer:
    """Listens, accepts connections within the client limit, and runs them."""

    def __init__(self, handler: Handler, limits: HttpLimits = HttpLimits(),
                 error_renderer: ErrorRenderer = _plain_error,
                 on_connections_changed: Optional[Callable[[int], None]] = None,
                 head_check: Optional[HeadCheck] = None):
        self.handler = handler
        self.head_check = head_check
        self.limits = limits
        self.error_renderer = error_renderer
        self.on_connections_changed = on_connections_changed
        self.connections: set[_Connection] = set()
        self.closing = False
        self._server: Optional[asyncio.AbstractServer] = None
        self.rejected_connections = 0

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Bind and listen; returns the bound address (port 0 picks a free port)."""
        self._server = await asyncio.start_server(self._accept, host, port,
                                                  limit=self.limits.read_size * 2,
                                                  reuse_address=True)
        sockname = self._server.sockets[0].getsockname()
        return sockname[0], sockname[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.closing:
            writer.close()
            return
        if len(self.connections) >= self.limits.max_clients:
            idle = next((c for c in self.connections if c.idle), None)
            slowest = None if idle is not None else slowest_sender(
                self.connections, asyncio.get_running_loop().time(), self.limits)
            if idle is not None:
                idle.close_idle()
            elif slowest is not None:
                slowest.evict()
            else:
                self.rejected_connections += 1
                response = self.error_renderer("", 503, "too many open connections; retry later")
                await _send_raw_and_close(reader, writer, response, retry_after=1)
                return
        connection = _Connection(self, reader, writer)
        self.connections.add(connection)
        self._connections_changed()
        try:
            await connection.run()
        finally:
            self.connections.discard(connection)
            self._connections_changed()

    def _connections_changed(self) -> None:
        if self.on_connections_changed is not None:
            self.on_connections_changed(len(self.connections))

    async def shutdown(self, grace_s: Optional[float] = None) -> None:
        """Stop accepting; close idle connections; give busy ones `grace_s` to finish."""
        self.closing = True
        grace_s = self.limits.shutdown_grace_s if grace_s is None else grace_s
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            if connection.idle:
                connection.close_idle()
        deadline = time.monotonic() + grace_s
        while self.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for connection in list(self.connections):
            connection.abort()
        while self.connections:
            await asyncio.sleep(0.01)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)


class _Connection:
    def __init__(self, server: HttpServer, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter):
        self.server = server
        self.limits = server.limits
        self.reader = reader
        self.writer = writer
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_header_bytes)
        self.idle = True  # between requests (safe to close)
        self.receiving_since: Optional[float] = None  # a request is arriving since (loop time)
        self.request_bytes = 0  # of the request arriving
        self.evicted = False
        self.peer_eof = False  # the client closed its sending side
        self.task: Optional[asyncio.Task] = None
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer or "")

    # --- lifecycle --------------------------------------------------------------------------

    def close_idle(self) -> None:
        if self.idle and self.task is not None:
            self.task.cancel()

    def abort(self) -> None:
        if self.task is not None:
            self.task.cancel()

    def evict(self) -> None:
        """Give up the slot (the server is full and this request arrives slowest): 408."""
        if self.task is not None and not self.evicted:
            self.evicted = True
            self.task.cancel()

    async def run(self) -> None:
        self.task = asyncio.current_task()
        first = True
        try:
            while True:
                try:
                    request = await self._read_request(first)
                except _Fatal as fatal:
                    response = fatal.response or self.server.error_renderer(
                        fatal.path, fatal.status, fatal.message)
                    await _send_raw_and_close(self.reader, self.writer, response)
                    return
                if request is None:
                    return
                first = False
                keep_alive = await self._serve(request)
                if not keep_alive or self.server.closing:
                    return
                if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
                    self.conn.start_next_cycle()
                else:
                    return
        except asyncio.CancelledError:
            if self.evicted:
                asyncio.current_task().uncancel()  # so the timeouts below work as timeouts
                response = self.server.error_renderer(
                    "", 408, "request arriving too slowly while the server is at its "
                             "connection limit")
                await _send_raw_and_close(self.reader, self.writer, response)
        except (ConnectionError, TimeoutError, OSError):
            pass
        except Exception:  # noqa: BLE001 - a connection bug must not take the server down
            log.exception("connection %s failed", self.peer)
        finally:
            self.writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.writer.wait_closed(), 1.0)

    # --- reading ----------------------------------------------------------------------------

    async def _read_request(self, first: bool) -> Optional[HttpRequest]:
        """Read one request (head and body); None when the peer closed or idled out cleanly."""
        loop = asyncio.get_running_loop()
        limits = self.limits
        self.idle = True
        head_bytes = len(self.conn.trailing_data[0])
        head_deadline = (loop.time() + limits.header_timeout_s) if first or head_bytes else None
        self.receiving_since = loop.time() if head_bytes else None
        self.request_bytes = head_bytes
        head_done_at = 0.0
        declared_body: Optional[int] = None
        request: Optional[HttpRequest] = None
        body = bytearray()
        path = ""
        while True:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as exc:
                status = exc.error_status_hint if exc.error_status_hint >= 400 else 400
                raise _Fatal(status, f"malformed HTTP request: {exc}", path) from None
            if event is h11.NEED_DATA:
                if request is None:
                    if head_bytes > limits.max_header_bytes:
                        raise _Fatal(431, "request header block too large "
                                          f"(limit {limits.max_header_bytes} bytes)")
                    if head_deadline is None:
                        timeout = limits.keepalive_timeout_s
                    else:
                        timeout = head_deadline - loop.time()
                else:
                    timeout = body_deadline(limits, head_done_at, declared_body,
                                            len(body)) - loop.time()
                data = await self._read_some(timeout)
                if data is None:  # timed out
                    if request is None and head_bytes == 0:
                        return None  # idle keep-alive connection (or a silent new one)
                    raise _Fatal(408, "request not received in time", path)
                if not data:
                    if request is None and head_bytes == 0:
                        return None
                    # EOF mid-request: nobody to answer.
                    raise ConnectionResetError("peer closed mid-request")
                self.idle = False
                if self.receiving_since is None:
                    self.receiving_since = loop.time()
                self.request_bytes += len(data)
                if request is None:
                    head_bytes += len(data)
                    if head_deadline is None:
                        head_deadline = loop.time() + limits.header_timeout_s
                self.conn.receive_data(data)
            elif isinstance(event, h11.Request):
                self.idle = False
                head_size = head_bytes - len(self.conn.trailing_data[0])
                target = event.target.decode("latin-1")
                raw_path, _, query = target.partition("?")
                path = unquote(raw_path)
                if head_size > limits.max_header_bytes:
                    raise _Fatal(431, "request header block too large "
                                      f"(limit {limits.max_header_bytes} bytes)", path)
                headers: dict[str, str] = {}
                for name, value in event.headers:
                    key = name.decode("latin-1").lower()
                    text = value.decode("latin-1")
                    headers[key] = f"{headers[key]}, {text}" if key in headers else text
                if "content-length" in headers and "transfer-encoding" in headers:
                    raise _Fatal(400, "Content-Length together with Transfer-Encoding is not "
                                      "accepted", path)
                declared = headers.get("content-length")
                declared_body = int(declared) if declared is not None and \
                    declared.isdigit() else None
                if declared_body is not None and declared_body > limits.max_body_bytes:
                    raise _Fatal(413, f"request body too large (limit {limits.max_body_bytes} "
                                      "bytes)", path)
                request = HttpRequest(event.method.decode("ascii", "replace"), path, query,
                                      headers, b"", event.http_version.decode("ascii"),
                                      self.peer, head_at=time.monotonic())
                has_body = bool(declared_body) or "transfer-encoding" in headers
                if has_body and self.server.head_check is not None:
                    refusal = self.server.head_check(request)
                    if refusal is not None:
                        raise _Fatal(refusal.status, "", path, refusal)
                head_done_at = loop.time()
                if self.conn.they_are_waiting_for_100_continue:
                    await self._send(h11.InformationalResponse(status_code=100, headers=[]))
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > limits.max_body_bytes:
                    raise _Fatal(413, f"request body too large (limit {limits.max_body_bytes} "
                                      "bytes)", path)
            elif isinstance(event, h11.EndOfMessage):
                assert request is not None
                request.body = bytes(body)
                request.received_at = time.monotonic()
                self.receiving_since = None
                return request
            elif isinstance(event, h11.ConnectionClosed):
                return None
            else:  # h11.PAUSED cannot happen at the start of a cycle
                raise _Fatal(400, f"unexpected HTTP event {type(event).__name__}", path)

    async def _read_some(self, timeout: float) -> Optional[bytes]:
        if timeout <= 0:
            return None
        try:
            async with asyncio.timeout(timeout):
                return await self.reader.read(self.limits.read_size)
        except TimeoutError:
            return None
        except (ConnectionError, OSError):
            return b""

    # --- answering --------------------------------------------------------------------------

    async def _serve(self, request: HttpRequest) -> bool:
        """Answer one request while watching for the client going away; True = keep alive."""
        respond = asyncio.ensure_future(self._respond(request))
        watch = asyncio.ensure_future(self._watch_for_disconnect(request))
        try:
            done, _ = await asyncio.wait({respond, watch}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            respond.cancel()
            watch.cancel()
            await asyncio.gather(respond, watch, return_exceptions=True)
            raise
        if respond in done:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
            if respond.exception() is not None:
                return False
            return respond.result() and not self.peer_eof
        # The client went away: cancel the handler (and with it the generation).
        log.debug("client %s disconnected during %s %s", self.peer, request.method, request.path)
        respond.cancel()
        await asyncio.gather(respond, return_exceptions=True)
        return False

    async def _watch_for_disconnect(self, request: HttpRequest) -> None:
        """Read while a request is answered; return when the client is gone. Bytes are a
        pipelined request (kept); a reset means gone; EOF means the client closed its sending
        side, which a client that still waits for its answer does too (a half-close)."""
        buffered = 0
        while True:
            try:
                data = await self.reader.read(self.limits.read_size)
            except (ConnectionError, OSError):
                return
            if not data:
                break
            self.conn.receive_data(data)
            buffered += len(data)
            if buffered > self.limits.max_pipelined_bytes:
                # Stop reading; a disconnect will now show as a write error instead.
                await asyncio.Event().wait()
        self.peer_eof = True
        if request.http_version != "1.1":
            return  # no interim responses in HTTP/1.0: EOF has to mean gone
        # A FIN alone cannot tell a half-close from a closed socket; a write can: a closed peer
        # answers it with a reset, and the write after that fails. Until the answer's head is
        # sent, `102 Processing` is that write (HTTP/1.1 clients must accept unsolicited 1xx
        # responses); after it, the answer's own writes are.
        while not self.writer.is_closing():
            if self.conn.our_state is h11.SEND_RESPONSE:
                self.writer.write(self.conn.send(
                    h11.InformationalResponse(status_code=102, headers=[])))
            await asyncio.sleep(self.limits.disconnect_probe_s)

    async def _respond(self, request: HttpRequest) -> bool:
        try:
            response = await self.server.handler(request)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - one bad request never takes the server down
            log.exception("handler failed for %s %s", request.method, request.path)
            response = self.server.error_renderer(request.path, 500, "internal server error")
        closing = self.server.closing
        if isinstance(response, HttpResponse):
            headers = self._headers(response.content_type, response.headers, closing)
            headers.append(("content-length", str(len(response.body))))
            await self._send(h11.Response(status_code=response.status, headers=headers,
                                          reason=REASONS.get(response.status, "").encode()))
            if response.body and request.method != "HEAD":
                await self._send(h11.Data(data=response.body))
            await self._send(h11.EndOfMessage())
            return not closing
        chunks = response.chunks
        try:
            headers = self._headers(response.content_type, response.headers, closing)
            headers.append(("cache-control", "no-cache"))
            headers.append(("x-accel-buffering", "no"))
            await self._send(h11.Response(status_code=response.status, headers=headers,
                                          reason=REASONS.get(response.status, "").encode()))
            async for chunk in chunks:
                if chunk:
                    await self._send(h11.Data(data=chunk))
        except asyncio.CancelledError:
            raise
        except (ConnectionError, TimeoutError, OSError):
            return False
        except Exception:  # noqa: BLE001 - the stream source failed; cut the body
            log.exception("stream failed for %s %s", request.method, request.path)
            return False
        finally:
            with contextlib.suppress(Exception):
                await chunks.aclose()  # type: ignore[attr-defined]
        await self._send(h11.EndOfMessage())
        return not closing

    def _headers(self, content_type: str, extra: Sequence[tuple[str, str]],
                 closing: bool) -> list[tuple[str, str]]:
        headers = [("server", SERVER_NAME), ("content-type", content_type)]
        headers.extend(extra)
        if closing:
            headers.append(("connection", "close"))
        else:
            headers.append(("keep-alive", f"timeout={int(self.limits.keepalive_timeout_s)}"))
        return headers

    async def _send(self, event) -> None:
        if self.writer.is_closing():  # reset by the client: a disconnect, not a server error
            raise ConnectionResetError(f"client {self.peer} went away")
        data = self.conn.send(event)
        if data:
            self.writer.write(data)
            async with asyncio.timeout(self.limits.write_stall_timeout_s):
                await self.writer.drain()


async def _send_raw_and_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                              response: HttpResponse, retry_after: Optional[int] = None) -> None:
    """Write a complete error response outside h11 (its state may be unusable), then close
    gracefully: half-close and discard what the client still sends for a moment, so the kernel
    does not turn unread input into a reset that destroys the response."""
    lines = [f"HTTP/1.1 {response.status} {REASONS.get(response.status, '')}",
             f"server: {SERVER_NAME}", f"content-type: {response.content_type}",
             f"content-length: {len(response.body)}", "connection: close"]
    lines.extend(f"{name}: {value}" for name, value in response.headers)
    if retry_after is not None:
        lines.append(f"retry-after: {retry_after}")
    try:
        if writer.is_closing():  # reset by the client: nobody to answer
            return
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + response.body)
        async with asyncio.timeout(5.0):
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    data = await reader.read(65536)
            except TimeoutError:
                break
            if not data:
                break
    except (ConnectionError, TimeoutError, OSError):
        pass
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer.wait_closed(), 1.0)
