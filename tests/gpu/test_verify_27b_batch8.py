"""Verification steps of 8 sequences on a 4-layer model of the Qwen3.6-27B shapes (synthetic
weights) against each sequence decoded alone, bit for bit.

The two paths share no launch shape: the verification step (8 rows of 1 + k tokens, k = 3, 7)
runs its projections and head as one `m32` or `m64` GEMV launch per weight and the GDN `verify`
kernel with one column block per head (batch 8), while a sequence decoded alone runs the `m8`
GEMV and the GDN decode kernel with 8 column blocks (batch 1, `KernelChoice.gdn_recurrent`). Every
GEMV width and every column-block count computes a row's numbers the same way
(cute_kernels/gemv.py, cute_kernels/gdn.py), so each position's logits and each snapshot's GDN
states and conv windows must equal those of the separate decode steps exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.model.runner import DecodeItem, PrefillChunk, StepRow

pytestmark = pytest.mark.gpu

BATCH, PROMPT_LEN, MOST_DRAFTS = 8, 20, 7


@pytest.fixture(scope="module")
def runner(device, library):
    from bench.decode import QWEN36_27B
    from runtime.model.config import ModelConfig
    from runtime.model.gpu.runner import CudaRunner

    layers = 4
    shape = {**QWEN36_27B, "num_hidden_layers": layers, "layer_types": QWEN36_27B["layer_types"][:layers]}
    # Slots: 8 verified sequences, 8 copies decoded alone, a snapshot per verified position.
    r = CudaRunner.synthetic(ModelConfig.from_dict(shape), 11, num_pages=2 * BATCH + 1,
                             num_slots=2 * BATCH + BATCH * (MOST_DRAFTS + 1), max_batch=BATCH, max_context=128,
                             prefill_chunk=512, device=device, library=library)
    yield r
    r.close()


def _states(r, slot: int) -> list[np.ndarray]:
    return [a for n in range(len(r.config.linear_layers)) for a in r.read_state(n, slot)]


@pytest.mark.parametrize("k", [3, 7])
def test_a_verification_step_of_8_sequences_equals_each_decoded_alone(runner, k):
    r = runner
    kernels, hidden = r.kernels, r.config.hidden_size
    # The two paths do run different kernel forms (else this test would prove nothing new).
    cols = {n: r.library.manifest.kernels[("gdn", kernels.gdn_recurrent(n, n > 1))].config["cols"] for n in (1, BATCH)}
    assert cols == {1: 8, BATCH: 1}
    wide = r.library.manifest.kernels[("gemv", kernels.linear(r.vocab_size, hidden, BATCH * (k + 1), exact=True)[1])]
    assert wide.config["MB"] == 8 * (k + 1)  # the wide GEMV (in its row form), not 8-row blocks
    rng = np.random.default_rng(k)
    rows, alone = [], []
    for b in range(BATCH):
        prompt = rng.integers(0, r.vocab_size, PROMPT_LEN).tolist()
        tokens = rng.integers(0, r.vocab_size, k + 1).tolist()
        for slot in (b, BATCH + b):
            r.reset_slot(slot)
            r.prefill(PrefillChunk(slot=slot, token_ids=prompt, start_pos=0, page_table=[slot]))
        snapshots = [2 * BATCH + b * (k + 1) + i for i in range(k + 1)]
        rows.append(StepRow(slot=b, token_ids=tokens, start_pos=PROMPT_LEN, page_table=[b], logits="all",
                            snapshots=snapshots))
        alone.append((BATCH + b, tokens, snapshots))
    together = r.step(rows)
    for b, (slot, tokens, snapshots) in enumerate(alone):
        assert together[b].shape == (k + 1, r.vocab_size) and np.isfinite(together[b]).all()
        for i, token in enumerate(tokens):
            want = r.decode([DecodeItem(slot=slot, token_id=token, pos=PROMPT_LEN + i, page_table=[slot])])
            np.testing.assert_array_equal(together[b][i], want[0], err_msg=f"seq {b} position {i} logits")
            for n, (got, ref) in enumerate(zip(_states(r, snapshots[i]), _states(r, slot))):
                np.testing.assert_array_equal(got, ref, err_msg=f"seq {b} position {i} state {n}")
