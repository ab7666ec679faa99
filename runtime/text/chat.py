"""Chat templates: loading (the artifact's, or `--chat-template FILE`), rendering with Hugging
Face's Jinja conventions, and tokenizing a rendered prompt so that text coming from messages
never turns into special tokens.

HF conventions: a sandboxed environment with `trim_blocks`, `lstrip_blocks` and the loop-controls
extension; `tojson` is `json.dumps(ensure_ascii=False)` with the default separators;
`raise_exception(msg)` and `strftime_now(fmt)` are globals. Our maintained templates live in
`tools/chat_templates/` (qwen3_5.jinja for Qwen3.5/3.6, qwen3_next.jinja for Qwen3-Next).
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import re
from dataclasses import dataclass
from importlib import resources as importlib_resources
from typing import Any, Iterator, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox

from runtime.text.tokenizer import Tokenizer

BUILTIN_TEMPLATES = ("qwen3_5", "qwen3_next")

# Noncharacters (permanently reserved for internal use) that bracket special-token spellings
# inside message text while rendering for tokenization; see ChatTemplate.render_ids.
_LITERAL_OPEN = "\ufdd0"
_LITERAL_CLOSE = "\ufdd1"


class ChatTemplateError(ValueError):
    """The chat template is missing, cannot be compiled, or failed while rendering."""


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str):
    raise ChatTemplateError(f"chat template: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """HF's `{% generation %}...{% endgeneration %}` (marks assistant spans for training
    masks): rendered as its plain body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template syntax error, line {exc.lineno}: {exc.message}") \
            from exc


def prepare_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copies of `messages` in the shape our templates (and Qwen's) expect:

    - assistant `tool_calls[].function.arguments` given as a JSON string (OpenAI clients) become
      the decoded object, because templates iterate over the arguments; text that is not a JSON
      object stays a string and is rendered as-is;
    - assistant content that embeds `<think>...</think>` without a separate reasoning field is
      split into `reasoning_content` and `content`.
    """
    prepared = []
    for message in messages:
        message = dict(message)
        if message.get("role") == "assistant":
            calls = message.get("tool_calls")
            if calls:
                message["tool_calls"] = [_prepare_tool_call(call) for call in calls]
            content = message.get("content")
            has_reasoning = (isinstance(message.get("reasoning_content"), str)
                             or isinstance(message.get("reasoning"), str))
            if isinstance(content, str) and "</think>" in content and not has_reasoning:
                reasoning, _, answer = content.rpartition("</think>")
                message["reasoning_content"] = reasoning.split("<think>")[-1]
                message["content"] = answer
        prepared.append(message)
    return prepared


def _prepare_tool_call(call: Mapping[str, Any]) -> dict[str, Any]:
    call = dict(call)
    holder = call
    if isinstance(call.get("function"), Mapping):
        holder = call["function"] = dict(call["function"])
    arguments = holder.get("arguments")
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):  # nested too deep to decode: kept as the string
            decoded = None
        if isinstance(decoded, dict):
            holder["arguments"] = decoded
    return call


def render_chat(template_source: str, messages: Sequence[Mapping[str, Any]], *,
                tools: Sequence[Mapping[str, Any]] | None = None,
                add_generation_prompt: bool = True, enable_thinking: bool | None = None,
                preserve_thinking: bool = False, reasoning_effort: str | None = None,
                **kwargs: Any) -> str:
    """Render `messages` (OpenAI-style dicts) with a Jinja chat template.

    enable_thinking / reasoning_effort: passed only when given, so the template's default
    applies otherwise (Qwen3.5/3.6: thinking on). Extra keyword arguments (chat_template_kwargs,
    add_vision_id, ...) become template variables.
    """
    variables = _variables(messages, tools, add_generation_prompt, enable_thinking,
                           preserve_thinking, reasoning_effort, kwargs)
    return _render(_compile(template_source), variables)


def _variables(messages, tools, add_generation_prompt, enable_thinking, preserve_thinking,
               reasoning_effort, extra) -> dict[str, Any]:
    variables: dict[str, Any] = {"bos_token": "", "eos_token": "<|im_end|>", **extra}
    variables.update(messages=prepare_messages(messages), tools=list(tools) if tools else None,
                     add_generation_prompt=add_generation_prompt,
                     preserve_thinking=preserve_thinking)
    if enable_thinking is not None:
        variables["enable_thinking"] = enable_thinking
    if reasoning_effort is not None:
        variables["reasoning_effort"] = reasoning_effort
    return variables


def _render(template: jinja2.Template, variables: dict[str, Any]) -> str:
    try:
        return template.render(**variables)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc
    except (TypeError, AttributeError, KeyError, IndexError, ValueError) as exc:
        raise ChatTemplateError(f"chat template failed on these messages: {exc!r}") from exc
    except RecursionError:
        raise ChatTemplateError("chat template failed: values nested too deep") from None


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template and where it came from ("file:PATH", "artifact",
    "builtin:qwen3_5", ...)."""

    source: str
    origin: str

    def __post_init__(self):
        _compile(self.source)  # syntax errors surface at load time

    def render(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> str:
        """The prompt text; options as for `render_chat`."""
        return render_chat(self.source, messages, **options)

    def render_ids(self, tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]],
                   **options: Any) -> list[int]:
        """The prompt's token ids. Special tokens written by the template are parsed; text that
        comes from the messages or tools (a user pasting `<|im_end|>`) stays plain text.

        How: every special-token spelling inside message/tool strings is bracketed with two
        noncharacters before rendering; the rendered text is then cut only at unbracketed
        special tokens, and each piece in between is encoded without special parsing. This gives
        the same ids as encoding the rendered text whole whenever the messages spell no special
        token.

        `replacements` (old, new): text the template wrote that is replaced before encoding,
        each once, in order, at or after the previous one (a video's one block by its frame
        groups' blocks, `runtime.media.placement.video_replacements`); bracketed message text
        never matches."""
        return encode_rendered(tokenizer, self.render_marked(tokenizer, messages, **options))

    def render_marked(self, tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]],
                      **options: Any) -> str:
        """`render_ids`' first half: the rendered text, with every special-token spelling that
        comes from the messages or tools bracketed and the `replacements` made
        (`encode_rendered` is the second half)."""
        replacements = options.pop("replacements", ())
        pattern = _special_pattern(tokenizer)
        marked_messages = _mark(prepare_messages(messages), pattern)
        marked_tools = _mark(options.pop("tools", None), pattern)
        variables = _variables(marked_messages, marked_tools,
                               options.pop("add_generation_prompt", True),
                               options.pop("enable_thinking", None),
                               options.pop("preserve_thinking", False),
                               options.pop("reasoning_effort", None), options)
        return _replace_in_order(_render(_compile(self.source), variables), replacements)


