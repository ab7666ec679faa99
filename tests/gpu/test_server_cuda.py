"""`infernix-serve` on the GPU backend: the tiny dense model (512-token vocabulary) behind the
real HTTP server, driven by the official SDKs.

Four concurrent streamed chat requests decode in one batch (device sampling, steps computed
ahead while the batch is steady); each must finish with consistent usage, and the same seeds
asked again, one at a time, must give the same texts (batched == alone, and the counter-based
draws do not depend on batching). An Anthropic Messages stream must end with `message_stop`.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import Clients, run_concurrently
from tests.e2e.model_serving import serve_model, stop_model

pytestmark = pytest.mark.gpu

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def cuda_server(tiny_dense_path):
    from runtime.config import parse_settings

    server = serve_model(parse_settings("serve", [str(tiny_dense_path), "--device", "cuda", "--max-context", "512",
                                                  "--max-concurrency", "4", "--max-new", "24"]))
    yield server
    stop_model(server)


def _chat(client, seed):
    with client.chat.completions.stream(model="tiny", messages=[{"role": "user", "content": f"count {seed}"}],
                                        max_tokens=24, seed=seed, temperature=1.0,
                                        stream_options={"include_usage": True}, extra_body=NO_THINKING) as stream:
        for _ in stream:
            pass
        return stream.current_completion_snapshot


def test_concurrent_streams_then_the_same_seeds_alone(cuda_server):
    client = Clients.openai(cuda_server)
    results = run_concurrently(lambda seed: _chat(client, seed), 4, timeout=120)
    assert len(results) == 4
    for seed, snapshot in enumerate(results):
        usage = snapshot.usage
        assert 0 < usage.completion_tokens <= 24 and usage.prompt_tokens > 3, seed
        assert snapshot.choices[0].finish_reason in ("length", "stop")
        alone = _chat(client, seed)
        assert alone.choices[0].message.content == snapshot.choices[0].message.content, seed
        assert alone.usage.completion_tokens == usage.completion_tokens


def test_anthropic_messages_stream(cuda_server):
    client = Clients.anthropic(cuda_server)
    with client.messages.stream(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                                thinking={"type": "disabled"}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.stop_reason in ("max_tokens", "end_turn") and 0 < final.usage.output_tokens <= 8
