"""Multi-turn conversations through the three APIs on the CPU model server reuse the previous
turn from the prefix cache (reported as cached tokens, logged with the resume path) and give
the same text as a server without the cache."""

from __future__ import annotations

import json

import pytest

from tests.e2e.model_serving import cpu_settings, serve_model, stop_model

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
# Each API's conversation has its own system text: the model server (and its cache) is shared
# by the whole session.
SYSTEM = ("You are a careful assistant. Answer briefly, cite the file names you used and never "
          "invent an API. " * 6)


def system(api: str) -> str:
    return f"[{api}] {SYSTEM}"


@pytest.fixture(scope="module")
def cold_server(tiny_real_vocab_path):
    server = serve_model(cpu_settings(tiny_real_vocab_path, "--max-context", "1024", "--max-concurrency", "2",
                                      "--max-new", "8", "--no-prefix-cache"))
    yield server
    stop_model(server)


def chat_turns(client, user_texts):
    messages = [{"role": "system", "content": system("chat")}]
    replies, usages = [], []
    for text in user_texts:
        messages.append({"role": "user", "content": text})
        done = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                              seed=11, extra_body=NO_THINKING)
        reply = done.choices[0].message.content
        messages.append({"role": "assistant", "content": reply})
        replies.append(reply)
        usages.append(done.usage)
    return replies, usages


def responses_turns(client, user_texts):
    items, replies, usages = [], [], []
    for text in user_texts:
        items.append({"role": "user", "content": text})
        done = client.responses.create(model="tiny", instructions=system("responses"), input=items,
                                       max_output_tokens=6, extra_body={"seed": 11, **NO_THINKING})
        replies.append(done.output_text)
        items.append({"role": "assistant", "content": done.output_text})
        usages.append(done.usage)
    return replies, usages


def messages_turns(client, user_texts):
    messages, replies, usages = [], [], []
    for text in user_texts:
        messages.append({"role": "user", "content": text})
        done = client.messages.create(model="tiny", system=system("messages"), messages=messages,
                                      max_tokens=6, thinking={"type": "disabled"},
                                      extra_body={"temperature": 0})
        reply = "".join(block.text for block in done.content if block.type == "text")
        messages.append({"role": "assistant", "content": reply or "ok"})
        replies.append(reply)
        usages.append(done.usage)
    return replies, usages


OPENER = 7       # <|im_start|> assistant \n <think> \n\n </think> \n\n


def resume_point(previous_prompt_tokens: int) -> int:
    """Where the next turn resumes: the previous opener's start rounded down to its 64-token
    block (docs/prefix_cache.md, Exactness)."""
    return (previous_prompt_tokens - OPENER) // 64 * 64
TURNS = ["Where is the config parsed?", "And where are the defaults?", "Show the test."]


def test_chat_turns_reuse_the_previous_turn(model_server, cold_server, clients, model_log):
    replies, usages = chat_turns(clients.openai(model_server), TURNS)
    cold_replies, cold_usages = chat_turns(clients.openai(cold_server), TURNS)
    assert replies == cold_replies
    assert [u.prompt_tokens for u in usages] == [u.prompt_tokens for u in cold_usages]
    assert all(u.prompt_tokens_details.cached_tokens == 0 for u in cold_usages)
    # The system prompt is fresh on turn 1 (its text is unique to this module). The history
    # renders an assistant turn without the generation opener's empty think block, so a turn
    # diverges where the previous turn's opener began (a snapshot hint, OPENER tokens before
    # the previous prompt's end); it resumes at the start of that hint's block.
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    for previous, usage in zip(usages, usages[1:]):
        assert usage.prompt_tokens_details.cached_tokens == resume_point(previous.prompt_tokens)
    lines = [json.loads(line) for line in model_log.read_text().splitlines()]
    done = [line for line in lines if line.get("event") == "request_done"
            and line.get("cached_tokens") == usages[-1].prompt_tokens_details.cached_tokens]
    assert done and done[-1]["resume_path"] == "prefix"
    assert done[-1]["prefilled_tokens"] == usages[-1].prompt_tokens - done[-1]["cached_tokens"]


def test_responses_turns_reuse_the_previous_turn(model_server, cold_server, clients):
    replies, usages = responses_turns(clients.openai(model_server), TURNS)
    cold_replies, _ = responses_turns(clients.openai(cold_server), TURNS)
    assert replies == cold_replies
    assert usages[0].input_tokens_details.cached_tokens == 0
    for previous, usage in zip(usages, usages[1:]):
        assert usage.input_tokens_details.cached_tokens == resume_point(previous.input_tokens)


def test_messages_turns_reuse_the_previous_turn(model_server, cold_server, clients):
    replies, usages = messages_turns(clients.anthropic(model_server), TURNS)
    cold_replies, _ = messages_turns(clients.anthropic(cold_server), TURNS)
    assert replies == cold_replies
    assert usages[0].cache_read_input_tokens == 0
    for previous, usage in zip(usages, usages[1:]):
        # Anthropic reports input_tokens without the cached part.
        previous_total = previous.input_tokens + previous.cache_read_input_tokens
        assert usage.cache_read_input_tokens == resume_point(previous_total)
        assert usage.input_tokens > 0


def test_metrics_count_hits_and_tier_bytes(model_server, clients):
    import httpx

    chat_turns(clients.openai(model_server), ["One more question.", "And another."])
    text = httpx.get(model_server.base_url + "/metrics", timeout=10).text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("infernix_prefix_cache_")}
    assert values["infernix_prefix_cache_hits_total"] >= 1
    assert values["infernix_prefix_cache_hit_tokens_total"] > 0
    assert values["infernix_prefix_cache_snapshots_total"] >= 2
    # Snapshots sit on block boundaries (no partial page to copy out) in the 8 device slots.
    assert 1 <= values["infernix_prefix_cache_device_snapshots"] <= 8
    assert values["infernix_prefix_cache_cached_pages"] > 0
