"""OpenAI Responses: request validation into a `GenerationJob`, and the in-process store behind
`previous_response_id` and `GET /v1/responses/{id}`.

Input items become template messages: user / system / developer / assistant messages,
`function_call` and `custom_tool_call` items attach to the assistant turn they follow,
`reasoning` items (raw `content`, or our own `encrypted_content`) become that turn's reasoning,
and `*_output` items become tool messages. Tools come from `tools` and from `additional_tools`
input items (Codex sends tool groups there; they join the request's tools), and a
`tool_search_output` item's loaded tools join them too. Function tools are flat; custom tools
are shown to the model as a function with one string parameter `input`; namespace tools are
flattened to `namespace.name`. A client-executed `tool_search` (`execution: "client"`, Codex) is
shown to the model as a function `tool_search` with the tool's parameters; its calls come back
as `tool_search_call` items. Built-in tools run by a server (web search, file search, ...) are
accepted but never shown to the model; forcing one is a 400.

A custom tool's grammar format (`{"type": "grammar", "syntax": "lark" | "regex", "definition"}`)
is shown to the model in the tool's description and, where constrained decoding is available,
checked here (a bad grammar is a 400 naming the tool) and enforced on the `input` of every call
of that tool (job.tool_grammars; the backend builds the constraint).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import orjson

from protocols.errors import ApiError, invalid, unsupported
from protocols.job import (Capabilities, GenerationJob, OutputFormat, ToolChoice, ToolGrammar,
                           get_bool, openai_tool_choice_mode, read_sampling,
                           get_dict, get_effort, get_int, get_list, get_str, get_verbosity,
                           parse_arguments, template_kwargs, text_of_parts,
                           thinking_from_kwargs)
from protocols.media_parts import content_with_images, responses_image
from protocols.responses_encoder import decode_reasoning

BUILTIN_TOOLS = ("web_search", "web_search_preview", "file_search", "local_shell",
                 "code_interpreter", "mcp", "image_generation", "computer_use_preview",
                 "computer_use", "apply_patch", "shell", "tool_search")
TEXT_PARTS = ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text")
TOOL_SEARCH = "tool_search"
# A client tool_search without a schema: the query the Responses API documents for it.
TOOL_SEARCH_PARAMETERS = {"type": "object", "properties": {"query": {"type": "string"}},
                          "required": ["query"]}


@dataclass
class ResponsesOptions:
    stream: bool = False
    store: bool = True
    echo: dict = field(default_factory=dict)
    custom_tools: frozenset = frozenset()
    namespaces: dict = field(default_factory=dict)
    tool_searches: frozenset = frozenset()
    include_encrypted_reasoning: bool = False
    items: list = field(default_factory=list)  # the full input history, for the store


class ResponseStore:
    """LRU of finished responses: the response object plus the input history it answered,
    bounded in records and in (serialized) bytes."""

    def __init__(self, max_records: int = 1024, max_bytes: int = 256 << 20):
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.bytes = 0
        self._records: OrderedDict[str, dict] = OrderedDict()

    def put(self, response: dict, items: list) -> None:
        size = len(orjson.dumps(response)) + len(orjson.dumps(items))
        if size > self.max_bytes:
            return  # larger than the whole store: not kept
        self.delete(response["id"])
        self._records[response["id"]] = {"response": response, "items": items, "size": size}
        self.bytes += size
        while len(self._records) > self.max_records or self.bytes > self.max_bytes:
            _, evicted = self._records.popitem(last=False)
            self.bytes -= evicted["size"]

    def get(self, response_id: str) -> Optional[dict]:
        record = self._records.get(response_id)
        if record is not None:
            self._records.move_to_end(response_id)
        return record

    def delete(self, response_id: str) -> bool:
        record = self._records.pop(response_id, None)
        if record is None:
            return False
        self.bytes -= record["size"]
        return True


def parse_responses_request(body: dict, caps: Capabilities = Capabilities(),
                            store: Optional[ResponseStore] = None
                            ) -> tuple[GenerationJob, ResponsesOptions]:
    get_str(body, "model")
    if body.get("background"):
        raise unsupported("background", "background responses are not supported")
    if body.get("conversation") is not None:
        raise unsupported("conversation", "conversations are not supported; use "
                                          "previous_response_id or send the history")
    truncation = get_str(body, "truncation")
    if truncation not in (None, "disabled"):
        raise unsupported("truncation", "only 'disabled' is supported")
    if body.get("prompt") is not None:
        raise unsupported("prompt", "stored prompt templates are not supported")

    instructions = get_str(body, "instructions")
    history: list = []
    previous_id = get_str(body, "previous_response_id")
    if previous_id:
        record = store.get(previous_id) if store is not None else None
        if record is None:
            raise ApiError(400, f"Previous response with id '{previous_id}' not found.",
                           param="previous_response_id", code="previous_response_not_found")
        history = list(record["items"]) + list(record["response"].get("output", []))
    raw_input = body.get("input")
    if isinstance(raw_input, str):
        new_items = [{"type": "message", "role": "user", "content": raw_input}]
    elif isinstance(raw_input, list):
        new_items = list(raw_input)
    elif raw_input is None:
        new_items = []
    else:
        raise invalid("input", "must be a string or an array of items")
    items = history + new_items
    if not items:
        raise invalid("input", "is required", "missing_required_parameter")

    toolset = _tools(_declared_tools(get_list(body, "tools") or [], items, len(history)),
                     check=caps.constraints)
    tools, grammars = toolset.tools, toolset.grammars
    tool_choice = _tool_choice(body.get("tool_choice"), tools, toolset.builtins)
    messages = _messages(items, len(history), instructions)

    kwargs = template_kwargs(body)
    enable, preserve = thinking_from_kwargs(kwargs, "chat_template_kwargs")
    if get_bool(body, "enable_thinking") is not None:
        enable = body["enable_thinking"]
    if get_bool(body, "preserve_thinking") is not None:
        preserve = body["preserve_thinking"]
    reasoning = get_dict(body, "reasoning") or {}
    effort = get_effort(reasoning, "effort", "reasoning.effort")
    if effort == "none":
        enable, effort = False, None

    text = get_dict(body, "text") or {}
    verbosity = get_verbosity(text, "verbosity", "text.verbosity")
    output_format = _text_format(get_dict(text, "format", "text.format"))
    if output_format is not None and not caps.constraints:
        raise unsupported("text.format", "constrained output is not available in this build")
    if tool_choice.mode in ("required", "named") and not caps.constraints:
        raise unsupported("tool_choice", f"tool_choice {tool_choice.mode!r} needs constrained "
                                         "decoding, which is not available in this build")
    top_logprobs = get_int(body, "top_logprobs", minimum=0, maximum=20)
    if top_logprobs:
        raise unsupported("top_logprobs", "log probabilities are not available from this "
                                          "endpoint")

    parallel = get_bool(body, "parallel_tool_calls")
    max_tool_calls = get_int(body, "max_tool_calls", minimum=1)
    include = get_list(body, "include") or []
    if not all(isinstance(entry, str) for entry in include):
        raise invalid("include", "must be an array of strings")
    max_output = get_int(body, "max_output_tokens", minimum=0)
    sampling = read_sampling(body)
    store_flag = get_bool(body, "store")
    metadata = get_dict(body, "metadata")

    job = GenerationJob(
        api="responses",
        messages=tuple(messages),
        tools=tuple(tools) if tool_choice.mode != "none" else (),
        tool_choice=tool_choice,
        tool_grammars=tuple(grammars) if tool_choice.mode != "none" else (),
        parallel_tool_calls=True if parallel is None else parallel,
        max_tool_calls=max_tool_calls,
        max_tokens=max_output,
        sampling=sampling,
        enable_thinking=enable,
        reasoning_effort=effort,
        preserve_thinking=preserve,
        template_kwargs=kwargs,
        output_format=output_format,
        continue_final=False,
    )
    echo = {
        "instructions": instructions, "metadata": metadata or {},
        "tools": get_list(body, "tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": True if parallel is None else parallel,
        "temperature": sampling.temperature, "top_p": sampling.top_p, "max_output_tokens": max_output,
        "max_tool_calls": max_tool_calls, "previous_response_id": previous_id,
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "text": {"format": text.get("format") or {"type": "text"},
                 "verbosity": verbosity or "medium"},
        "store": True if store_flag is None else store_flag,
        "truncation": "disabled", "background": False, "service_tier": "default",
        "user": body.get("user") if isinstance(body.get("user"), str) else None,
    }
    options = ResponsesOptions(
        stream=bool(get_bool(body, "stream")), store=echo["store"], echo=echo,
        custom_tools=frozenset(toolset.custom), namespaces=toolset.namespaces,
        tool_searches=frozenset(toolset.searches),
        include_encrypted_reasoning="reasoning.encrypted_content" in include, items=items)
    return job, options


def _declared_tools(tools: list, items: list, history_len: int) -> list[tuple[str, object]]:
    """(where, tool) for every declared tool: `tools`, then the tools of `additional_tools`
    and `tool_search_output` input items in input order."""
    declared = [(f"tools[{index}]", tool) for index, tool in enumerate(tools)]
    for number, item in enumerate(items):
        if isinstance(item, dict) and item.get("type") in ("additional_tools",
                                                           "tool_search_output"):
            where = _item_where(number, history_len)
            group = get_list(item, "tools", f"{where}.tools") or []
            declared += [(f"{where}.tools[{index}]", tool) for index, tool in enumerate(group)]
    return declared


@dataclass
class _ToolSet:
    """The request's tools as the model sees them, and what the encoder needs to answer.

    tools: model-facing function declarations. custom: names of custom tools. namespaces:
    model-facing name -> (namespace, name). builtins: built-in tool types (never shown).
    grammars: custom tools' input grammars. searches: names of client tool_search tools."""

    tools: list = field(default_factory=list)
    custom: set = field(default_factory=set)
    namespaces: dict = field(default_factory=dict)
    builtins: set = field(default_factory=set)
    grammars: list = field(default_factory=list)
    searches: set = field(default_factory=set)


