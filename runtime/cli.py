"""`infernix MODEL --prompt TEXT | --messages FILE [options]`: one request, streamed.

Output contract (seed 000): the answer streams to stdout; reasoning, startup milestones, errors
and the result report go to stderr, so stdout can be redirected on its own. Option mistakes and
bad local input (the messages file, schema or grammar files, a prompt that cannot fit) are one
line on stderr and exit code 2; a failure while loading or generating is exit code 1; Ctrl-C
cancels the request, prints the report and exits with 130.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TextIO

from runtime.media.sources import MediaError, part_kind
from runtime.config import ConfigError, parse_settings
from runtime.log import colours_enabled, get_logger, setup_logging

PROGRAM = "infernix"
ROLES = ("system", "developer", "user", "assistant", "tool")
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a Unix tool reports when its reader went away


class InputError(ConfigError):
    """Bad local input (messages, schema or grammar file, prompt size): exit code 2."""


@dataclass
class RunPlan:
    """What the command line asks for, validated before the model is loaded."""

    messages: list[dict]
    tools: list[dict] = field(default_factory=list)
    constraint_spec: Any = None
    enable_thinking: Optional[bool] = None
    reasoning_effort: Optional[str] = None
    demo_thinking_off: bool = False  # --demo turned thinking off (nothing asked for it)


# --- validation and input -----------------------------------------------------------------------

def _given_constraints(settings) -> list[str]:
    given = []
    if settings.json_object:
        given.append("--json-object")
    if settings.json_schema_file is not None:
        given.append("--json-schema-file")
    if settings.grammar_file is not None:
        given.append("--grammar-file")
    if settings.regex is not None:
        given.append("--regex")
    if settings.choice:
        given.append("--choice")
    return given


def _read_text(path: str, flag: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{flag}: file {path!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{flag}: cannot read {path!r}: {exc}") from None


def _check_content(content: Any, where: str, role: str) -> None:
    if content is None:
        if role in ("assistant",):
            return
        raise InputError(f"{where}: content is required for role {role!r}")
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise InputError(f"{where}: content must be a string or an array of parts")
    for index, part in enumerate(content):
        at = f"{where}.content[{index}]"
        if isinstance(part, str):
            continue
        if not isinstance(part, dict):
            raise InputError(f"{at}: a content part must be an object")
        kind = part.get("type", "text" if "text" in part else None)
        if part_kind(part) is not None:
            continue            # decoded when the prompt is rendered (MediaError names the part)
        if kind != "text" or not isinstance(part.get("text"), str):
            raise InputError(f"{at}: unsupported content part (expected "
                             '{"type": "text", "text": "..."})')


def _check_message(message: Any, index: int) -> dict:
    where = f"--messages: message {index}"
    if not isinstance(message, dict):
        raise InputError(f"{where} must be an object")
    role = message.get("role")
    if role not in ROLES:
        raise InputError(f"{where}: role {role!r} is not one of {', '.join(ROLES)}")
    _check_content(message.get("content"), where, role)
    if role == "assistant":
        reasoning = message.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise InputError(f"{where}: reasoning_content must be a string")
        calls = message.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise InputError(f"{where}: tool_calls must be an array")
            for n, call in enumerate(calls):
                function = call.get("function", call) if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise InputError(f"{where}: tool_calls[{n}] needs a function name")
        elif message.get("content") is None:
            raise InputError(f"{where}: an assistant message needs content or tool_calls")
    if role == "tool" and "tool_call_id" in message and \
            not isinstance(message["tool_call_id"], str):
        raise InputError(f"{where}: tool_call_id must be a string")
    return message


def load_messages(path: str) -> tuple[list[dict], list[dict]]:
    """A messages file: a non-empty JSON array, or an object with `messages` and `tools`."""
    text = _read_text(path, "--messages")
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"--messages: {path} is not valid JSON: {exc}") from None
    tools: Any = []
    if isinstance(document, dict):
        unknown = sorted(set(document) - {"messages", "tools"})
        if unknown:
            raise InputError(f"--messages: unknown key(s) {', '.join(unknown)}; expected "
                             "messages and tools")
        messages = document.get("messages")
        tools = document.get("tools") or []
    else:
        messages = document
    if not isinstance(messages, list) or not messages:
        raise InputError("--messages: expected a non-empty array of messages (or an object "
                         "with a non-empty `messages` array)")
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise InputError("--messages: tools must be an array of objects")
    return [_check_message(m, i) for i, m in enumerate(messages)], tools


def _constraint_spec(settings):
    if not _given_constraints(settings):
        return None
    from runtime.text.constraints import ConstraintError, ConstraintSpec

    try:
        if settings.json_object:
            return ConstraintSpec.json_object()
        if settings.json_schema_file is not None:
            return ConstraintSpec.json_schema(_read_text(settings.json_schema_file,
                                                         "--json-schema-file"))
        if settings.grammar_file is not None:
            return ConstraintSpec.grammar(_read_text(settings.grammar_file, "--grammar-file"))
        if settings.regex is not None:
            return ConstraintSpec.regex(settings.regex)
        if settings.choice:
            return ConstraintSpec.choice(settings.choice)
    except ConstraintError as exc:
        raise InputError(str(exc)) from None
    return None


def plan_run(settings) -> RunPlan:
    """Check option combinations and read the local input; raises ConfigError / InputError."""
    if settings.model is None and not settings.demo:
        raise ConfigError("no model given: pass MODEL (a .infernix file), set `model` in "
                          "--config, or use --demo")
    if settings.model is not None and settings.demo:
        raise ConfigError("--demo runs a generated tiny model; give no model path")
    if (settings.prompt is None) == (settings.messages is None):
        raise ConfigError("exactly one of --prompt and --messages is required"
                          if settings.prompt is None else
                          "--prompt and --messages are mutually exclusive")
    effort = settings.reasoning_effort
    if settings.no_thinking and effort not in (None, "none"):
        raise ConfigError(f"--reasoning-effort {effort} cannot be combined with --no-thinking")
    thinking_off = settings.no_thinking or effort == "none"
    # The demo's random model would think until --max-new and print nothing on stdout: it
    # answers without thinking unless a thinking option asks for it.
    thinking_asked = (effort not in (None, "none") or settings.thinking_budget is not None
                      or settings.reasoning_loop != "off")
    demo_thinking_off = settings.demo and not thinking_off and not thinking_asked
    if thinking_off and settings.thinking_budget is not None:
        raise ConfigError("--thinking-budget cannot be combined with --no-thinking "
                          "(or --reasoning-effort none)")
    if thinking_off and settings.reasoning_loop != "off":
        raise ConfigError(f"--reasoning-loop {settings.reasoning_loop} needs thinking; it "
                          "cannot be combined with --no-thinking")
    if settings.prefill_chunk % 64:
        raise ConfigError(f"--prefill-chunk: {settings.prefill_chunk} is not a multiple of 64")
    if settings.device not in ("auto", "cpu", "cuda") and not settings.device.isdigit():
        raise ConfigError(f"--device: {settings.device!r} is not cpu, cuda, a device index "
                          "or auto")
    if settings.chat_template is not None and not Path(settings.chat_template).is_file():
        raise ConfigError(f"--chat-template: file {settings.chat_template!r} does not exist")
    constraints = _given_constraints(settings)
    if len(constraints) > 1:
        raise ConfigError(f"output constraint options are mutually exclusive; got "
                          f"{' and '.join(constraints)}")
    if constraints:
        for flag, value in (("--stop", settings.stop), ("--stop-token-id", settings.stop_token_id),
                            ("--reasoning-stop", settings.reasoning_stop),
                            ("--raw-output", settings.raw_output)):
            if value:
                raise ConfigError(f"{constraints[0]} cannot be combined with {flag} (output "
                                  "constraints reject custom stops and raw output)")
    if settings.messages is not None:
        messages, tools = load_messages(settings.messages)
    else:
        messages, tools = [{"role": "user", "content": settings.prompt}], []
    if tools and constraints and constraints[0] in ("--grammar-file", "--regex", "--choice"):
        raise InputError(f"{constraints[0]} requires no tools, but the messages file declares "
                         f"{len(tools)}; JSON constraints may accompany tools")
    return RunPlan(messages=messages, tools=tools, constraint_spec=_constraint_spec(settings),
                   enable_thinking=False if thinking_off or demo_thinking_off else None,
                   reasoning_effort=effort if effort not in (None, "none") else None,
                   demo_thinking_off=demo_thinking_off)


# --- the run ----------------------------------------------------------------------------------

def main(argv: Optional[list[str]] = None, *, stdout: Optional[TextIO] = None,
         stderr: Optional[TextIO] = None) -> int:
    stdout = stdout if stdout is not None else sys.stdout
    stderr = stderr if stderr is not None else sys.stderr
    try:
        settings = parse_settings("cli", sys.argv[1:] if argv is None else argv)
        plan = plan_run(settings)
    except ConfigError as exc:
        print(f"{PROGRAM}: error: {exc}", file=stderr)
        return EXIT_USAGE
    except SystemExit as exc:         # --help
        return int(exc.code or 0)
    setup_logging(settings.log_level, settings.log_colours, stream=stderr)
    logger = get_logger("cli")
    if settings.options_from_file:
        logger.info("options from %s: %s", settings.config, ", ".join(settings.options_from_file))
    if plan.demo_thinking_off:
        logger.info("demo: thinking off, so the answer shows on stdout (--reasoning-effort "
                    "LEVEL or --thinking-budget N turns it on)")

    from runtime.session import ModelSession

    try:
        session = ModelSession.open(settings)
    except ConfigError as exc:
        print(f"{PROGRAM}: error: {exc}", file=stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        logger.error("interrupted while loading")
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - artifact, model, tokenizer, template errors
        logger.error("cannot load the model: %s", exc)
        logger.debug("details", exc_info=True)
        return EXIT_FAILED
    try:
        return _run(session, settings, plan, stdout, stderr, logger)
    except InputError as exc:
        print(f"{PROGRAM}: error: {exc}", file=stderr)
        return EXIT_USAGE
    finally:
        session.close()


def _run(session, settings, plan: RunPlan, stdout: TextIO, stderr: TextIO, logger) -> int:
    from runtime.engine.api import FinishReason, RequestRejected
    from runtime.engine.presets import SamplingOverrides
    from runtime.text.chat import ChatTemplateError

    try:
        prompt = session.render(plan.messages, tools=plan.tools or None,
                                enable_thinking=plan.enable_thinking,
                                reasoning_effort=plan.reasoning_effort)
    except ChatTemplateError as exc:
        raise InputError(f"cannot render the messages: {exc}") from None
    except MediaError as exc:
        raise InputError(f"--messages: {exc}") from None
    constraint = None
    if plan.constraint_spec is not None:
        from runtime.text.constraints import ConstraintError

        try:
            constraint = session.compile_constraint(plan.constraint_spec, prompt.thinking)
        except ConstraintError as exc:
            raise InputError(str(exc)) from None
        for warning in getattr(constraint, "warnings", ()):
            logger.warning("constraint: %s", warning)
    sampling = session.sampling(prompt.thinking, SamplingOverrides(),
                                constrained=constraint is not None)
    request = session.build_request(
        prompt, max_new_tokens=settings.max_new, sampling=sampling,
        stop_token_ids=settings.stop_token_id, thinking_budget=settings.thinking_budget,
        loop_guard=settings.reasoning_loop, constraint=constraint)
    logger.debug("prompt: %d tokens, %s mode, sampling %s", len(prompt.ids),
                 "thinking" if prompt.thinking else "non-thinking", sampling)
    writer = OutputWriter(session, settings, plan, prompt.thinking, stdout, stderr)
    try:
        stream = session.engine.submit(request)
    except RequestRejected as exc:
        raise InputError(str(exc)) from None

    interrupted = cancelled = False
    final = None
    try:
        for output in stream:
            if writer.feed(output.token_ids) and not output.finished and not cancelled:
                stream.cancel()          # a stop string ended the output: the rest is dropped
                cancelled = True
            final = output
    except KeyboardInterrupt:
        interrupted = True
        stream.cancel()
        for output in stream:
            final = output
    except BrokenPipeError:
        # The reader of stdout is gone (`infernix ... | head`): stop generating and leave
        # quietly, as Unix tools do, instead of a traceback.
        stream.cancel()
        for _ in stream:
            pass
        _discard_stdout(stdout)
        return EXIT_BROKEN_PIPE
    reason = writer.stop_reason or (final.finish_reason.value if final else "error")
    writer.finish(truncated=reason in ("length", "context", "cancelled"))
    if final is not None and final.finish_reason is FinishReason.ERROR:
        logger.error("generation failed: %s", final.error)
    print_report(session, settings, final, reason, writer, stderr)
    if interrupted:
        return EXIT_INTERRUPTED
    return EXIT_FAILED if final is None or final.finish_reason is FinishReason.ERROR else EXIT_OK


def _discard_stdout(stdout: TextIO) -> None:
    """Point a broken stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        descriptor = stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a real file (tests pass StringIO)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, descriptor)
    os.close(devnull)