def _replace_in_order(text: str, replacements: Sequence[tuple[str, str]]) -> str:
    pieces, position = [], 0
    for index, (old, new) in enumerate(replacements):
        found = text.find(old, position)
        if found < 0:
            raise ChatTemplateError(f"the chat template did not write {old!r} for media part "
                                    f"{index} (a template without video support?)")
        pieces += [text[position:found], new]
        position = found + len(old)
    return "".join(pieces) + text[position:]


def encode_rendered(tokenizer: Tokenizer, text: str) -> list[int]:
    """Encode text rendered by `ChatTemplate.render_ids`' marking scheme (plain rendered text
    works too): bracketed spellings are literal text, bare special tokens become their ids."""
    pattern = _special_pattern(tokenizer)
    splitter = re.compile(f"{_LITERAL_OPEN}(.*?){_LITERAL_CLOSE}|({pattern.pattern})", re.S)
    segments: list[str | int] = []      # text pieces to encode, and special ids, in order
    pending: list[str] = []
    position = 0

    def flush():
        piece = "".join(pending).replace(_LITERAL_OPEN, "").replace(_LITERAL_CLOSE, "")
        pending.clear()
        if piece:
            segments.append(piece)

    for match in _matches(splitter, text, _first_characters(_special_spellings(tokenizer))):
        pending.append(text[position:match.start()])
        if match.group(1) is not None:
            pending.append(match.group(1))
        else:
            flush()
            segments.append(tokenizer.id_of(match.group(2)))
        position = match.end()
    pending.append(text[position:])
    flush()
    # All pieces in one call: the messages of a long conversation are encoded in parallel.
    encoded = iter(tokenizer.encode_many([s for s in segments if isinstance(s, str)],
                                         parse_special=False))
    ids: list[int] = []
    for segment in segments:
        if isinstance(segment, str):
            ids.extend(next(encoded))
        else:
            ids.append(segment)
    return ids