def _tools(declared: list[tuple[str, object]], *, check: bool = True) -> _ToolSet:
    """The tool set of `declared` (where, tool) pairs; custom tool grammars are validated when
    `check` (constrained decoding exists)."""
    found = _ToolSet()
    tools = found.tools

    def add(tool: dict, where: str, namespace: Optional[str] = None) -> None:
        kind = tool.get("type", "function")
        client_search = kind == TOOL_SEARCH and tool.get("execution") == "client"
        if not client_search and (kind in BUILTIN_TOOLS or (isinstance(kind, str) and
                                  kind.startswith(("web_search", "computer_use",
                                                   "file_search")))):
            found.builtins.add(kind)
            return
        # A client tool_search has no name on the wire: the model calls it by its type.
        name = TOOL_SEARCH if client_search else get_str(tool, "name", f"{where}.name",
                                                         required=True)
        description = get_str(tool, "description", f"{where}.description")
        if kind == "namespace":
            if namespace is not None:
                raise invalid(f"{where}.type", "namespaces cannot nest")
            inner = get_list(tool, "tools", f"{where}.tools") or []
            for number, item in enumerate(inner):
                if not isinstance(item, dict):
                    raise invalid(f"{where}.tools[{number}]", "must be an object")
                add(item, f"{where}.tools[{number}]", name)
            return
        public = f"{namespace}.{name}" if namespace else name
        declared: dict = {"name": public}
        if description is not None:
            declared["description"] = description
        grammar = None
        if kind == "function" or client_search:
            parameters = get_dict(tool, "parameters", f"{where}.parameters")
            if parameters is None:
                parameters = TOOL_SEARCH_PARAMETERS if client_search else {
                    "type": "object", "properties": {}}
            declared["parameters"] = parameters
            if get_bool(tool, "strict", f"{where}.strict"):
                declared["strict"] = True
        elif kind == "custom":
            fmt = get_dict(tool, "format", f"{where}.format") or {"type": "text"}
            if fmt.get("type") not in ("text", "grammar"):
                raise unsupported(f"{where}.format.type")
            hint = ""
            if fmt.get("type") == "grammar":
                grammar = _grammar_format(fmt, f"{where}.format", public, check)
                hint = (f"\n\nThe input must match this {grammar.syntax} grammar:\n"
                        f"{grammar.definition}")
            declared["description"] = (description or "") + hint
            declared["parameters"] = {"type": "object", "properties": {
                "input": {"type": "string", "description": "the raw tool input"}},
                "required": ["input"]}
        else:
            raise unsupported(f"{where}.type", f"tools of type {kind!r} are not supported")
        existing = next((t["function"] for t in tools if t["function"]["name"] == public), None)
        if existing is not None:
            # The same tool again (a deferred tool loaded by tool_search, a group resent in
            # `additional_tools`) is one tool; two different ones under one name are an error.
            if existing == declared:
                return
            raise invalid(f"{where}.name", f"duplicate tool name {public!r}")
        if namespace:
            found.namespaces[public] = (namespace, name)
        if client_search:
            found.searches.add(public)
        if kind == "custom":
            found.custom.add(public)
        if grammar is not None:
            found.grammars.append(grammar)
        tools.append({"type": "function", "function": declared})

    for where, tool in declared:
        if not isinstance(tool, dict):
            raise invalid(where, "must be an object")
        add(tool, where)
    return found