class OutputWriter:
    """Turns token increments into stdout (answer) and stderr (reasoning) text.

    Parsed mode (default): the Qwen output parser splits reasoning, content and tool calls;
    stop strings apply to the answer, reasoning-stop strings to the reasoning. Raw mode
    (--raw-output): the decoded text, special markers included, goes to stdout as generated,
    and stop strings apply to it.
    """

    def __init__(self, session, settings, plan: RunPlan, thinking: bool, stdout: TextIO,
                 stderr: TextIO):
        from runtime.text.detokenizer import Detokenizer
        from runtime.text.stops import StopConditions, StopStringMatcher

        self.stdout, self.stderr = stdout, stderr
        self.raw = settings.raw_output
        self.token_ids: list[int] = []
        self.stop_reason: Optional[str] = None
        self.reasoning_chars = 0
        self.content_chars = 0
        self._ended = False
        self._reasoning_open = False
        stops = StopConditions.build(settings.stop, settings.reasoning_stop,
                                     settings.stop_token_id)
        if self.raw:
            self._detokenizer = Detokenizer(session.tokenizer.token_bytes)
            self._raw_stops = StopStringMatcher(stops.stop_strings)
        else:
            from runtime.text.parser import QwenOutputParser

            self._parser = QwenOutputParser(
                session.tokenizer, starts_in_reasoning=thinking, tools=plan.tools,
                stop=stops, tolerant_tool_calls=settings.tolerant_tool_calls)

    def feed(self, token_ids) -> bool:
        """Write what these ids add; True once a stop string ended the output."""
        if self._ended:
            return True
        self.token_ids.extend(token_ids)
        if self.raw:
            text, matched = self._raw_stops.push(self._detokenizer.push_many(token_ids))
            self._content(text)
            if matched is not None:
                self.stop_reason, self._ended = "stop", True
            return self._ended
        self._write_events(self._parser.feed(token_ids))
        hit = self._parser.stopped
        if hit is not None:
            # The engine ends on stop ids by itself; text stops only the parser sees.
            self._ended = True
            if hit.kind in ("stop_string", "reasoning_stop"):
                self.stop_reason = "stop"
        return self._ended

    def finish(self, truncated: bool) -> None:
        """Flush what is held; `truncated`: a limit or a cancellation cut the output."""
        if self.raw:
            if not self._ended:
                self._content(self._detokenizer.flush() + self._raw_stops.release())
        else:
            self._write_events(self._parser.finish(truncated))
        if self._reasoning_open:
            self.stderr.write("\n")
        if self.content_chars:
            self.stdout.write("\n")
        self.stdout.flush()
        self.stderr.flush()

    def _write_events(self, events) -> None:
        from runtime.text.events import (ContentDelta, ReasoningDelta, ToolCallArgsDelta,
                                         ToolCallEnd, ToolCallStart)

        for event in events:
            if isinstance(event, ReasoningDelta):
                self.stderr.write(event.text)
                self.stderr.flush()
                self.reasoning_chars += len(event.text)
                self._reasoning_open = not event.text.endswith("\n")
            elif isinstance(event, ContentDelta):
                if self._reasoning_open:
                    self.stderr.write("\n")
                    self._reasoning_open = False
                self._content(event.text)
            elif isinstance(event, ToolCallStart):
                self._content(("\n" if self.content_chars else "") +
                              f"[tool call {event.index}] {event.name} ")
            elif isinstance(event, ToolCallArgsDelta):
                self._content(event.json_fragment)
            elif isinstance(event, ToolCallEnd):
                self._content("\n")

    def _content(self, text: str) -> None:
        if text:
            self.stdout.write(text)
            self.stdout.flush()
            self.content_chars += len(text)


