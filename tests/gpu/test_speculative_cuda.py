"""N-gram speculative decoding on `CudaRunner`: the same token ids as plain decoding, on a GPU.

Each round verifies [x_n, d_1 .. d_k] as one verification row (`CudaRunner.step`: the decode
GEMV over every position, the GDN step per position along the snapshot chain), then commits the
state after the last accepted position. Every verification position equals a decode step bit
for bit (tests/gpu/test_gpu_runner_step.py), so greedy and seeded output must equal plain
decoding exactly, at the tiny model and at a 4-layer model of the Qwen3.6-27B shapes (synthetic
weights: near-ties everywhere). Random weights do not copy the prompt, so a longer n-gram
(a repeated phrase) is never continued; with `ngram_min_match=1` any output token seen before
proposes a draft, and each prompt ends with the plain output of its first part, which makes
such repeats likely at the 27B vocabulary too. The test checks that the plain output itself
offered matches (else the design failed, not the engine). Random weights reject most drafts,
which exercises the commit of every draft position.

The engine runs n-gram speculation twice: sampling on the host, where every match is verified at
once, and on the device, where plain steps are computed ahead while nothing matches and a match
is verified only if it still holds a token later (`StepExecutor.run`): the one-token matches of
random weights rarely do at the 27B vocabulary, so rounds are asked of the host run only.
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.engine.api import EngineRequest, SamplingParams
from runtime.engine.speculative import SpeculativeConfig

from .engine_runs import run_engine, small_runner
from .test_cuda_runner import tiny_path  # noqa: F401 - the module fixture

pytestmark = pytest.mark.gpu

NGRAM = SpeculativeConfig(ngram_draft_tokens=5, ngram_min_match=1)
SLOTS = 4 * (1 + NGRAM.max_drafts + 1)


@pytest.fixture(scope="module", params=["tiny", "27b-4-layers"])
def runner(request, tiny_path, device, library):  # noqa: F811 - the fixture imported above
    r = small_runner(request.param, tiny_path, device, library, num_pages=64, num_slots=SLOTS, max_batch=4,
                     max_context=1024, prefill_chunk=128)
    yield r
    r.close()


def _requests(vocab: int, tails: list[list[int]] | None = None) -> list[EngineRequest]:
    rng = np.random.default_rng(4)
    out = []
    for i in range(4):
        phrase = [int(t) for t in rng.integers(0, vocab, 9)]
        prompt = phrase * 6 + [int(t) for t in rng.integers(0, vocab, 20 + 7 * i)] + phrase[:4]
        sampling = SamplingParams(greedy=True) if i % 2 == 0 else SamplingParams(temperature=0.8, top_p=0.9,
                                                                               seed=70 + i)
        out.append(EngineRequest(f"s{i}", tuple(prompt + (tails[i] if tails else [])), sampling, 40))
    return out


def _repeats(prompt: tuple, output: list[int]) -> int:
    """Output tokens after the first that occurred earlier in prompt + output: the steps where
    an n-gram index with min_match 1 proposes drafts."""
    seen = set(prompt) | {output[0]}
    count = 0
    for token in output[1:]:
        count += token in seen
        seen.add(token)
    return count


def test_ngram_speculation_equals_plain_decoding(runner):
    common = dict(num_lanes=4, max_context=1024, prefill_chunk=128)
    first, _ = run_engine(runner, _requests(runner.vocab_size), **common)
    requests = _requests(runner.vocab_size, tails=first)
    plain, _ = run_engine(runner, requests, **common)
    assert [len(t) for t in plain] == [40] * 4
    offered = sum(_repeats(r.prompt_ids, out) for r, out in zip(requests, plain))
    assert offered > 0, "the plain output repeats no earlier token: these prompts offer no n-gram match"
    for device_sampling in (False, True):
        speculative, counters = run_engine(runner, requests, speculative=NGRAM, device_sampling=device_sampling,
                                           **common)
        assert speculative == plain, f"device sampling {device_sampling}"
        if not device_sampling:
            assert counters["spec_rounds"] > 0 and counters["spec_drafted_tokens"] > 0