def _grammar_format(fmt: dict, where: str, name: str, check: bool) -> ToolGrammar:
    """A custom tool's `{"type": "grammar", "syntax", "definition"}` format, checked."""
    syntax = get_str(fmt, "syntax", f"{where}.syntax", required=True)
    if syntax not in ("lark", "regex"):
        raise unsupported(f"{where}.syntax", f"grammar syntax {syntax!r} is not supported "
                                             "(lark, regex)")
    definition = get_str(fmt, "definition", f"{where}.definition", required=True)
    if check:
        problem = _grammar_problem(syntax, definition)
        if problem is not None:
            raise invalid(f"{where}.definition", f"custom tool {name!r}: {problem}",
                          "invalid_constraint")
    return ToolGrammar(name, syntax, definition)


@functools.lru_cache(maxsize=64)
def _grammar_problem(syntax: str, definition: str) -> Optional[str]:
    """What is wrong with a custom tool grammar, or None. Cached: agents send the same tools
    with every request."""
    from runtime.text.constraints import ConstraintError
    from runtime.text.constraints_tools import check_value_grammar, value_grammar_spec

    try:
        check_value_grammar(value_grammar_spec(syntax, definition))
    except ConstraintError as exc:
        return str(exc)
    return None


def _tool_choice(raw, tools: list[dict], builtins: set) -> ToolChoice:
    mode = openai_tool_choice_mode(raw, bool(tools), "function tool")
    if mode is not None:
        return mode
    names = {tool["function"]["name"] for tool in tools}
    kind = raw.get("type")
    if kind in ("function", "custom"):
        name = get_str(raw, "name", "tool_choice.name", required=True)
        if name not in names:
            raise invalid("tool_choice.name", f"no tool named {name!r} in tools")
        return ToolChoice("named", name)
    if kind in builtins or kind in BUILTIN_TOOLS:
        raise unsupported("tool_choice.type", f"built-in tool {kind!r} cannot be used here")
    raise unsupported("tool_choice.type", f"tool_choice of type {kind!r} is not supported")