def speculative_summary(stats) -> str:
    """Rounds, drafts accepted of verified, and tokens per round (the token each round samples
    at its last kept position included)."""
    share = 100.0 * stats.accepted_tokens / stats.drafted_tokens if stats.drafted_tokens else 0.0
    per_round = (stats.accepted_tokens + stats.spec_rounds) / stats.spec_rounds
    return (f"{stats.spec_rounds} rounds | accepted {stats.accepted_tokens} of "
            f"{stats.drafted_tokens} drafts ({share:.1f} %) | {per_round:.2f} tokens per round")


def print_report(session, settings, final, reason: str, writer: OutputWriter,
                 stderr: TextIO) -> None:
    """The result report on stderr (seed 000): tokens, timings, throughput, memory, ids."""
    colours = colours_enabled(settings.log_colours, stderr)
    bold, reset = ("\x1b[1m", "\x1b[0m") if colours else ("", "")
    stats = final.stats if final is not None else None
    lines = []
    if stats is not None:
        thinking = f", thinking {stats.thinking_tokens}" if stats.thinking_tokens else ""
        inserted = f", inserted {stats.inserted_tokens}" if stats.inserted_tokens else ""
        lines.append(f"{bold}prompt tokens{reset} {stats.prompt_tokens} | "
                     f"{bold}output tokens{reset} {stats.output_tokens}{thinking}{inserted} | "
                     f"{bold}finish{reset} {reason}")
        lines.append(f"{bold}time to first token{reset} {stats.ttft_s * 1000:.1f} ms | "
                     f"{bold}prefill{reset} {stats.prefill_tok_s:.1f} tok/s | "
                     f"{bold}decode{reset} {stats.decode_tok_s:.1f} tok/s "
                     f"({max(stats.output_tokens - stats.inserted_tokens - 1, 0)} tokens in "
                     f"{stats.decode_s:.2f} s)")
        closer = {"budget": "the thinking budget", "loop": "the reasoning-loop guard"}
        if stats.thinking_closed_by in closer:
            lines.append(f"{bold}thinking{reset} closed by "
                         f"{closer[stats.thinking_closed_by]}")
        if stats.preemptions:
            lines.append(f"{bold}preemptions{reset} {stats.preemptions} "
                         f"({stats.replayed_tokens} tokens replayed)")
        if stats.spec_rounds:
            lines.append(f"{bold}speculative{reset} {speculative_summary(stats)}")
    memory = session.device_memory_bytes()
    lines.append(f"{bold}device{reset} {session.device} | {bold}GPU memory{reset} " +
                 (f"{memory / 2**30:.2f} GiB reserved" if memory else "n/a (CPU backend)"))
    if settings.print_token_ids:
        lines.append(f"{bold}token ids{reset} " + " ".join(str(t) for t in writer.token_ids))
    stderr.write("\n".join(lines) + "\n")
    stderr.flush()


if __name__ == "__main__":
    sys.exit(main())
