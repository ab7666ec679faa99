"""The streaming Qwen output parser on the real vocabulary: reasoning / content / tool calls and
every edge case of research/protocols.md 4.4.

Model output is written as text and encoded with special-token parsing, so `<think>`,
`</think>`, `<tool_call>`, `</tool_call>` and `<|im_end|>` become their special ids exactly as
the model emits them. Each case is parsed token by token, all at once and in random chunks; the
results must agree, and every call's streamed arguments must be one valid JSON object.
"""

from __future__ import annotations

import json

from parser_harness import TOOLS, calls, parse, xml_call
from runtime.text.events import ContentDelta
from runtime.text.parser import QwenOutputParser, prompt_ends_in_reasoning
from runtime.text.stops import StopConditions, StopHit


# --- reasoning and content -----------------------------------------------------------------

def test_reasoning_then_answer(qwen_tokenizer):
    acc, parser = parse(qwen_tokenizer, "Let me think.\nStep 2.\n</think>\n\nThe answer is 4."
                        "<|im_end|>", starts_in_reasoning=True)
    assert acc.reasoning == "Let me think.\nStep 2."
    assert acc.content == "The answer is 4."
    assert acc.tool_calls == []
    assert parser.stopped.kind == "eos" and parser.stopped.value == 248046


def test_prompt_ends_in_reasoning(qwen_tokenizer):
    tk = qwen_tokenizer
    assert prompt_ends_in_reasoning(tk.encode("<|im_start|>assistant\n<think>\n"), tk)
    assert not prompt_ends_in_reasoning(
        tk.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n"), tk)
    assert not prompt_ends_in_reasoning(tk.encode("<|im_start|>assistant\n"), tk)


def test_plain_answer_without_thinking(qwen_tokenizer):
    acc, _ = parse(qwen_tokenizer, "Hello 世界 😀!\n<|im_end|>")
    assert acc.reasoning == "" and acc.content == "Hello 世界 😀!\n"


def test_reasoning_only_answer(qwen_tokenizer):
    acc, parser = parse(qwen_tokenizer, "Thinking until the budget runs out\n<|im_end|>",
                        starts_in_reasoning=True)
    assert acc.reasoning == "Thinking until the budget runs out"
    assert acc.content == "" and acc.tool_calls == []
    assert parser.stopped.kind == "eos"
    acc, parser = parse(qwen_tokenizer, "cut by the limit", starts_in_reasoning=True,
                        truncated=True)
    assert acc.reasoning == "cut by the limit" and parser.stopped is None


def test_think_token_in_content_opens_reasoning(qwen_tokenizer):
    acc, _ = parse(qwen_tokenizer, "<think>\nhidden\n</think>\n\nshown")
    assert acc.reasoning == "hidden" and acc.content == "shown"


def test_markers_spelled_in_text_are_text(qwen_tokenizer):
    tk = qwen_tokenizer
    spelled = "Use </think> and <tool_call> tags; <parameter=x> is not a call </function>."
    ids = tk.encode("plan\n</think>\n\n") + tk.encode(spelled, parse_special=False)
    acc, _ = parse(tk, "", ids=ids, starts_in_reasoning=True)
    assert acc.content == spelled and acc.tool_calls == []
    ids = tk.encode("reason about </think> the tag", parse_special=False)
    acc, _ = parse(tk, "", ids=ids, starts_in_reasoning=True)
    assert acc.reasoning == "reason about </think> the tag" and acc.content == ""


def test_split_utf8_is_never_emitted_half(qwen_tokenizer):
    tk = qwen_tokenizer
    ids = tk.encode("日本語 🎉 ok", parse_special=False)
    parser = QwenOutputParser(tk, starts_in_reasoning=False)
    texts = [e.text for i in ids for e in parser.feed([i])]
    assert "\ufffd" not in "".join(texts)
    assert "".join(texts) == "日本語 🎉 ok"
    # A cut inside a character flushes as U+FFFD at the end.
    emoji = tk.encode("🎉", parse_special=False)
    assert len(emoji) > 1
    parser = QwenOutputParser(tk, starts_in_reasoning=False)
    assert parser.feed(emoji[:1]) == []
    assert parser.finish(truncated=True) == [ContentDelta("\ufffd")]


# --- markup quoted in prose or code ------------------------------------------------------

def test_call_quoted_in_a_markdown_fence_is_text(qwen_tokenizer):
    quoted = ("```xml\n<tool_call>\n<function=get_weather>\n<parameter=city>\nX\n</parameter>\n"
              "</function>\n</tool_call>\n```")
    text = "The format is:\n\n" + quoted + "\n\nDone.<|im_end|>"
    acc, _ = parse(qwen_tokenizer, text)
    assert acc.tool_calls == []
    assert acc.content == "The format is:\n\n" + quoted + "\n\nDone."
    # After the fence closes, a real call is a call.
    acc, _ = parse(qwen_tokenizer, "```\ncode\n```\n\n" + xml_call("get_weather", city="Y"))
    assert calls(acc) == [("get_weather", {"city": "Y"})] and acc.content == "```\ncode\n```"


def test_call_quoted_in_inline_code_is_text(qwen_tokenizer):
    text = "Write `<tool_call>` to start a call.<|im_end|>"
    acc, _ = parse(qwen_tokenizer, text)
    assert acc.tool_calls == [] and acc.content == "Write `<tool_call>` to start a call."


def test_a_stray_backtick_does_not_quote_the_next_line(qwen_tokenizer):
    text = "Run the ` command.\n\n" + xml_call("get_weather", city="Z") + "<|im_end|>"
    acc, _ = parse(qwen_tokenizer, text)
    assert calls(acc) == [("get_weather", {"city": "Z"})]
    assert acc.content == "Run the ` command."


# --- calls inside unclosed thinking ------------------------------------------------------

def test_call_stranded_in_unclosed_thinking_is_recovered(qwen_tokenizer):
    text = "I should look it up.\n\n" + xml_call("get_weather", city="Kyiv") + "<|im_end|>"
    acc, _ = parse(qwen_tokenizer, text, starts_in_reasoning=True)
    assert acc.reasoning == "I should look it up."
    assert calls(acc) == [("get_weather", {"city": "Kyiv"})]
    assert acc.content == ""


def test_call_drafted_inside_thinking_stays_reasoning(qwen_tokenizer):
    draft = xml_call("get_weather", city="Kyiv")
    text = "Maybe:\n" + draft + "\nNo, answer directly.\n</think>\n\nIt is sunny.<|im_end|>"
    acc, _ = parse(qwen_tokenizer, text, starts_in_reasoning=True)
    assert acc.tool_calls == []
    assert acc.reasoning == "Maybe:\n" + draft + "\nNo, answer directly."
    assert acc.content == "It is sunny."


def test_stranded_call_cut_by_the_limit(qwen_tokenizer):
    text = "Look up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nKy"
    acc, _ = parse(qwen_tokenizer, text, starts_in_reasoning=True, truncated=True)
    assert acc.reasoning == "Look up."
    assert calls(acc) == [("get_weather", {"city": "Ky"})]


# --- stops ---------------------------------------------------------------------------------

def test_stop_string_is_never_leaked(qwen_tokenizer):
    tk = qwen_tokenizer
    stop = StopConditions.build(["STOP HERE"])
    acc, parser = parse(tk, "Answer text STOP HERE and more", stop=stop)
    # The text before the match, exactly (its trailing space included).
    assert acc.content == "Answer text " and parser.stopped.kind == "stop_string"
    assert parser.stopped.value == "STOP HERE"
    # Held back while it could still match, released when it cannot.
    parser = QwenOutputParser(tk, starts_in_reasoning=False, stop=stop)
    out = parser.feed(tk.encode("Go STOP"))
    assert "".join(e.text for e in out) == "Go"
    out = parser.feed(tk.encode(" THERE"))
    assert "".join(e.text for e in out) == " STOP THERE"
    assert parser.stopped is None


def test_stop_strings_skip_reasoning_and_reasoning_stops_skip_the_answer(qwen_tokenizer):
    stop = StopConditions.build(stop_strings=["END"], reasoning_stop_strings=["LOOP"])
    acc, parser = parse(qwen_tokenizer, "think END think\n</think>\n\nanswer LOOP END tail",
                        starts_in_reasoning=True, stop=stop)
    assert acc.reasoning == "think END think" and acc.content == "answer LOOP "
    assert parser.stopped.kind == "stop_string"
    acc, parser = parse(qwen_tokenizer, "think LOOP more", starts_in_reasoning=True, stop=stop)
    assert acc.reasoning == "think " and parser.stopped == StopHit("reasoning_stop", "LOOP")


def test_stop_token_ids_and_ignoring_later_ids(qwen_tokenizer):
    tk = qwen_tokenizer
    dot = tk.encode(".")[0]
    stop = StopConditions.build(stop_token_ids=[dot])
    parser = QwenOutputParser(tk, starts_in_reasoning=False, stop=stop)
    events = parser.feed(tk.encode("One. Two."))
    assert "".join(e.text for e in events) == "One"
    assert parser.stopped.kind == "stop_token" and parser.stopped.value == dot
    assert parser.feed(tk.encode("more")) == [] and parser.finish(False) == []


def test_stop_strings_never_fire_inside_a_call(qwen_tokenizer):
    # A server `--stop "="` used to cut `<function=` into the text "<tool_call>\n<function=g"
    # with finish "stop"; inside a call (markup and values) stop strings do not apply.
    stop = StopConditions.build(["=", "<<END>>"])
    text = ("<tool_call>\n<function=write_file>\n<parameter=path>\na.txt\n</parameter>\n"
            "<parameter=content>\nabc<<END>>def\n</parameter>\n</function>\n</tool_call>"
            "Done: x=1 more")
    acc, parser = parse(qwen_tokenizer, text, stop=stop)
    assert calls(acc) == [("write_file", {"path": "a.txt", "content": "abc<<END>>def"})]
    assert acc.content == "Done: x"  # the answer's content still stops at the first "="
    assert parser.stopped == StopHit("stop_string", "=")


def test_accumulated_output_round_trips_through_the_template(qwen_tokenizer):
    from runtime.text.chat import builtin_template_source, render_chat

    template = builtin_template_source("qwen3_5")
    history = [{"role": "user", "content": "Weather in Oslo?"}]
    prompt = render_chat(template, history, tools=TOOLS)
    output = ("The user wants weather.\n</think>\n\nChecking.\n\n"
              + xml_call("get_weather", city="Oslo", days="2") + "<|im_end|>")
    acc, _ = parse(qwen_tokenizer, output, starts_in_reasoning=True)
    message = acc.as_message()
    assert message["reasoning_content"] == "The user wants weather."
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo",
                                                                             "days": 2}
    # Re-rendering the history reproduces exactly what the model generated (prefix caching).
    again = render_chat(template, history + [message], tools=TOOLS, add_generation_prompt=False)
    assert again == prompt + output + "\n"