def _text_format(raw: Optional[dict]) -> Optional[OutputFormat]:
    if raw is None:
        return None
    kind = raw.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputFormat("json_object")
    if kind == "json_schema":
        schema = get_dict(raw, "schema", "text.format.schema", required=True)
        return OutputFormat("json_schema", schema, get_str(raw, "name", "text.format.name"),
                            bool(get_bool(raw, "strict", "text.format.strict")))
    raise unsupported("text.format.type", f"text format {kind!r} is not supported")


def _messages(items: list, history_len: int, instructions: Optional[str]) -> list[dict]:
    messages: list[dict] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    assistant: Optional[dict] = None  # the open assistant turn that calls and reasoning join

    def open_assistant() -> dict:
        nonlocal assistant
        if assistant is None:
            assistant = {"role": "assistant", "content": ""}
            messages.append(assistant)
        return assistant

    for number, item in enumerate(items):
        where = _item_where(number, history_len)
        if not isinstance(item, dict):
            raise invalid(where, "must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = get_str(item, "role", f"{where}.role", required=True)
            if role == "user":
                text = content_with_images(item.get("content"), f"{where}.content",
                                           responses_image, allowed=TEXT_PARTS)
            else:
                text = text_of_parts(item.get("content"), f"{where}.content",
                                     allowed=TEXT_PARTS)
            if role == "assistant":
                turn = open_assistant()
                if turn["content"] or turn.get("tool_calls"):
                    assistant = None
                    turn = open_assistant()
                turn["content"] = text
            elif role in ("user", "system", "developer"):
                assistant = None
                messages.append({"role": "user" if role == "user" else "system",
                                 "content": text})
            else:
                raise invalid(f"{where}.role", f"unknown role {role!r}")
        elif kind == "reasoning":
            text = _reasoning_text(item, where)
            turn = open_assistant()
            if turn["content"] or turn.get("tool_calls"):
                assistant = None
                turn = open_assistant()
            if text:
                turn["reasoning_content"] = turn.get("reasoning_content", "") + text
        elif kind in ("function_call", "custom_tool_call"):
            name = get_str(item, "name", f"{where}.name", required=True)
            namespace = get_str(item, "namespace", f"{where}.namespace")
            if namespace:
                name = f"{namespace}.{name}"
            call_id = get_str(item, "call_id", f"{where}.call_id", required=True)
            if kind == "function_call":
                arguments = item.get("arguments", "{}")
                if not isinstance(arguments, str):
                    raise invalid(f"{where}.arguments", "must be a JSON string")
                arguments = parse_arguments(arguments)
            else:
                value = item.get("input", "")
                if not isinstance(value, str):
                    raise invalid(f"{where}.input", "must be a string")
                arguments = {"input": value}
            turn = open_assistant()
            turn.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function",
                 "function": {"name": name, "arguments": arguments}})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            assistant = None
            call_id = get_str(item, "call_id", f"{where}.call_id", required=True)
            output = item.get("output", "")
            # Images in a tool result: passed with vision on, a short note with it off.
            text = content_with_images(output, f"{where}.output", responses_image,
                                       allowed=TEXT_PARTS)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "tool_search_call":
            call_id = get_str(item, "call_id", f"{where}.call_id") or get_str(
                item, "id", f"{where}.id", required=True)
            arguments = item.get("arguments", {})
            turn = open_assistant()
            turn.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function",
                 "function": {"name": TOOL_SEARCH, "arguments": parse_arguments(arguments)}})
        elif kind == "tool_search_output":
            # Its tools joined the request's tools (_declared_tools); the model is told which.
            assistant = None
            call_id = get_str(item, "call_id", f"{where}.call_id") or ""
            names = [tool.get("name") or tool.get("type") for tool in item.get("tools") or []
                     if isinstance(tool, dict)]
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": orjson.dumps({"loaded_tools": names}).decode()})
        elif kind == "additional_tools":
            continue  # its tools joined the request's tools (_declared_tools)
        elif kind == "item_reference":
            raise unsupported(f"{where}.type", "item references are not supported; send the "
                                               "item itself")
        else:
            raise unsupported(f"{where}.type", f"input items of type {kind!r} are not "
                                               "supported")
    return messages


def _item_where(number: int, history_len: int) -> str:
    """How an error names input item `number` (stored history comes first)."""
    if number >= history_len:
        return f"input[{number - history_len}]"
    return f"previous_response_id (stored item {number})"


def _reasoning_text(item: dict, where: str) -> str:
    content = item.get("content")
    if isinstance(content, list) and content:
        return text_of_parts(content, f"{where}.content", allowed=TEXT_PARTS)
    blob = item.get("encrypted_content")
    if isinstance(blob, str):
        decoded = decode_reasoning(blob)
        if decoded is not None:
            return decoded
    return ""  # a summary is not what the model generated; it is not fed back
