"""The real server over a model, on a background thread: for the tests that need a model rather
than the scripted fake backend (tests/e2e/conftest.py's `model_server`, the tests that start their
own with other flags, and tests/gpu/test_server_cuda.py on the GPU backend)."""

from __future__ import annotations

from protocols.app import App
from protocols.request_log import RequestLog
from protocols.serve import BackgroundServer, app_config_from_settings


def cpu_settings(model, *flags: str):
    """The settings of `infernix-serve MODEL --device cpu FLAGS...`."""
    from runtime.config import parse_settings

    return parse_settings("serve", [str(model), "--device", "cpu", *flags])


def serve_model(settings, log_path=None) -> BackgroundServer:
    """A server with `settings` started on a free port; with `log_path`, its request log goes
    there (`server.log_path`). Stop it with `stop_model`."""
    from protocols.session_backend import open_backend

    backend = open_backend(settings)
    log = RequestLog(str(log_path) if log_path else None)
    server = BackgroundServer(lambda: App(backend, app_config_from_settings(settings), request_log=log),
                              grace_s=2.0).start()
    server.backend, server.request_log, server.log_path = backend, log, log_path
    return server


def stop_model(server: BackgroundServer) -> None:
    """Stop a server from `serve_model`, then close its request log and backend."""
    server.stop()
    server.request_log.close()
    server.backend.close()
