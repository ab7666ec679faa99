"""The MTP head on `CudaRunner` against `NumpyRunner`'s, and `--spec mtp` on the GPU equal to plain decoding.

Tolerance. The GPU runs the head in BF16 (activations rounded to 8 significant bits after every
kernel, fp32 inside), on hidden rows that the BF16 main model produced; the reference is fp32
throughout on the same BF16-valued weights. A BF16 rounding is a relative error of at most 2^-9;
the head adds about a dozen of them (embedding and hidden norms, fc, norm, q/k/v, attention, o,
norm, MLP, final norm, lm_head) on top of the hidden rows' own error, which the main model's logits
at the same position measure in the same run. So the head's logits must agree to
`REL_TOL` = 4 % of their largest magnitude (about 20 worst-case roundings), and never worse than
3x the main model's own relative error there (a MoE model's router can flip an expert under BF16
rounding: its main logits then differ by 20-30 %). Greedy ids are compared only where the reference's
top-2 margin exceeds twice that bound (closer ones may flip under BF16 rounding); at least one
such draft must be checked over the prompts so the comparison is not vacuous.
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.engine.api import EngineRequest, SamplingParams
from runtime.engine.speculative import SpeculativeConfig
from runtime.model.runner import DecodeItem, MtpRow, PrefillChunk

from .engine_runs import run_engine, small_runner
from .test_cuda_runner import tiny_path  # noqa: F401 - the module fixture

pytestmark = pytest.mark.gpu

REL_TOL = 0.04
DRAFTS = 4


@pytest.fixture(scope="module")
def runners(tiny_path, device, library):  # noqa: F811 - the fixture imported above
    from runtime.model.gpu.runner import CudaRunner
    from runtime.model.numpy_runner import NumpyRunner

    shape = dict(num_pages=48, num_slots=8)
    cuda = CudaRunner.from_artifact(tiny_path, mtp=True, device=device, library=library, prefill_chunk=128, **shape)
    ref = NumpyRunner.from_artifact(tiny_path, mtp=True, **shape)
    yield cuda, ref
    cuda.close()


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def _reference_chain(ref, slot: int, hidden: np.ndarray, tokens: list[int], pages: list[int], k: int,
                     vocab: int | None = None):
    """NumPy's catch-up over every position, then k greedy drafts chained as `MtpDrafter.draft`
    chains them, each over ids 0..vocab-1 (default all); (drafts, each draft's logits row)."""
    out = ref.mtp_prefill(hidden, tokens, 0, pages)
    logits, h = out.logits[-1:, :vocab], out.hidden[-1:]
    position, drafts, rows = len(tokens), [], []
    for j in range(k):
        if j:
            step = ref.mtp_decode([DecodeItem(slot, drafts[-1], position, pages)], h)
            logits, h = step.logits[:, :vocab], step.hidden
            position += 1
        drafts.append(int(np.argmax(logits[0])))
        rows.append(logits[0])
    return drafts, rows


def _reset(slot: int, *runners) -> None:
    """Clear `slot` on every runner: a prefill from position 0 requires it (`PrefillChunk`), and
    the module's runners carry earlier tests' recurrent states."""
    for runner in runners:
        runner.reset_slot(slot)


def _margin(row: np.ndarray) -> float:
    top = np.sort(row)[-2:]
    return float(top[1] - top[0])


def test_catch_up_logits_and_chained_drafts_match_the_reference(runners):
    cuda, ref = runners
    rng = np.random.default_rng(21)
    checked, report = 0, []
    for n, slot in enumerate(range(8)):  # 8 prompts: a random head's top-2 gap is clear about half the time
        pages = [slot * 4, slot * 4 + 1]
        prompt = rng.integers(0, cuda.vocab_size, 40 + 9 * n).tolist()  # one prefill piece (kept rows <= 128)
        _reset(slot, cuda, ref)
        gpu_main = cuda.prefill(PrefillChunk(slot, prompt, 0, pages))[0]
        ref_out = ref.prefill_with_hidden(PrefillChunk(slot, prompt, 0, pages))
        ref_main = ref_out.logits[-1]
        nxt = int(np.argmax(ref_main))  # both heads catch up on the same tokens
        tokens = prompt[1:] + [nxt]
        main_err = _rel_err(gpu_main, ref_main)
        # One draft: the logits of the last catch-up position stay in the logits buffer (the
        # device sampler only reads them).
        first = cuda.mtp_draft([MtpRow(slot, tokens, 0, pages, 1)])[0]
        gpu_head = cuda.steps.read_logits(1)[0]
        ref_drafts, ref_rows = _reference_chain(ref, slot, ref_out.hidden, tokens, pages, DRAFTS)
        head_err = _rel_err(gpu_head, ref_rows[0])
        report.append(f"prompt {n}: main rel err {main_err:.4f}, head rel err {head_err:.4f}")
        tol = max(REL_TOL, 3 * main_err)
        assert head_err <= tol, "\n".join(report)
        # The head's catch-up is rewritten, not accumulated: drafting again gives the same chain.
        gpu_drafts = cuda.mtp_draft([MtpRow(slot, tokens, 0, pages, DRAFTS)])[0]
        assert gpu_drafts[:1] == first
        scale = np.abs(ref_rows[0]).max()
        for j in range(DRAFTS):
            if gpu_drafts[:j] != ref_drafts[:j]:
                break  # the chains read different drafts from here on
            if _margin(ref_rows[j]) > 2 * tol * scale:
                assert gpu_drafts[j] == ref_drafts[j], (
                    f"prompt {n} draft {j}: GPU {gpu_drafts} reference {ref_drafts}, margin "
                    f"{_margin(ref_rows[j]):.4f} of scale {scale:.4f}\n" + "\n".join(report))
                checked += 1
    print("\n".join(report))
    assert checked >= 1, "no draft had a clear top-2 margin: the comparison checked nothing\n" + "\n".join(report)


def test_graphs_and_eager_launches_draft_the_same(runners):
    cuda, _ = runners
    slot, pages = 5, [30, 31]
    prompt = np.random.default_rng(5).integers(0, cuda.vocab_size, 50).tolist()
    _reset(slot, cuda)
    cuda.prefill(PrefillChunk(slot, prompt, 0, pages))
    row = MtpRow(slot, prompt[1:] + [7], 0, pages, DRAFTS)
    graphed = cuda.mtp_draft([row])
    graphed_logits = cuda.steps.read_logits(1)
    cuda.steps.cuda_graphs = False
    try:
        eager = cuda.mtp_draft([row])
        eager_logits = cuda.steps.read_logits(1)
    finally:
        cuda.steps.cuda_graphs = True
    assert eager == graphed and np.array_equal(eager_logits, graphed_logits)


def _prefilled_rows(cuda, seed: int, drafts: list[int]) -> list[MtpRow]:
    """One prompt per draft count, prefilled in slots 0.. (pages slot * 4, + 1); their MtpRows."""
    rng = np.random.default_rng(seed)
    rows = []
    for slot, k in enumerate(drafts):
        pages = [slot * 4, slot * 4 + 1]
        prompt = rng.integers(0, cuda.vocab_size, 30 + 11 * slot).tolist()
        _reset(slot, cuda)
        cuda.prefill(PrefillChunk(slot, prompt, 0, pages))
        rows.append(MtpRow(slot, prompt[1:] + [int(rng.integers(0, cuda.vocab_size))], 0, pages, k))
    return rows


@pytest.mark.parametrize("graphs", [True, False], ids=["graph", "eager"])
def test_the_device_chain_drafts_what_the_host_chain_drafts(runners, graphs):
    """Drafts 2..k chained on the device (ids fed from each greedy pick to the next step, one
    graph, one read-back) equal the host-fed chain (each draft read back and uploaded as the next
    step's token) bit for bit: the same launches of the same buckets, only the ids' route differs.
    Rows of 3, 5, 0 and 1 drafts: the rows still drafting shrink from step to step."""
    cuda, _ = runners
    rows = _prefilled_rows(cuda, 31, [3, 5, 0, 1])
    cuda.steps.cuda_graphs = graphs
    chain = cuda._mtp.chain
    assert chain is not None
    try:
        device = cuda.mtp_draft(rows)
        device_logits = cuda.steps.read_logits(1)
        cuda._mtp.chain = None  # the host-fed route (`MtpHead._chain_step`)
        host = cuda.mtp_draft(rows)
        host_logits = cuda.steps.read_logits(1)
    finally:
        cuda._mtp.chain = chain
        cuda.steps.cuda_graphs = True
    assert [len(d) for d in device] == [3, 5, 0, 1]
    assert device == host and np.array_equal(device_logits, host_logits)


@pytest.fixture(scope="module")
def vocab_runners(tiny_path, device, library):  # noqa: F811 - the fixture imported above
    """The tiny model's runners drafting over its first `DRAFT_VOCAB` ids."""
    from runtime.model.gpu.runner import CudaRunner
    from runtime.model.numpy_runner import NumpyRunner

    shape = dict(num_pages=48, num_slots=8, mtp=True, mtp_draft_vocab=DRAFT_VOCAB)
    cuda = CudaRunner.from_artifact(tiny_path, device=device, library=library, prefill_chunk=128, **shape)
    ref = NumpyRunner.from_artifact(tiny_path, **shape)
    yield cuda, ref
    cuda.close()


DRAFT_VOCAB = 256  # half the tiny model's 512 ids (the 256 x 256 GEMM over the lm_head's first rows)


def test_drafts_over_a_draft_vocabulary_match_the_reference(runners, vocab_runners):
    """`mtp_draft_vocab = 256`: the draft logits are the first 256 columns of the whole
    vocabulary's, bit for bit (the same hidden rows, the lm_head's first rows, and a GEMM whose
    per-element reduction does not depend on N); the drafts are the reference's (argmax over
    the first 256 ids) where the reference's top-2 margin is clear (module docstring)."""
    full, _ = runners
    cuda, ref = vocab_runners
    rng = np.random.default_rng(23)
    checked, report = 0, []
    for n, slot in enumerate(range(8)):
        pages = [slot * 4, slot * 4 + 1]
        prompt = rng.integers(0, cuda.vocab_size, 40 + 9 * n).tolist()
        _reset(slot, cuda, full, ref)
        gpu_main = cuda.prefill(PrefillChunk(slot, prompt, 0, pages))[0]
        full.prefill(PrefillChunk(slot, prompt, 0, pages))
        ref_out = ref.prefill_with_hidden(PrefillChunk(slot, prompt, 0, pages))
        main_err = _rel_err(gpu_main, ref_out.logits[-1])
        tokens = prompt[1:] + [int(np.argmax(ref_out.logits[-1]))]
        first = cuda.mtp_draft([MtpRow(slot, tokens, 0, pages, 1)])[0]
        head = cuda.steps.read_logits(1, DRAFT_VOCAB)[0]
        full.mtp_draft([MtpRow(slot, tokens, 0, pages, 1)])
        whole = full.steps.read_logits(1)[0, :DRAFT_VOCAB]
        ref_drafts, rows = _reference_chain(ref, slot, ref_out.hidden, tokens, pages, DRAFTS, DRAFT_VOCAB)
        err = _rel_err(head, rows[0])
        assert np.array_equal(head, whole), (f"prompt {n}: rel err vs the reference: draft-vocabulary head "
                                             f"{err:.4f}, whole head {_rel_err(whole, rows[0]):.4f}")
        report.append(f"prompt {n}: main rel err {main_err:.4f}, head rel err {err:.4f}")
        assert err <= max(REL_TOL, 3 * main_err), "\n".join(report)
        gpu_drafts = cuda.mtp_draft([MtpRow(slot, tokens, 0, pages, DRAFTS)])[0]
        assert gpu_drafts[:1] == first and all(0 <= t < DRAFT_VOCAB for t in gpu_drafts)
        scale = np.abs(rows[0]).max()
        for j in range(DRAFTS):
            if gpu_drafts[:j] != ref_drafts[:j]:
                break
            if _margin(rows[j]) > 2 * max(REL_TOL, 3 * main_err) * scale:
                assert gpu_drafts[j] == ref_drafts[j], f"prompt {n} draft {j}: GPU {gpu_drafts} reference {ref_drafts}"
                checked += 1
    print("\n".join(report))
    assert checked >= 1, "no draft had a clear top-2 margin: the comparison checked nothing\n" + "\n".join(report)


def _requests(vocab: int) -> list[EngineRequest]:
    rng = np.random.default_rng(6)
    out = []
    for i in range(4):
        prompt = tuple(int(t) for t in rng.integers(0, vocab, 30 + 23 * i))
        sampling = SamplingParams(greedy=True) if i % 2 == 0 else SamplingParams(temperature=0.8, top_p=0.9,
                                                                               seed=40 + i)
        out.append(EngineRequest(f"m{i}", prompt, sampling, 40))
    return out


SPECS = {"mtp3": SpeculativeConfig(method="mtp", draft_tokens=3),
         "mtp-auto": SpeculativeConfig(method="mtp", draft_tokens=5, adaptive=True),
         "mtp+ngram": SpeculativeConfig(method="mtp", draft_tokens=2, ngram_draft_tokens=5, ngram_min_match=2)}
LANES = 4
SLOTS = LANES * (1 + 5 + 1)


@pytest.fixture(scope="module", params=["tiny", "27b-4-layers"])
def spec_runner(request, tiny_path, device, library):  # noqa: F811 - the fixture imported above
    r = small_runner(request.param, tiny_path, device, library, num_pages=64, num_slots=SLOTS, max_batch=LANES,
                     max_context=1024, prefill_chunk=128, mtp=True)
    yield r
    r.close()


@pytest.mark.parametrize("spec", list(SPECS))
def test_mtp_speculation_equals_plain_decoding(spec_runner, spec):
    requests = _requests(spec_runner.vocab_size)
    common = dict(num_lanes=LANES, max_context=1024, prefill_chunk=128)
    plain, _ = run_engine(spec_runner, requests, **common)
    speculative, counters = run_engine(spec_runner, requests, speculative=SPECS[spec], **common)
    assert [len(t) for t in plain] == [40] * 4
    assert speculative == plain, f"counters {counters}"
    assert counters["spec_rounds"] > 0 and counters["spec_drafted_tokens"] > 0, counters
    print(spec, {k: v for k, v in counters.items() if k.startswith("spec_")})


@pytest.fixture(scope="module", params=["tiny", "27b-4-layers"])
def vocab_spec_runner(request, tiny_path, device, library):  # noqa: F811 - the fixture imported above
    """The spec runners drafting over a draft vocabulary: half the tiny model's ids, the 27B's
    recommended 32768 (the `lm_head_draft` GEMV)."""
    vocab = DRAFT_VOCAB if request.param == "tiny" else 32768
    r = small_runner(request.param, tiny_path, device, library, num_pages=64, num_slots=SLOTS, max_batch=LANES,
                     max_context=1024, prefill_chunk=128, mtp=True, mtp_draft_vocab=vocab)
    yield r
    r.close()


@pytest.mark.parametrize("spec", ["mtp3", "mtp-auto"])
def test_mtp_speculation_with_a_draft_vocabulary_equals_plain_decoding(vocab_spec_runner, spec):
    requests = _requests(vocab_spec_runner.vocab_size)
    common = dict(num_lanes=LANES, max_context=1024, prefill_chunk=128)
    plain, _ = run_engine(vocab_spec_runner, requests, **common)
    speculative, counters = run_engine(vocab_spec_runner, requests, speculative=SPECS[spec], **common)
    assert speculative == plain, f"counters {counters}"
    assert counters["spec_rounds"] > 0 and counters["spec_drafted_tokens"] > 0, counters
