"""The HTTP application: routes, authentication, admission, and the shared generation driver
that feeds parser events through an API encoder (streaming or not), with heartbeats, in-band
errors, the tool-call cap (`protocols/tool_call_cap.py`), metrics and the request log.

Endpoints: POST /v1/chat/completions, POST /v1/responses (+ GET / DELETE /v1/responses/{id},
GET /v1/responses/{id}/input_items, POST /v1/responses/input_tokens), POST /v1/messages and
/v1/messages/count_tokens (query strings such as `?beta=true` are ignored), GET /v1/models and
/v1/models/{id}, GET /health, GET /metrics. Every path except /health also answers under a
doubled `/v1/v1/` prefix (clients given a base URL that already ends in /v1).
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional

import orjson

from protocols import anthropic_messages as anthropic_api
from protocols import openai_chat as chat_api
from protocols import openai_responses as responses_api
from protocols.errors import ApiError, error_body, error_headers, flavor_for_path, invalid
from protocols.generation import Backend, Generation, GenerationResult
from protocols.http import HttpRequest, HttpResponse, StreamingResponse
from protocols.job import Capabilities, GenerationJob, json_depth
from protocols.metrics import Metrics
from protocols.request_log import RequestLog, rounded
from protocols.responses_encoder import ResponsesEncoder
from protocols.sse import DONE, sse_event, typed_event
from protocols.tool_call_cap import ToolCallCap, call_limit
from runtime.log import get_logger

log = get_logger("serve")

# A body may nest well below orjson's writing limit (254 levels): answers put request values a
# few levels deeper (Responses echoes `text.format.schema` and `tools` inside `response`,
# inside the stream event), and a 255-deep echo failed to encode (a 500, a cut stream).
MAX_JSON_DEPTH = 128
HEARTBEAT_S = 5.0
_UNAUTHORIZED = ApiError(401, "invalid or missing API key (send Authorization: Bearer KEY or "
                              "x-api-key: KEY)")


@dataclass(frozen=True)
class AppConfig:
    """Server-level settings the application needs (from ServeSettings)."""

    api_key: Optional[str] = None
    max_concurrency: int = 1
    max_pending_requests: int = 16
    heartbeat_s: float = HEARTBEAT_S
    response_store_records: int = 1024


def parse_json_body(body: bytes) -> dict:
    """The request body as a JSON object; 400 for empty, malformed, too deep or non-object."""
    if not body.strip():
        raise invalid("body", "the request body is empty; expected a JSON object",
                      "invalid_json")
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        reason = str(exc)
        if "recursion" in reason:
            reason = f"nested deeper than {MAX_JSON_DEPTH} levels"
        raise invalid("body", f"the request body is not valid JSON: {reason}",
                      "invalid_json") from None
    if not isinstance(value, dict):
        raise invalid("body", "the request body must be a JSON object", "invalid_json")
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and \
            json_depth(value) > MAX_JSON_DEPTH:
        raise invalid("body", f"JSON nested deeper than {MAX_JSON_DEPTH} levels",
                      "json_too_deep")
    return value


@dataclass
class _Api:
    """How one API frames its stream."""

    name: str
    encoder: object
    frame: Callable[[dict], bytes]
    error_frames: Callable[[ApiError, GenerationResult], list[bytes]]
    done: bytes = b""


class App:
    def __init__(self, backend: Backend, config: AppConfig, *, metrics: Optional[Metrics] = None,
                 request_log: Optional[RequestLog] = None):
        self.backend = backend
        self.config = config
        self.metrics = metrics or Metrics(backend.model_id)
        self.request_log = request_log or RequestLog(None)
        self.store = responses_api.ResponseStore(config.response_store_records)
        self.running = 0
        self.started_at = time.time()
        caps = getattr(backend, "capabilities", None)
        self.caps: Capabilities = caps if isinstance(caps, Capabilities) else Capabilities()

    # --- entry ------------------------------------------------------------------------------

    async def __call__(self, request: HttpRequest) -> HttpResponse | StreamingResponse:
        path = request.path
        if path.startswith("/v1/v1/"):
            path = path[3:]
        request_id = "req_" + secrets.token_hex(12)
        try:
            if path != "/health" and not self._authorized(request):
                raise _UNAUTHORIZED
            return await self._route(request, path, request_id)
        except ApiError as error:
            return self._rejected(path, error, request_id)
        except Exception:  # noqa: BLE001 - a bug: logged once with its id, the client gets both
            log.exception("request %s (%s %s) failed", request_id, request.method, path)
            return self._rejected(path, ApiError(
                500, f"internal server error (request id {request_id})", code="server_error"),
                request_id)

    def check_head(self, request: HttpRequest) -> Optional[HttpResponse]:
        """The HTTP layer's head check: a 401 before the body is read when the key is wrong,
        so unauthenticated clients cannot hold connection slots with slow bodies."""
        path = request.path[3:] if request.path.startswith("/v1/v1/") else request.path
        if path == "/health" or self._authorized(request):
            return None
        return self._rejected(path, _UNAUTHORIZED, "req_" + secrets.token_hex(12))

    def _rejected(self, path: str, error: ApiError, request_id: str) -> HttpResponse:
        if path.startswith("/v1/") and error.status != 404:
            self.request_log.write("request_rejected", id=request_id, path=path,
                                   status=error.status, code=error.code, param=error.param,
                                   message=error.message)
            self.metrics.count_request(_api_of(path),
                                       "error" if error.status >= 500 else "rejected")
        return self.error_response(flavor_for_path(path), error, request_id)

    def error_response(self, flavor: str, error: ApiError,
                       request_id: Optional[str] = None) -> HttpResponse:
        return HttpResponse(error.status, error_body(flavor, error, request_id),
                            headers=error_headers(flavor, error, request_id))

    def render_http_error(self, path: str, status: int, message: str) -> HttpResponse:
        """For the HTTP layer's own failures (limits, malformed HTTP)."""
        return self.error_response(flavor_for_path(path), ApiError(status, message))

    def _authorized(self, request: HttpRequest) -> bool:
        key = self.config.api_key
        if not key:
            return True
        offered = request.header("x-api-key")
        authorization = request.header("authorization")
        if authorization[:7].lower() == "bearer ":
            offered = offered or authorization[7:].strip()
        return bool(offered) and hmac.compare_digest(offered.encode(), key.encode())

    async def _route(self, request: HttpRequest, path: str, request_id: str):
        method = request.method
        routes = {
            "/health": ("GET", self._health),
            "/metrics": ("GET", self._metrics),
            "/v1/models": ("GET", self._models),
            "/v1/chat/completions": ("POST", self._chat),
            "/v1/responses": ("POST", self._responses),
            "/v1/responses/input_tokens": ("POST", self._responses_input_tokens),
            "/v1/messages": ("POST", self._messages),
            "/v1/messages/count_tokens": ("POST", self._count_tokens),
        }
        if path in routes:
            allowed, handler = routes[path]
            if method == "HEAD" and allowed == "GET":
                method = "GET"
            if method != allowed:
                raise _not_allowed(request.method, path,
                                   ("GET", "HEAD") if allowed == "GET" else (allowed,))
            return await handler(request, request_id)
        if path.startswith("/v1/models/"):
            if method != "GET":
                raise _not_allowed(request.method, path, ("GET",))
            return self._model(path[len("/v1/models/"):])
        if path.startswith("/v1/responses/"):
            return self._stored_response(method, path[len("/v1/responses/"):])
        raise ApiError(404, f"no route for {request.method} {path}", code="not_found")

    # --- simple endpoints -------------------------------------------------------------------

    async def _health(self, request: HttpRequest, request_id: str) -> HttpResponse:
        if self.backend.healthy():
            return _json(200, {"status": "ok"})
        return _json(503, {"status": "unavailable"})

    async def _metrics(self, request: HttpRequest, request_id: str) -> HttpResponse:
        self.metrics.running = self.running
        text = self.metrics.render(self.backend.gauges, self.config.max_concurrency,
                                   self.backend.max_context)
        return HttpResponse(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")

    def _model_object(self) -> dict:
        model = self.backend.model_id
        # The model object exists since this server loaded the model: that is its creation time.
        created = int(self.started_at)
        return {"id": model, "object": "model", "created": created, "owned_by": "infernix",
                "type": "model", "display_name": model,
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
                "max_model_len": self.backend.max_context}

    async def _models(self, request: HttpRequest, request_id: str) -> HttpResponse:
        model = self.backend.model_id
        return _json(200, {"object": "list", "data": [self._model_object()], "has_more": False,
                           "first_id": model, "last_id": model})

    def _model(self, model_id: str) -> HttpResponse:
        if model_id != self.backend.model_id:
            raise ApiError(404, f"model {model_id!r} not found; this server serves "
                                f"{self.backend.model_id!r}", code="model_not_found")
        return _json(200, self._model_object())

    def _stored_response(self, method: str, rest: str) -> HttpResponse:
        """GET / DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items. POST
        /v1/responses/{id}/cancel (background responses) does not exist here: 404."""
        response_id, _, tail = rest.partition("/")
        allowed = {"": ("GET", "DELETE"), "input_items": ("GET",)}.get(tail)
        if allowed is None:
            raise ApiError(404, f"no route for {method} /v1/responses/{rest}", code="not_found")
        if method not in allowed:
            raise _not_allowed(method, f"/v1/responses/{rest}", allowed)
        record = self.store.get(response_id)
        if record is None:
            raise ApiError(404, f"No response found with id '{response_id}'.",
                           code="not_found")
        if method == "DELETE":
            self.store.delete(response_id)
            return _json(200, {"id": response_id, "object": "response", "deleted": True})
        if tail == "input_items":
            return _json(200, {"object": "list", "data": record["items"], "has_more": False,
                               "first_id": None, "last_id": None})
        return _json(200, record["response"])

    async def _count_tokens(self, request: HttpRequest, request_id: str) -> HttpResponse:
        body = parse_json_body(request.body)
        job, _ = anthropic_api.parse_messages_request(body, self.caps, count_only=True)
        return _json(200, {"input_tokens": await self.backend.count_tokens(job)})

    async def _responses_input_tokens(self, request: HttpRequest,
                                      request_id: str) -> HttpResponse:
        body = parse_json_body(request.body)
        job, _ = responses_api.parse_responses_request(body, self.caps, self.store)
        return _json(200, {"object": "response.input_tokens",
                           "input_tokens": await self.backend.count_tokens(job)})

    # --- generation endpoints ---------------------------------------------------------------

    async def _chat(self, request: HttpRequest, request_id: str):
        body = parse_json_body(request.body)
        job, options = chat_api.parse_chat_request(body, self.caps)
        completion_id = "chatcmpl-" + secrets.token_hex(12)
        generation = await self._start(job, completion_id, request)
        encoder = chat_api.ChatEncoder(completion_id, self.backend.model_id,
                                       include_usage=options.include_usage)
        api = _Api("chat", encoder, sse_event,
                   lambda error, result: [sse_event(chat_api.error_chunk(error))], DONE)
        headers = [("x-request-id", completion_id)]
        if options.stream:
            return self._streaming(api, job, generation, request, headers)
        result = await self._complete(api, job, generation, request)
        return _json(200, encoder.response(result), headers)

    async def _responses(self, request: HttpRequest, request_id: str):
        body = parse_json_body(request.body)
        job, options = responses_api.parse_responses_request(body, self.caps, self.store)
        response_id = "resp_" + secrets.token_hex(12)
        generation = await self._start(job, response_id, request)
        encoder = ResponsesEncoder(response_id, self.backend.model_id, options.echo,
                                   custom_tools=options.custom_tools,
                                   tool_searches=options.tool_searches,
                                   namespaces=options.namespaces,
                                   include_encrypted_reasoning=options.include_encrypted_reasoning)

        def on_done(result: GenerationResult) -> None:
            if options.store and result.finish_reason not in ("error", "cancelled"):
                self.store.put(encoder.response(result), options.items)

        api = _Api("responses", encoder, typed_event,
                   lambda error, result: [typed_event(p) for p in encoder.failed(error, result)])
        headers = [("x-request-id", response_id)]
        if options.stream:
            return self._streaming(api, job, generation, request, headers, on_done)
        result = await self._complete(api, job, generation, request)
        on_done(result)
        return _json(200, encoder.response(result), headers)

    async def _messages(self, request: HttpRequest, request_id: str):
        body = parse_json_body(request.body)
        job, options = anthropic_api.parse_messages_request(body, self.caps)
        message_id = "msg_" + secrets.token_hex(12)
        generation = await self._start(job, message_id, request)
        encoder = anthropic_api.MessagesEncoder(message_id, self.backend.model_id,
                                                generation.prompt_tokens,
                                                show_thinking=options.show_thinking)
        api = _Api("messages", encoder, typed_event,
                   lambda error, result: [typed_event(anthropic_api.error_event(error))])
        headers = [("request-id", message_id)]
        if options.stream:
            return self._streaming(api, job, generation, request, headers)
        result = await self._complete(api, job, generation, request)
        return _json(200, encoder.response(result), headers)

    # --- the driver -------------------------------------------------------------------------

    async def _start(self, job: GenerationJob, request_id: str,
                     request: HttpRequest) -> Generation:
        limit = self.config.max_concurrency + self.config.max_pending_requests
        if self.running >= limit:
            raise ApiError(503, f"the server is busy ({self.running} requests running or "
                                "queued); retry later", code="server_overloaded", retry_after=1)
        self.running += 1
        parsed_at = time.monotonic()
        try:
            generation = await self.backend.start(job, request_id, request.received_at)
            generation.phases.update(receive=request.received_at - request.head_at,
                                     parse=parsed_at - request.received_at)
            return generation
        except asyncio.CancelledError:
            # The client left while the prompt was prepared: still a request, counted and
            # logged like one that left during generation.
            self.running -= 1
            self.metrics.count_request(job.api, "cancelled")
            self.request_log.write(
                "request_done", id=request_id, api=job.api, seed=None, tag=request.header("x-request-tag") or None, prompt_tokens=None,
                completion_tokens=0, total_s=rounded(time.monotonic() - request.received_at),
                finish_reason="cancelled")
            raise
        except BaseException:
            self.running -= 1
            raise

    def _streaming(self, api: _Api, job: GenerationJob, generation: Generation,
                   request: HttpRequest, headers: list,
                   on_done: Optional[Callable[[GenerationResult], None]] = None
                   ) -> StreamingResponse:
        state: dict = {"result": None, "error": None, "recorded": False}

        def cleanup() -> None:
            if state["recorded"]:
                return
            state["recorded"] = True
            generation.cancel()
            self._finished(api.name, job, generation, request, state["result"], stream=True,
                           error=state["error"])

        source = self._stream(api, job, generation, state, on_done)
        return StreamingResponse(_Chunks(source, cleanup), headers=headers)

    async def _stream(self, api: _Api, job: GenerationJob, generation: Generation, state: dict,
                      on_done: Optional[Callable[[GenerationResult], None]]
                      ) -> AsyncIterator[bytes]:
        encoder = api.encoder
        cap = ToolCallCap(call_limit(job))
        yield b"".join(api.frame(p) for p in encoder.start())
        try:
            async for batch in generation.updates(self.config.heartbeat_s):
                if not batch:
                    yield api.frame(encoder.heartbeat())
                    continue
                payloads = encoder.events(cap.filter(batch, generation))
                if payloads:
                    yield b"".join(api.frame(p) for p in payloads)
                    # Resumed: the HTTP layer has written it (the first output on the wire).
                    if "first_write" not in generation.phases \
                            and generation.first_token_at is not None:
                        generation.phases["first_write"] = \
                            time.monotonic() - generation.first_token_at
        except Exception:  # noqa: BLE001 - a bug here must still end the stream properly
            log.exception("stream %s failed", generation.request_id)
            generation.cancel()
            error = state["error"] = ApiError(500, "internal error while streaming",
                                              code="server_error")
            result = state["result"] = GenerationResult(
                finish_reason="error", error=error.message,
                prompt_tokens=generation.prompt_tokens,
                completion_tokens=generation.completion_tokens)
            yield b"".join(api.error_frames(error, result))
            return
        result = state["result"] = cap.settle(generation.result)
        if result.finish_reason == "error":
            error = state["error"] = ApiError(
                result.error_status, result.error or "generation failed",
                code="server_error" if result.error_status >= 500 else None)
            yield b"".join(api.error_frames(error, result))
            return
        yield b"".join(api.frame(p) for p in encoder.finish(result)) + api.done
        if on_done is not None:
            on_done(result)

    async def _complete(self, api: _Api, job: GenerationJob, generation: Generation,
                        request: HttpRequest) -> GenerationResult:
        cap = ToolCallCap(call_limit(job))
        result: Optional[GenerationResult] = None
        error: Optional[ApiError] = None
        try:
            async for batch in generation.updates(3600.0):
                if batch:
                    api.encoder.events(cap.filter(batch, generation))
            result = cap.settle(generation.result)
            if result.finish_reason == "error":
                error = ApiError(result.error_status, result.error or "generation failed")
                raise error
            return result
        finally:
            generation.cancel()
            self._finished(api.name, job, generation, request, result, stream=False,
                           error=error)

    def _finished(self, api: str, job: GenerationJob, generation: Generation,
                  request: HttpRequest, result: Optional[GenerationResult], *, stream: bool,
                  error: Optional[ApiError]) -> None:
        self.running -= 1
        if result is None:  # the client went away before the end
            result = GenerationResult(finish_reason="cancelled",
                                      prompt_tokens=generation.prompt_tokens,
                                      completion_tokens=generation.completion_tokens,
                                      reasoning_tokens=generation.reasoning_tokens,
                                      queue_wait_s=generation.queue_wait_s)
            generation.finish(result)
        total_s = None
        if generation.last_token_at is not None:
            total_s = generation.last_token_at - request.received_at
        outcome = result.finish_reason
        phases = generation.ordered_phases()
        self.metrics.count_request(api, outcome)
        self.metrics.observe_generation(result, total_s)
        self.metrics.observe_phases(phases, result.prefill_steps)
        self.request_log.write(
            "request_done", id=generation.request_id, api=api, stream=stream,
            seed=generation.seed, tag=request.header("x-request-tag") or None,
            prompt_tokens=result.prompt_tokens, cached_tokens=result.cached_prompt_tokens,
            prefilled_tokens=result.prefilled_tokens, resume_path=result.resume_path,
            completion_tokens=result.completion_tokens,
            reasoning_tokens=result.reasoning_tokens,
            queue_wait_s=rounded(result.queue_wait_s), ttft_s=rounded(result.ttft_s),
            decode_s=rounded(result.decode_s),
            decode_tok_s=rounded(result.decode_tokens_per_s, 2),
            spec_rounds=result.spec_rounds, drafted_tokens=result.drafted_tokens,
            accepted_tokens=result.accepted_tokens,
            phases={name: rounded(seconds, 6) for name, seconds in phases.items()},
            prefill_steps=result.prefill_steps,
            prefill_compute_s=rounded(result.prefill_compute_s, 6),
            first_decode_s=rounded(result.first_decode_s, 6),
            total_s=rounded(time.monotonic() - request.received_at),
            finish_reason=result.finish_reason, stop_sequence=result.stop_sequence,
            error=(error.message if error else result.error))

    def shutdown(self) -> None:
        self.backend.shutdown()


def _not_allowed(method: str, path: str, allowed: tuple[str, ...]) -> ApiError:
    """405 with the `Allow` header HTTP requires: the methods the path answers."""
    return ApiError(405, f"{method} is not allowed on {path}; use {' or '.join(allowed)}",
                    headers=[("allow", ", ".join(allowed))])


def _api_of(path: str) -> str:
    if path.startswith("/v1/chat"):
        return "chat"
    if path.startswith("/v1/responses"):
        return "responses"
    if path.startswith("/v1/messages"):
        return "messages"
    return "other"


def _json(status: int, payload: dict, headers=()) -> HttpResponse:
    return HttpResponse(status, orjson.dumps(payload), headers=list(headers))


class _Chunks:
    """The streamed body. `aclose()` also runs the request's bookkeeping when the stream was
    never started (the client vanished between the handler and the first write): closing an
    unstarted async generator skips its `finally`."""

    def __init__(self, source: AsyncIterator[bytes], cleanup: Callable[[], None]):
        self.source = source
        self.cleanup = cleanup

    def __aiter__(self) -> "_Chunks":
        return self

    async def __anext__(self) -> bytes:
        return await self.source.__anext__()

    async def aclose(self) -> None:
        try:
            await self.source.aclose()
        finally:
            self.cleanup()
