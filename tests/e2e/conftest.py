"""Servers for the end-to-end tests, on 127.0.0.1 with a free port.

- `fake_server(...)`: the real HTTP server and API layer over the scripted `FakeBackend` (no
  model), started per test on a background thread; fast, for every protocol path.
- `model_server`: the real server over the tiny real-vocabulary model on the CPU (NumPy
  reference backend), started once per session; a request log is written to `model_log`.
"""

from __future__ import annotations

import pytest

from protocols.app import App, AppConfig
from protocols.fake import FakeBackend, default_script
from protocols.http import HttpLimits
from protocols.request_log import RequestLog
from protocols.serve import BackgroundServer

from tests.e2e.model_serving import cpu_settings, serve_model, stop_model


@pytest.fixture
def fake_server(tmp_path):
    """Factory: fake_server(script_for=..., lanes=1, config=AppConfig(...), limits=...)."""
    started = []

    def start(script_for=default_script, *, lanes: int = 1, config: AppConfig = AppConfig(),
              limits: HttpLimits = HttpLimits(), max_context: int = 4096,
              request_log: bool = False) -> BackgroundServer:
        backend = FakeBackend(script_for, lanes=lanes, max_context=max_context)
        log = RequestLog(str(tmp_path / "requests.jsonl") if request_log else None)
        server = BackgroundServer(lambda: App(backend, config, request_log=log),
                                  limits=limits, grace_s=1.0).start()
        server.backend = backend
        server.log_path = tmp_path / "requests.jsonl"
        started.append((server, log))
        return server

    yield start
    for server, log in started:
        server.stop()
        log.close()


@pytest.fixture(scope="session")
def model_settings(tiny_real_vocab_path):
    return cpu_settings(tiny_real_vocab_path, "--max-context", "1024", "--max-concurrency", "8",
                        "--max-pending-requests", "8", "--max-new", "8")


@pytest.fixture(scope="session")
def model_log(tmp_path_factory):
    return tmp_path_factory.mktemp("model-server") / "requests.jsonl"


@pytest.fixture(scope="session")
def model_server(model_settings, model_log):
    server = serve_model(model_settings, model_log)
    yield server
    stop_model(server)


def run_concurrently(work, count: int, timeout: float) -> list:
    """`work(n)` for n = 0..count-1, all at once on their own threads; the results in order of
    n. An exception in any call is raised here, and so is a call still running after `timeout`
    seconds."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=count) as pool:
        futures = [pool.submit(work, n) for n in range(count)]
        return [future.result(timeout=timeout) for future in futures]


class Clients:
    """The official SDK clients for a server, retries off (failures must not be masked)."""

    @staticmethod
    def openai(server, api_key: str = "test", timeout: float = 60):
        import openai

        return openai.OpenAI(base_url=server.base_url + "/v1", api_key=api_key,
                             max_retries=0, timeout=timeout)

    @staticmethod
    def anthropic(server, api_key: str = "test", timeout: float = 60):
        import anthropic

        return anthropic.Anthropic(base_url=server.base_url, api_key=api_key, max_retries=0,
                                   timeout=timeout)


@pytest.fixture(scope="session")
def clients() -> Clients:
    return Clients()


class Wire:
    """Raw SSE parsing and per-payload validation with the SDKs' own pydantic types."""

    @staticmethod
    def events(body: bytes) -> list[tuple]:
        """(event name or None, data text) per SSE event; comments are skipped."""
        found = []
        for block in body.decode().split("\n\n"):
            if not block.strip():
                continue
            name, data = None, []
            for line in block.split("\n"):
                if line.startswith(":"):
                    continue
                if line.startswith("event: "):
                    name = line[len("event: "):]
                elif line.startswith("data: "):
                    data.append(line[len("data: "):])
            if data:
                found.append((name, "\n".join(data)))
        return found

    @staticmethod
    def chat(payload: dict):
        from openai.types.chat import ChatCompletionChunk

        return ChatCompletionChunk.model_validate(payload)

    @staticmethod
    def responses(payload: dict):
        import typing

        from openai.types.responses import ResponseStreamEvent

        union = ResponseStreamEvent
        if typing.get_origin(union) is typing.Annotated:
            union = typing.get_args(union)[0]
        classes = {typing.get_args(cls.model_fields["type"].annotation)[0]: cls
                   for cls in typing.get_args(union)}
        return classes[payload["type"]].model_validate(payload)

    @staticmethod
    def anthropic(payload: dict):
        import pydantic
        from anthropic.types import RawMessageStreamEvent

        if payload["type"] in ("ping", "error"):
            return payload
        return pydantic.TypeAdapter(RawMessageStreamEvent).validate_python(payload)


@pytest.fixture(scope="session")
def wire() -> Wire:
    return Wire()