def _matches(splitter: re.Pattern, text: str, first: re.Pattern) -> Iterator[re.Match]:
    """`splitter.finditer(text)`, found fast: a match can only begin at a character that
    begins a special-token spelling or the literal bracket, so those are found first (a tight
    scan) and the splitter is tried only there. Searching a megabyte-long message with the
    splitter itself takes seconds and holds the GIL (every server thread stalls)."""
    position = 0
    while True:
        candidate = first.search(text, position)
        if candidate is None:
            return
        match = splitter.match(text, candidate.start())
        if match is None:
            position = candidate.start() + 1
            continue
        yield match
        position = max(match.end(), match.start() + 1)


@functools.lru_cache(maxsize=4)
def _first_characters(spellings: tuple[str, ...]) -> re.Pattern:
    """A character class of the first characters of `spellings` and of `_LITERAL_OPEN`."""
    first = {spelling[0] for spelling in spellings if spelling} | {_LITERAL_OPEN}
    return re.compile("[" + "".join(re.escape(c) for c in sorted(first)) + "]")


def _special_spellings(tokenizer: Tokenizer) -> tuple[str, ...]:
    return tuple(sorted((tokenizer.token_bytes[i].decode("utf-8") for i in tokenizer.special_ids),
                        key=len, reverse=True))


def _special_pattern(tokenizer: Tokenizer) -> re.Pattern:
    return _compile_alternation(_special_spellings(tokenizer))
@functools.lru_cache(maxsize=4)
def _compile_alternation(spellings: tuple[str, ...]) -> re.Pattern:
    return re.compile("|".join(re.escape(s) for s in spellings) or "(?!)")


def _mark(value: Any, pattern: re.Pattern) -> Any:
    """A copy of `value` with every special-token spelling inside its strings bracketed."""
    if isinstance(value, str):
        if not pattern.search(value):
            return value
        return pattern.sub(lambda m: f"{_LITERAL_OPEN}{m.group(0)}{_LITERAL_CLOSE}", value)
    if isinstance(value, Mapping):
        return {key: _mark(item, pattern) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_mark(item, pattern) for item in value]
    return value


def builtin_template_source(name: str) -> str:
    """The text of one of our maintained templates in tools/chat_templates/."""
    if name not in BUILTIN_TEMPLATES:
        raise ChatTemplateError(f"no built-in chat template {name!r}; have {BUILTIN_TEMPLATES}")
    path = importlib_resources.files("tools").joinpath("chat_templates", f"{name}.jinja")
    return path.read_text(encoding="utf-8")


def load_chat_template(resources: Mapping[str, bytes] | None = None,
                       override_path: str | os.PathLike | None = None, *,
                       fallback: str | None = None) -> ChatTemplate:
    """The template to use, in this order: `override_path` (`--chat-template FILE`), the
    artifact's `chat_template.jinja` resource, the `chat_template` field of its
    `tokenizer_config.json`, then the built-in template named by `fallback` (if any)."""
    if override_path is not None:
        try:
            with open(override_path, encoding="utf-8") as handle:
                source = handle.read()
        except OSError as exc:
            raise ChatTemplateError(f"cannot read chat template {override_path}: "
                                    f"{exc.strerror or exc}") from exc
        return ChatTemplate(source, f"file:{override_path}")
    resources = resources or {}
    if "chat_template.jinja" in resources:
        return ChatTemplate(resources["chat_template.jinja"].decode("utf-8"), "artifact")
    if "tokenizer_config.json" in resources:
        try:
            config = json.loads(resources["tokenizer_config.json"])
        except ValueError as exc:
            raise ChatTemplateError(f"tokenizer_config.json is not valid JSON: {exc}") from exc
        source = config.get("chat_template") if isinstance(config, dict) else None
        if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
            named = {item.get("name"): item.get("template") for item in source
                     if isinstance(item, dict)}
            source = named.get("default")
        if isinstance(source, str):
            return ChatTemplate(source, "artifact")
    if fallback is not None:
        return ChatTemplate(builtin_template_source(fallback), f"builtin:{fallback}")
    raise ChatTemplateError("the artifact has no chat template; pass --chat-template FILE")
