"""`infernix-serve`: settings, model session, HTTP server, signals.

`main()` parses the serve options (command line and the `[serve]` table of `--config`), opens
the model session, and serves until SIGINT/SIGTERM: the first signal stops accepting, lets
running requests finish for a grace period, then ends the rest with an in-band error; a second
signal stops at once. `BackgroundServer` runs the same server on a thread (tests, embedding).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading
from typing import Callable, Optional, Sequence

from protocols.app import App, AppConfig
from protocols.http import HttpLimits, HttpServer
from protocols.metrics import Metrics
from protocols.request_log import RequestLog
from runtime.config import ConfigError, parse_settings
from runtime.log import get_logger, setup_logging

log = get_logger("serve")

SHUTDOWN_GRACE_S = 10.0


def limits_from_settings(settings) -> HttpLimits:
    return HttpLimits(max_body_bytes=settings.max_request_mib << 20,
                      max_clients=settings.max_http_clients)


def app_config_from_settings(settings) -> AppConfig:
    return AppConfig(api_key=settings.api_key, max_concurrency=settings.max_concurrency,
                     max_pending_requests=settings.max_pending_requests)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when available (it is a dependency on Linux), else the default loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - non-Linux platforms
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


async def serve(app: App, limits: HttpLimits, host: str, port: int, *,
                stop: asyncio.Event, on_ready: Optional[Callable[[str, int], None]] = None,
                grace_s: float = SHUTDOWN_GRACE_S) -> None:
    """Serve until `stop` is set, then shut down gracefully."""
    metrics = app.metrics

    def connections_changed(count: int) -> None:
        metrics.connections = count

    server = HttpServer(app, limits, app.render_http_error, connections_changed,
                        head_check=app.check_head)
    bound_host, bound_port = await server.start(host, port)
    if on_ready is not None:
        on_ready(bound_host, bound_port)
    await stop.wait()
    log.info("stopping: no new connections; %d request(s) running", app.running)
    shutdown = asyncio.ensure_future(server.shutdown(grace_s))
    # Let running requests finish within the grace period, then end them in-band.
    done, _ = await asyncio.wait({shutdown}, timeout=max(0.0, grace_s - 0.5))
    if not done:
        app.shutdown()
    await shutdown


class BackgroundServer:
    """The server on its own thread and event loop; `port` is known once `start()` returns."""

    def __init__(self, app_factory: Callable[[], App], *, host: str = "127.0.0.1",
                 port: int = 0, limits: HttpLimits = HttpLimits(), grace_s: float = 2.0):
        self.app_factory = app_factory
        self.host = host
        self.port = port
        self.limits = limits
        self.grace_s = grace_s
        self.app: Optional[App] = None
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self._stop: Optional[asyncio.Event] = None
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="infernix-serve", daemon=True)

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the server did not start")
        if self._error is not None:
            raise RuntimeError("the server failed to start") from self._error
        return self

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        self.loop = new_event_loop()
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._main())
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._error = exc
            self._ready.set()
        finally:
            self.loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        self.app = self.app_factory()

        def ready(host: str, port: int) -> None:
            self.port = port
            self._ready.set()

        await serve(self.app, self.limits, self.host, self.port, stop=self._stop,
                    on_ready=ready, grace_s=self.grace_s)

    def call(self, function: Callable, *args):
        """Run `function(*args)` on the server loop and return its result (tests)."""
        future = asyncio.run_coroutine_threadsafe(_call(function, *args), self.loop)
        return future.result(10)

    def stop(self, timeout: float = 30.0) -> None:
        if self.loop is not None and self._stop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)


async def _call(function: Callable, *args):
    return function(*args)


def start_record(settings, backend) -> dict:
    """The request log's `server_start` fields. `device` is the one the model runs on (`--device
    auto` resolved); the API key itself is never written."""
    return {"model": backend.model_id, "host": settings.host, "port": settings.port,
            "max_context": backend.max_context, "max_concurrency": settings.max_concurrency,
            "max_pending_requests": settings.max_pending_requests,
            "device": backend.session.device, "auth": bool(settings.api_key)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        settings = parse_settings("serve", sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        print(f"infernix-serve: error: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level, settings.log_colours)
    if settings.options_from_file:
        log.info("options from %s: %s", settings.config, ", ".join(settings.options_from_file))
    from protocols.session_backend import open_backend  # the model stack loads only here
    try:
        backend = open_backend(settings)
    except ConfigError as exc:
        print(f"infernix-serve: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - artifact, model, tokenizer, template errors
        log.error("cannot load the model: %s", exc)
        log.debug("details", exc_info=True)
        return 1
    request_log = RequestLog(settings.request_log)
    app = App(backend, app_config_from_settings(settings), metrics=Metrics(backend.model_id),
              request_log=request_log)
    request_log.write("server_start", **start_record(settings, backend))
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    stop = asyncio.Event()
    presses = {"count": 0}

    def on_signal() -> None:
        presses["count"] += 1
        if presses["count"] == 1:
            stop.set()
        else:
            log.warning("second signal: stopping now")
            app.shutdown()
            for task in asyncio.all_tasks(loop):
                task.cancel()

    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signum, on_signal)

    def ready(host: str, port: int) -> None:
        log.info("serving %s on http://%s:%d (OpenAI /v1/chat/completions, /v1/responses; "
                 "Anthropic /v1/messages)", backend.model_id, host, port)

    try:
        loop.run_until_complete(serve(app, limits_from_settings(settings), settings.host,
                                      settings.port, stop=stop, on_ready=ready))
    except asyncio.CancelledError:
        pass
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc.strerror)
        return 1
    finally:
        with contextlib.suppress(Exception):
            backend.close()
        request_log.close()
        loop.close()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
