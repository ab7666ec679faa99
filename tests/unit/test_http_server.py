"""The h11 connection layer over real sockets on 127.0.0.1: keep-alive, pipelining, HTTP/1.0,
every limit (head size in one read and dribbled, head deadline, body size, CL+TE, malformed
input), 100-continue, the client limit, disconnect -> cancellation, write stalls, shutdown."""

from __future__ import annotations

import asyncio
import select
import socket
import threading
import time

import pytest

from protocols.http import HttpLimits, HttpResponse, HttpServer, StreamingResponse


class LoopThread:
    """An HttpServer with a test handler on its own event loop thread."""

    def __init__(self, handler, limits: HttpLimits):
        self.handler = handler
        self.limits = limits
        self.loop = asyncio.new_event_loop()
        self.server: HttpServer | None = None
        self.port = 0
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> "LoopThread":
        self._thread.start()

        async def start():
            self.server = HttpServer(self.handler, self.limits)
            _, self.port = await self.server.start("127.0.0.1", 0)

        asyncio.run_coroutine_threadsafe(start(), self.loop).result(5)
        return self

    def run(self, coroutine, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def __exit__(self, *exc) -> None:
        self.run(self.server.shutdown(1.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)

    def connect(self, timeout: float = 5.0) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
        _UNREAD.pop(sock.fileno(), None)
        return sock


class Recorder:
    """Handler: GET /echo answers the path and body; /stream streams until cancelled;
    /slow sleeps; records cancellations."""

    def __init__(self):
        self.cancelled = threading.Event()
        self.closed_streams = 0
        self.requests = []

    async def __call__(self, request):
        self.requests.append(request)
        if request.path == "/slow":
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if request.path in ("/stream", "/big-stream"):
            return StreamingResponse(self._chunks(request.path == "/big-stream"))
        if request.path == "/sleep":
            await asyncio.sleep(0.5)
        body = f"{request.method} {request.path} {len(request.body)}".encode()
        return HttpResponse(200, body, "text/plain")

    async def _chunks(self, big: bool):
        try:
            for number in range(100000):
                yield (b"x" * 65536 if big else f"data: {number}\n\n".encode())
                await asyncio.sleep(0 if big else 0.01)
        finally:
            self.closed_streams += 1
            self.cancelled.set()


_UNREAD: dict[int, bytes] = {}  # bytes received past the previous response, per socket


def read_response(sock: socket.socket) -> tuple[int, dict, bytes]:
    """One Content-Length response from the socket (pipelined responses are kept apart)."""
    data = _UNREAD.pop(sock.fileno(), b"")
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a full head: {data!r}")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if status == 100:
        _UNREAD[sock.fileno()] = rest
        return status, headers, b""
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    _UNREAD[sock.fileno()] = rest[length:]
    return status, headers, rest[:length]


def closed_by_peer(sock: socket.socket, timeout: float = 5.0) -> bool:
    sock.settimeout(timeout)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


@pytest.fixture
def server():
    recorder = Recorder()
    limits = HttpLimits(max_header_bytes=8192, max_body_bytes=1 << 20, header_timeout_s=1.0,
                        body_timeout_s=2.0, keepalive_timeout_s=1.5, write_stall_timeout_s=1.0,
                        max_clients=4)
    with LoopThread(recorder, limits) as loop_thread:
        loop_thread.recorder = recorder
        yield loop_thread


GET = b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n"


def test_keep_alive_reuses_the_connection_and_advertises_the_window(server):
    sock = server.connect()
    for _ in range(3):
        sock.sendall(GET)
        status, headers, body = read_response(sock)
        assert status == 200 and body == b"GET /echo 0"
        assert headers["keep-alive"] == "timeout=1"
    sock.close()


def test_pipelined_requests_are_answered_in_order(server):
    sock = server.connect()
    sock.sendall(b"".join(f"GET /echo{n} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
                          for n in range(3)))
    bodies = [read_response(sock)[2] for _ in range(3)]
    assert bodies == [b"GET /echo0 0", b"GET /echo1 0", b"GET /echo2 0"]


def test_http_1_0_closes_after_the_response(server):
    sock = server.connect()
    sock.sendall(b"GET /echo HTTP/1.0\r\n\r\n")
    status, headers, body = read_response(sock)
    assert status == 200 and headers.get("connection") == "close"
    assert closed_by_peer(sock)


def test_oversized_head_in_one_read_is_431(server):
    sock = server.connect()
    sock.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n")
    status, _, _ = read_response(sock)
    assert status == 431
    assert closed_by_peer(sock)


def test_oversized_head_in_pieces_is_431(server):
    sock = server.connect()
    sock.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\n")
    for _ in range(12):
        try:
            sock.sendall(b"X-Pad: " + b"b" * 1000 + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            break
    status, _, _ = read_response(sock)
    assert status == 431


def test_slow_head_hits_one_deadline_not_reset_per_byte(server):
    sock = server.connect()
    started = time.monotonic()
    status = None
    try:
        for byte in b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Slow: abcdefghijklmnop":
            sock.sendall(bytes([byte]))
            readable, _, _ = select.select([sock], [], [], 0.1)
            if readable or time.monotonic() - started > 3:
                break
        status, _, _ = read_response(sock)
    except (BrokenPipeError, ConnectionResetError):
        pass
    elapsed = time.monotonic() - started
    assert status == 408
    assert elapsed < 2.0, "the head deadline must not restart with every byte"


def test_a_silent_new_connection_is_closed_at_the_head_deadline(server):
    sock = server.connect()
    started = time.monotonic()
    assert closed_by_peer(sock, timeout=5)
    assert 0.8 < time.monotonic() - started < 3


def test_idle_keep_alive_connection_is_closed_after_the_window(server):
    sock = server.connect()
    sock.sendall(GET)
    assert read_response(sock)[0] == 200
    started = time.monotonic()
    assert closed_by_peer(sock, timeout=5)
    assert 1.2 < time.monotonic() - started < 4


def test_declared_body_over_the_limit_is_413_before_reading_it(server):
    sock = server.connect()
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5000000\r\n\r\n")
    status, _, _ = read_response(sock)
    assert status == 413


def test_chunked_body_over_the_limit_is_413(server):
    sock = server.connect()
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"%x\r\n" % 65536 + b"z" * 65536 + b"\r\n"
    try:
        for _ in range(20):
            sock.sendall(chunk)
    except (BrokenPipeError, ConnectionResetError):
        pass
    status, _, _ = read_response(sock)
    assert status == 413


def test_content_length_with_transfer_encoding_is_refused(server):
    sock = server.connect()
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
    status, _, _ = read_response(sock)
    assert status == 400
    assert closed_by_peer(sock)


@pytest.mark.parametrize("raw", [
    b"NOT HTTP AT ALL\r\n\r\n",
    b"GET /echo HTTP/1.1\r\n\r\n",                                   # no Host on 1.1
    b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"GET /echo HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
])
def test_malformed_requests_get_400_and_a_close(server, raw):
    sock = server.connect()
    sock.sendall(raw)
    status, _, _ = read_response(sock)
    assert status == 400
    assert closed_by_peer(sock)


def test_expect_100_continue_is_answered(server):
    sock = server.connect()
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
                 b"Expect: 100-continue\r\n\r\n")
    status, _, _ = read_response(sock)
    assert status == 100
    sock.sendall(b"abcd")
    status, _, body = read_response(sock)
    assert status == 200 and body == b"POST /echo 4"


def test_body_deadline(server):
    sock = server.connect()
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nab")
    status, _, _ = read_response(sock)
    assert status == 408


def test_disconnect_cancels_the_handler(server):
    sock = server.connect()
    sock.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.2)
    sock.close()
    assert server.recorder.cancelled.wait(3)


def test_disconnect_closes_a_stream(server):
    sock = server.connect()
    sock.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
    data = b""
    while data.count(b"data:") < 3:
        data += sock.recv(4096)
    assert b"transfer-encoding: chunked" in data.lower()
    sock.close()
    assert server.recorder.cancelled.wait(3)


def test_a_client_that_stops_reading_is_disconnected(server):
    sock = server.connect()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(b"GET /big-stream HTTP/1.1\r\nHost: x\r\n\r\n")
    # Never read: the server's drain() stalls and the stall limit (1 s) ends the stream.
    assert server.recorder.cancelled.wait(6)
    sock.close()


def test_client_limit_closes_an_idle_connection_or_refuses(server):
    idle = server.connect()
    idle.sendall(GET)
    assert read_response(idle)[0] == 200
    busy = []
    for _ in range(3):
        sock = server.connect()
        sock.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        busy.append(sock)
    time.sleep(0.2)
    # A fifth connection: the idle keep-alive one makes room.
    fifth = server.connect()
    fifth.sendall(GET)
    assert read_response(fifth)[0] == 200
    assert closed_by_peer(idle, timeout=3)
    # Now 3 busy + the fifth (idle again after its answer) -> a sixth takes the fifth's place;
    # with every slot busy, a newcomer is refused with 503.
    fifth.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.2)
    refused = server.connect()
    refused.sendall(GET)
    status, headers, _ = read_response(refused)
    assert status == 503 and headers.get("retry-after") == "1"
    for sock in busy + [fifth, refused]:
        sock.close()


def test_shutdown_lets_a_running_request_finish_and_refuses_new_ones():
    recorder = Recorder()
    with LoopThread(recorder, HttpLimits(header_timeout_s=2)) as loop_thread:
        sock = loop_thread.connect()
        sock.sendall(b"GET /sleep HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.1)
        shutdown = asyncio.run_coroutine_threadsafe(loop_thread.server.shutdown(3.0),
                                                    loop_thread.loop)
        status, headers, body = read_response(sock)
        assert status == 200 and headers.get("connection") == "close"
        shutdown.result(5)
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", loop_thread.port), timeout=1).recv(1)


def test_a_failing_handler_is_a_500_and_the_server_survives():
    async def broken(request):
        if request.path == "/boom":
            raise RuntimeError("bug")
        return HttpResponse(200, b"ok", "text/plain")

    with LoopThread(broken, HttpLimits()) as loop_thread:
        sock = loop_thread.connect()
        sock.sendall(b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock)[0] == 500
        sock.sendall(b"GET /fine HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock)[0:3:2] == (200, b"ok")
