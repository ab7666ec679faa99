"""Preparing a `GenerationJob` for the engine, off the event loop (executor thread): the chat
template render (thinking switches, a final assistant message continued as a prefill), the
context check, the output constraint (`constraint_spec`: answer schemas, tool calls, custom tool
grammars; compiled, with the non-strict-tool fallback), sampling and thinking budget, and the
output parser; the result is the engine request `SessionBackend.start` submits.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from protocols.errors import ApiError, invalid
from protocols.job import GenerationJob
from runtime.log import get_logger

log = get_logger("serve")

CALL_ID_PREFIX = {"chat": "call_", "responses": "call_", "messages": "toolu_"}


@dataclass
class _Prepared:
    """A job rendered and ready to submit (built off the event loop)."""

    request: Any
    prompt_tokens: int
    thinking: bool
    tools: tuple = ()
    parser: Any = None
    # Request phases (`protocols.generation.PHASES`): render, tokenize, setup in seconds, and
    # when the preparation began and ended (time.monotonic, on the executor thread).
    phases: dict = dataclasses.field(default_factory=dict)
    started_at: float = 0.0
    done_at: float = 0.0


class JobPreparation:
    """`SessionBackend`'s job preparation (a mixin): uses its `session`, `settings` and
    `max_context`."""

    def _render(self, job: GenerationJob):
        from runtime.media.sources import MediaError
        from runtime.text.chat import ChatTemplateError

        settings = self.settings
        enable = job.enable_thinking
        if enable is None and settings.no_thinking:
            enable = False
        effort = job.reasoning_effort or (settings.reasoning_effort if enable is not False
                                          else None)
        preserve = job.preserve_thinking if job.preserve_thinking is not None else \
            bool(settings.preserve_thinking)
        extra = dict(job.template_kwargs)
        effort = effort or extra.pop("reasoning_effort", None)
        try:
            prompt = self.session.render(
                list(job.messages), tools=list(job.tools) or None, enable_thinking=enable,
                reasoning_effort=effort, preserve_thinking=preserve,
                add_generation_prompt=not job.continue_final, **extra)
        except ChatTemplateError as exc:
            raise invalid("messages", f"cannot render the chat template: {exc}",
                          "invalid_prompt") from None
        except RecursionError:
            raise invalid("messages", "cannot render the chat template: values nested too "
                                      "deep", "invalid_prompt") from None
        except MediaError as exc:
            # `where` is the part's wire path (protocols.media_parts): the 400 names it.
            raise ApiError(400, str(exc), param=exc.where, code="invalid_image") from None
        if job.continue_final:
            prompt = self._continue_final(prompt)
        return prompt

    def _continue_final(self, prompt):
        """A final assistant message is a prefill: drop the turn end the template wrote after
        it, so generation continues the message."""
        from runtime.session import RenderedPrompt

        ids = list(prompt.ids)
        im_end = self.session.tokenizer.special.im_end
        for index in range(len(ids) - 1, -1, -1):
            if ids[index] == im_end:
                ids = ids[:index]
                break
        # The images stay where they were: only the end of the prompt was cut.
        return dataclasses.replace(prompt, ids=tuple(ids),
                                   thinking=self.session.ends_in_thinking(ids))

    def _prepare(self, job: GenerationJob, request_id: str) -> _Prepared:
        started = time.monotonic()
        prepared = self._build_prepared(job, request_id)
        prepared.started_at, prepared.done_at = started, time.monotonic()
        # setup: everything after tokenizing (the context check, the parser, the constraint,
        # sampling, the engine request with its snapshot hints).
        prepared.phases["setup"] = max(0.0, prepared.done_at - started - sum(
            prepared.phases.values()))
        return prepared

    def _build_prepared(self, job: GenerationJob, request_id: str) -> _Prepared:
        session, settings = self.session, self.settings
        prompt = self._render(job)
        phases = {"render": prompt.render_s, "tokenize": prompt.tokenize_s}
        prompt_tokens = len(prompt.ids)
        if prompt_tokens >= self.max_context:
            raise ApiError(400, f"prompt is too long: {prompt_tokens} tokens > "
                                f"{self.max_context - 1} maximum", param="messages",
                           code="context_length_exceeded")
        room = self.max_context - prompt_tokens
        wanted = job.max_tokens if job.max_tokens is not None else settings.max_new
        if wanted == 0:
            return _Prepared(None, prompt_tokens, prompt.thinking, job.tools, phases=phases)
        # Built here, off the event loop: stop strings compile into regular expressions.
        parser = self._parser(job, prompt.thinking, job.tools)
        max_new = min(wanted, room)
        constraint = self._constraint(job, prompt.thinking)
        overrides = job.sampling
        sampling = session.sampling(prompt.thinking, overrides,
                                    constrained=constraint is not None)
        budget = job.thinking_budget if job.thinking_budget is not None else \
            settings.thinking_budget
        if budget is not None and prompt.thinking and budget + len(
                session.thinking_close_ids) + 1 > max_new:
            budget = None if max_new <= len(session.thinking_close_ids) + 1 else \
                max_new - len(session.thinking_close_ids) - 1
        logprobs = 0
        if job.top_logprobs is not None:
            logprobs = max(1, job.top_logprobs)
        request = session.build_request(
            prompt, max_new_tokens=max_new, sampling=sampling,
            stop_token_ids=settings.stop_token_id, thinking_budget=budget,
            loop_guard=settings.reasoning_loop, constraint=constraint, logprobs=logprobs,
            request_id=request_id)
        return _Prepared(request, prompt_tokens, prompt.thinking, job.tools, parser, phases)

    def _constraint(self, job: GenerationJob, thinking: bool):
        from runtime.text.constraints import ConstraintError

        param = _constraint_param(job)
        self._check_satisfiable(job)
        try:
            spec, _ = constraint_spec(job)
            if spec is None:
                return None
            return self._compile(job, spec, thinking)
        except ConstraintError as exc:
            if param != "tools":
                raise invalid(param, str(exc), "invalid_constraint") from None
            error = exc
        # "auto" with strict tools or tool grammars: a non-strict tool whose schema the grammar
        # cannot take (a sloppy MCP schema) must not fail the request; its calls are then
        # checked only up to the function header.
        try:
            constraint = self._compile(job, constraint_spec(job, loose=True)[0], thinking)
        except ConstraintError:
            raise invalid(param, str(error), "invalid_constraint") from None
        log.warning("non-strict tools' calls left unchecked: %s", error)
        return constraint

    def _check_satisfiable(self, job: GenerationJob) -> None:
        """400 for an answer schema or a tool grammar that no text can match: compiled into
        the whole answer's constraint, it would pass the first mask and dead-end mid-answer
        (or, a schema llguidance only partly enforces, be silently loosened)."""
        from runtime.text.constraints import ConstraintError
        from runtime.text.constraints_tools import schema_admits_nothing, value_grammar_spec

        output = job.output_format
        if output is not None and output.kind != "json_object" and \
                schema_admits_nothing(output.schema):
            raise invalid(_constraint_param(job), "the JSON schema admits no value",
                          "invalid_constraint")
        for grammar in job.tool_grammars if job.tools else ():
            try:
                self.session.compile_constraint(
                    value_grammar_spec(grammar.syntax, grammar.definition), False)
            except ConstraintError as exc:
                raise invalid("tools", f"custom tool {grammar.tool!r}: {exc}",
                              "invalid_constraint") from None

    def _compile(self, job: GenerationJob, spec, thinking: bool):
        # With tools, the spec covers the calls: a `<tool_call>` inside the think block would
        # be parsed as a call the grammar never saw, so it is not allowed there.
        return self.session.compile_constraint(spec, thinking, tool_calls=bool(job.tools))

    def _parser(self, job: GenerationJob, thinking: bool, tools: tuple):
        from runtime.text.parser import QwenOutputParser
        from runtime.text.stops import StopConditions

        settings = self.settings
        stops = StopConditions.build(tuple(settings.stop) + tuple(job.stop),
                                     settings.reasoning_stop, settings.stop_token_id)
        return QwenOutputParser(self.session.tokenizer, tools=list(tools) or None,
                                starts_in_reasoning=thinking,
                                tolerant_tool_calls=settings.tolerant_tool_calls,
                                call_id_prefix=CALL_ID_PREFIX.get(job.api, "call_"),
                                stop=stops)


def constraint_spec(job: GenerationJob, *, loose: bool = False) -> tuple[Any, str]:
    """The output constraint a job asks for, and the request field it came from. loose: in
    "auto", check the calls of non-strict tools without a grammar only up to their header."""
    from runtime.text.constraints import ConstraintSpec
    from runtime.text.constraints_tools import (json_or_tool_calls_spec, tool_call_spec,
                                                value_grammar_spec)

    param = _constraint_param(job)
    answer = None
    if job.output_format is not None:
        if job.output_format.kind == "json_object":
            answer = ConstraintSpec.json_object()
        else:
            answer = ConstraintSpec.json_schema(job.output_format.schema or {},
                                                strict=job.output_format.strict)
    choice = job.tool_choice
    tools = list(job.tools)
    grammars = {(grammar.tool, grammar.parameter): value_grammar_spec(grammar.syntax,
                                                                       grammar.definition)
                for grammar in job.tool_grammars} if tools else {}
    if choice.mode in ("required", "named"):
        return tool_call_spec(tools, required=True, name=choice.name,
                              parallel=job.parallel_tool_calls,
                              value_grammars=grammars), "tool_choice"
    if answer is not None and tools:
        return json_or_tool_calls_spec(answer, tools, parallel=job.parallel_tool_calls,
                                       value_grammars=grammars), param
    if answer is not None:
        return answer, param
    if tools and (grammars or any(tool["function"].get("strict") for tool in tools)):
        # "auto": free text, and calls checked from their `<tool_call>` on.
        enforced = {name for name, _ in grammars}
        unchecked = [tool["function"]["name"] for tool in tools if loose and not
                     tool["function"].get("strict") and tool["function"]["name"] not in enforced]
        return tool_call_spec(tools, required=False, parallel=job.parallel_tool_calls,
                              value_grammars=grammars, loose=unchecked), "tools"
    return None, param


def _constraint_param(job: GenerationJob) -> str:
    if job.tool_choice.mode in ("required", "named"):
        return "tool_choice"
    if job.output_format is None and job.tools:
        return "tools"
    return {"chat": "response_format", "responses": "text.format",
            "messages": "output_config.format"}[job.api]
