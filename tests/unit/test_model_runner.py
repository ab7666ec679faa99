"""NumpyRunner without golden data: self-consistency of the paged / chunked / batched paths,
the weight layouts it accepts, the MTP head against an independent naive computation, and input
checks. Tiny random models (runtime.model.random_weights), float64 where equality is the point."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.model.config import ModelConfig
from runtime.model.numpy_runner import NumpyRunner
from runtime.model.random_weights import random_mtp_weights, random_weights, tiny_config_dict
from runtime.model.runner import PAGE_SIZE, DecodeItem, ModelRunner, PrefillChunk
from runtime.model.weights import WeightError

FAMILIES = ("dense", "moe", "next")
PROMPT = np.random.default_rng(7).integers(0, 512, 150).tolist()


def make(family: str = "dense", *, dtype=np.float64, mtp: bool = False, tie: bool = False,
         num_pages: int = 16, num_slots: int = 4, weights=None, **kwargs) -> NumpyRunner:
    config = ModelConfig.from_dict(tiny_config_dict(family, tie_word_embeddings=tie))
    weights = random_weights(config, seed=3) if weights is None else weights
    return NumpyRunner(config, weights, num_pages=num_pages, num_slots=num_slots, dtype=dtype,
                       mtp_weights=random_mtp_weights(config) if mtp else None, **kwargs)


def pages_for(first: int, tokens: int) -> list[int]:
    return list(range(first, first + -(-tokens // PAGE_SIZE)))


def kv_rows(runner: NumpyRunner, page_table: list[int], length: int) -> tuple[np.ndarray, ...]:
    """The K and V rows of positions 0..length-1 of a sequence, every attention layer."""
    rows = [(page_table[p // PAGE_SIZE], p % PAGE_SIZE) for p in range(length)]
    keys = np.stack([runner.key_pages[:, page, row] for page, row in rows], axis=1)
    values = np.stack([runner.value_pages[:, page, row] for page, row in rows], axis=1)
    return keys, values


def assert_close(a, b, rtol=1e-10):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    scale = max(np.max(np.abs(b)), 1e-30)
    assert np.max(np.abs(a - b)) / scale <= rtol, np.max(np.abs(a - b)) / scale


def test_numpy_runner_satisfies_the_protocol():
    runner = make()
    assert isinstance(runner, NumpyRunner)
    for name in ("reset_slot", "copy_slot", "prefill", "decode"):
        assert callable(getattr(runner, name))
    assert runner.vocab_size == 512 and runner.num_pages == 16 and runner.num_slots == 4
    _: ModelRunner = runner     # structural typing: the protocol's attributes exist


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_in_chunks_of_1_7_64_and_whole_agree(family):
    runner = make(family, num_slots=4, num_pages=16)
    results = []
    for slot, chunk in enumerate((len(PROMPT), 64, 7, 1)):
        table = pages_for(4 * slot, len(PROMPT))
        runner.reset_slot(slot)
        logits = []
        for start in range(0, len(PROMPT), chunk):
            out = runner.prefill_with_hidden(PrefillChunk(
                slot, PROMPT[start:start + chunk], start, table, all_logits=True))
            logits.append(out.logits)
        results.append((np.concatenate(logits), slot, table))
    whole, whole_slot, whole_table = results[0]
    assert whole.shape == (len(PROMPT), 512)
    for logits, slot, table in results[1:]:
        assert_close(logits, whole)
        assert_close(runner.recurrent_states[:, slot], runner.recurrent_states[:, whole_slot])
        assert_close(runner.conv_states[:, slot], runner.conv_states[:, whole_slot])
        for got, want in zip(kv_rows(runner, table, len(PROMPT)),
                             kv_rows(runner, whole_table, len(PROMPT))):
            assert_close(got, want)


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_after_prefill_equals_a_longer_prefill(family):
    runner = make(family)
    steps = 100
    table_a, table_b = pages_for(0, steps), pages_for(4, steps)
    runner.reset_slot(0)
    longer = runner.prefill_with_hidden(PrefillChunk(0, PROMPT[:steps], 0, table_a,
                                                     all_logits=True))
    runner.reset_slot(1)
    runner.prefill(PrefillChunk(1, PROMPT[:steps - 3], 0, table_b))
    decoded = [runner.decode_with_hidden([DecodeItem(1, PROMPT[p], p, table_b)])
               for p in range(steps - 3, steps)]
    assert_close(np.concatenate([d.logits for d in decoded]), longer.logits[-3:])
    assert_close(np.concatenate([d.hidden for d in decoded]), longer.hidden[-3:])
    assert_close(runner.recurrent_states[:, 1], runner.recurrent_states[:, 0])
    assert_close(runner.conv_states[:, 1], runner.conv_states[:, 0])


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_decode_equals_one_sequence_at_a_time(family):
    runner = make(family, num_slots=6, num_pages=24)
    lengths = (5, 70, 130)
    # Scattered, interleaved page ids: sequence s owns pages s, s+3, s+6, ...
    tables = [[s + 3 * i for i in range(3)] for s in range(3)]
    for s, length in enumerate(lengths):
        runner.reset_slot(s)
        runner.prefill(PrefillChunk(s, PROMPT[:length], 0, tables[s]))
        runner.copy_slot(s, s + 3)
    # The copies (slots 3..5) decode one by one; they rewrite the same KV rows with the same
    # values, so run them first, then the batch.
    single = [runner.decode_with_hidden([DecodeItem(s + 3, 11 * s + 1, lengths[s], tables[s])])
              for s in range(3)]
    batched = runner.decode_with_hidden([DecodeItem(s, 11 * s + 1, lengths[s], tables[s])
                                         for s in (2, 0, 1)])
    for row, s in enumerate((2, 0, 1)):
        assert_close(batched.logits[row], single[s].logits[0])
        assert_close(runner.recurrent_states[:, s], runner.recurrent_states[:, s + 3])
        assert_close(runner.conv_states[:, s], runner.conv_states[:, s + 3])


def test_prefill_gdn_forms_agree():
    chunked = make("moe")
    recurrent = make("moe", gdn_prefill_form="recurrent")
    for runner in (chunked, recurrent):
        runner.reset_slot(0)
    a = chunked.prefill_with_hidden(PrefillChunk(0, PROMPT, 0, [0, 1, 2], all_logits=True))
    b = recurrent.prefill_with_hidden(PrefillChunk(0, PROMPT, 0, [0, 1, 2], all_logits=True))
    assert_close(a.logits, b.logits)
    assert_close(chunked.recurrent_states, recurrent.recurrent_states)


def test_float32_default_and_float64_selectable():
    r32, r64 = make(dtype=np.float32), make(dtype=np.float64)
    assert r32.recurrent_states.dtype == np.float32 and r32.key_pages.dtype == np.float32
    assert r64.recurrent_states.dtype == np.float64 and r64.key_pages.dtype == np.float64
    assert r64.text.lm_head_t.dtype == np.float64
    chunk = PrefillChunk(0, PROMPT[:80], 0, [0, 1], all_logits=True)
    out32, out64 = r32.prefill(chunk), r64.prefill(chunk)
    assert out32.dtype == np.float32 and out64.dtype == np.float32     # protocol: float32
    assert r64.prefill_with_hidden(PrefillChunk(1, PROMPT[:5], 0, [2])).logits.dtype == np.float64
    assert_close(out32, out64, rtol=1e-4)
    with pytest.raises(ValueError, match="float32 or float64"):
        make(dtype=np.float16)


def test_last_logits_only_and_shapes():
    runner = make()
    last = runner.prefill(PrefillChunk(0, PROMPT[:10], 0, [0]))
    assert last.shape == (1, 512)
    runner.reset_slot(0)
    every = runner.prefill(PrefillChunk(0, PROMPT[:10], 0, [0], all_logits=True))
    assert every.shape == (10, 512)
    np.testing.assert_array_equal(every[-1:], last)
    out = runner.decode([DecodeItem(0, 1, 10, [0]), DecodeItem(1, 2, 0, [1])])
    assert out.shape == (2, 512) and out.dtype == np.float32


def test_reset_and_copy_slot():
    runner = make()
    runner.prefill(PrefillChunk(0, PROMPT[:20], 0, [0]))
    snapshot = runner.recurrent_states[:, 0].copy()
    runner.copy_slot(0, 2)
    runner.prefill(PrefillChunk(0, PROMPT[20:30], 20, [0]))
    np.testing.assert_array_equal(runner.recurrent_states[:, 2], snapshot)
    # Continuing from the snapshot reproduces the original continuation.
    a = runner.decode([DecodeItem(0, 5, 30, [0])])
    runner.prefill(PrefillChunk(2, PROMPT[20:30], 20, [0]))
    b = runner.decode([DecodeItem(2, 5, 30, [0])])
    np.testing.assert_array_equal(a, b)
    runner.reset_slot(2)
    assert not runner.recurrent_states[:, 2].any() and not runner.conv_states[:, 2].any()


def test_tied_embeddings():
    config = ModelConfig.from_dict(tiny_config_dict("dense", tie_word_embeddings=True))
    weights = random_weights(config, seed=5)
    assert "lm_head.weight" not in weights
    runner = NumpyRunner(config, weights, num_pages=2, num_slots=1, dtype=np.float64)
    out = runner.prefill_with_hidden(PrefillChunk(0, PROMPT[:6], 0, [0], all_logits=True))
    assert_close(out.logits, out.hidden @ weights["embed_tokens.weight"].T, rtol=1e-12)
    untied = dict(weights, **{"lm_head.weight": 2 * weights["embed_tokens.weight"]})
    config_untied = ModelConfig.from_dict(tiny_config_dict("dense"))
    runner = NumpyRunner(config_untied, untied, num_pages=2, num_slots=1, dtype=np.float64)
    out2 = runner.prefill_with_hidden(PrefillChunk(0, PROMPT[:6], 0, [0], all_logits=True))
    assert_close(out2.logits, 2 * out.logits, rtol=1e-12)


# --- weight layouts -----------------------------------------------------------------------------

def fuse_next_projections(weights: dict, config: ModelConfig) -> dict:
    """Qwen3-Next's checkpoint layout from the split form (the inverse of the load regroup)."""
    out = dict(weights)
    hk, dk, dv = config.linear_num_key_heads, config.linear_key_head_dim, \
        config.linear_value_head_dim
    r = config.value_heads_per_key_head
    for layer in config.linear_layers:
        p = f"layers.{layer}.linear_attn."
        qkv = out.pop(p + "in_proj_qkv.weight")
        z, b, a = (out.pop(p + f"in_proj_{n}.weight") for n in "zba")
        q, k, v = np.split(qkv, [hk * dk, 2 * hk * dk])
        groups, ba = [], []
        for g in range(hk):
            heads = slice(g * r * dv, (g + 1) * r * dv)
            groups += [q[g * dk:(g + 1) * dk], k[g * dk:(g + 1) * dk], v[heads], z[heads]]
            ba += [b[g * r:(g + 1) * r], a[g * r:(g + 1) * r]]
        out[p + "in_proj_qkvz.weight"] = np.concatenate(groups)
        out[p + "in_proj_ba.weight"] = np.concatenate(ba)
    return out


def split_experts(weights: dict, config: ModelConfig) -> dict:
    out = dict(weights)
    inter = config.moe_intermediate_size
    for name in [n for n in weights if n.endswith("mlp.experts.gate_up_proj")]:
        base = name[:-len("gate_up_proj")]
        gate_up, down = out.pop(name), out.pop(base + "down_proj")
        for e in range(config.num_experts):
            out[f"{base}{e}.gate_proj.weight"] = gate_up[e, :inter]
            out[f"{base}{e}.up_proj.weight"] = gate_up[e, inter:]
            out[f"{base}{e}.down_proj.weight"] = down[e]
    return out


def test_next_fused_gdn_projections_are_regrouped():
    config = ModelConfig.from_dict(tiny_config_dict("next"))
    split = random_weights(config, seed=9)
    fused = fuse_next_projections(split, config)
    assert "layers.0.linear_attn.in_proj_qkvz.weight" in fused
    a = NumpyRunner(config, split, num_pages=4, num_slots=1)
    b = NumpyRunner(config, fused, num_pages=4, num_slots=1)
    chunk = PrefillChunk(0, PROMPT[:40], 0, [0], all_logits=True)
    np.testing.assert_array_equal(a.prefill(chunk), b.prefill(chunk))


def test_per_expert_and_conv_layouts():
    config = ModelConfig.from_dict(tiny_config_dict("moe"))
    fused = random_weights(config, seed=11)
    per_expert = split_experts(fused, config)
    per_expert = {k: (v[:, None, :] if k.endswith("conv1d.weight") else v)
                  for k, v in per_expert.items()}                 # HF's [C, 1, Kc]
    a = NumpyRunner(config, fused, num_pages=4, num_slots=1)
    b = NumpyRunner(config, per_expert, num_pages=4, num_slots=1)
    chunk = PrefillChunk(0, PROMPT[:40], 0, [0], all_logits=True)
    np.testing.assert_array_equal(a.prefill(chunk), b.prefill(chunk))


def test_missing_or_misshapen_weights_are_named():
    config = ModelConfig.from_dict(tiny_config_dict("dense"))
    weights = random_weights(config)
    missing = {k: v for k, v in weights.items() if k != "layers.2.self_attn.q_norm.weight"}
    with pytest.raises(WeightError, match="missing tensor 'layers.2.self_attn.q_norm.weight'"):
        NumpyRunner(config, missing, num_pages=1, num_slots=1)
    wrong = dict(weights, **{"layers.0.linear_attn.A_log": np.zeros(5, np.float32)})
    with pytest.raises(WeightError, match=r"'layers.0.linear_attn.A_log' has shape \[5\], "
                                          r"expected \[4\]"):
        NumpyRunner(config, wrong, num_pages=1, num_slots=1)
    with pytest.raises(WeightError, match="mtp weights: missing tensor 'layers.0.self_attn"):
        NumpyRunner(config, weights, num_pages=1, num_slots=1, mtp_weights={})


# --- input checks -------------------------------------------------------------------------------

@pytest.mark.parametrize("call,message", [
    (lambda r: r.prefill(PrefillChunk(9, [1], 0, [0])), "slot 9 out of range"),
    (lambda r: r.prefill(PrefillChunk(0, [], 0, [0])), "no tokens"),
    (lambda r: r.prefill(PrefillChunk(0, [512], 0, [0])), r"token ids must be in \[0, 512\)"),
    (lambda r: r.prefill(PrefillChunk(0, [1] * 65, 0, [0])), "page table has 1 pages"),
    (lambda r: r.prefill(PrefillChunk(0, [1], 0, [16])), r"page ids must be in \[0, 16\)"),
    (lambda r: r.prefill(PrefillChunk(0, [1], -1, [0])), "start_pos must be"),
    (lambda r: r.decode([]), "at least one item"),
    (lambda r: r.decode([DecodeItem(0, 1, 0, [0]), DecodeItem(0, 1, 0, [1])]),
     "distinct slots"),
    (lambda r: r.decode([DecodeItem(0, 1, 64, [0])]), "page table has 1 pages"),
    (lambda r: r.copy_slot(0, 4), "slot 4 out of range"),
    (lambda r: r.mtp_prefill(np.zeros((1, 64)), [1], 0, [0]), "without MTP weights"),
])
def test_bad_inputs_raise_before_touching_state(call, message):
    runner = make(num_slots=4, num_pages=16)
    runner.prefill(PrefillChunk(0, PROMPT[:8], 0, [0]))
    before = (runner.recurrent_states.copy(), runner.key_pages.copy())
    with pytest.raises(ValueError, match=message):
        call(runner)
    np.testing.assert_array_equal(runner.recurrent_states, before[0])
    np.testing.assert_array_equal(runner.key_pages, before[1])


# --- MTP head -----------------------------------------------------------------------------------

def naive_mtp_logits(config: ModelConfig, text: dict, mtp: dict, hidden: np.ndarray,
                     next_tokens: list[int]) -> np.ndarray:
    """The MTP head of qwen-arch.md 2.6 written out per token and per head in float64, with no
    code shared with the runner: logits for pairs (hidden[t], next_tokens[t]) at positions t."""
    eps, d, rd = config.rms_norm_eps, config.head_dim, config.rotary_dim
    hq, hkv = config.num_attention_heads, config.num_key_value_heads

    def norm(x, w):
        return x / np.sqrt(np.mean(x ** 2) + eps) * (1 + w)

    def rope(x, pos):
        half = rd // 2
        out = x.copy()
        for i in range(half):
            angle = pos * config.rope_theta ** (-2 * i / rd)
            c, s = np.cos(angle), np.sin(angle)
            out[i], out[i + half] = x[i] * c - x[i + half] * s, x[i + half] * c + x[i] * s
        return out

    def silu(x):
        return x / (1 + np.exp(-x))

    w = {k: np.asarray(v, np.float64) for k, v in mtp.items()}
    embed = np.asarray(text["embed_tokens.weight"], np.float64)
    lm_head = np.asarray(text.get("lm_head.weight", text["embed_tokens.weight"]), np.float64)
    p = "layers.0."
    keys, values, logits = [], [], []
    for t, token in enumerate(next_tokens):
        u = w["fc.weight"] @ np.concatenate([norm(embed[token], w["pre_fc_norm_embedding.weight"]),
                                             norm(hidden[t], w["pre_fc_norm_hidden.weight"])])
        x = norm(u, w[p + "input_layernorm.weight"])
        qg = (w[p + "self_attn.q_proj.weight"] @ x).reshape(hq, 2 * d)
        k = (w[p + "self_attn.k_proj.weight"] @ x).reshape(hkv, d)
        v = (w[p + "self_attn.v_proj.weight"] @ x).reshape(hkv, d)
        keys.append([rope(norm(k[h], w[p + "self_attn.k_norm.weight"]), t) for h in range(hkv)])
        values.append(v)
        heads = []
        for h in range(hq):
            q = rope(norm(qg[h, :d], w[p + "self_attn.q_norm.weight"]), t)
            kv = h // (hq // hkv)
            scores = np.array([q @ keys[s][kv] for s in range(t + 1)]) / np.sqrt(d)
            probs = np.exp(scores - scores.max())
            probs /= probs.sum()
            mixed = sum(probs[s] * values[s][kv] for s in range(t + 1))
            heads.append(mixed / (1 + np.exp(-qg[h, d:])))
        u = u + w[p + "self_attn.o_proj.weight"] @ np.concatenate(heads)
        x = norm(u, w[p + "post_attention_layernorm.weight"])
        u = u + w[p + "mlp.down_proj.weight"] @ (silu(w[p + "mlp.gate_proj.weight"] @ x)
                                                 * (w[p + "mlp.up_proj.weight"] @ x))
        logits.append(lm_head @ norm(u, w["norm.weight"]))
    return np.stack(logits)


def test_mtp_head_against_naive_computation_and_its_own_decode():
    config = ModelConfig.from_dict(tiny_config_dict("dense"))
    text, mtp = random_weights(config, seed=21), random_mtp_weights(config, seed=22)
    runner = NumpyRunner(config, text, num_pages=8, num_slots=1, dtype=np.float64,
                         mtp_weights=mtp)
    steps = 70
    table = pages_for(0, steps)
    main = runner.prefill_with_hidden(PrefillChunk(0, PROMPT[:steps], 0, table,
                                                   all_logits=True))
    assert main.hidden.shape == (steps, config.hidden_size)
    # MTP over the prompt but the last pair, then the last pair as a batched decode step.
    prefix = runner.mtp_prefill(main.hidden[:steps - 2], PROMPT[1:steps - 1], 0, table)
    last = runner.mtp_decode([DecodeItem(0, PROMPT[steps - 1], steps - 2, table)],
                             main.hidden[steps - 2:steps - 1])
    assert prefix.logits.shape == (steps - 2, 512) and prefix.hidden.shape == (steps - 2, 64)
    assert last.logits.shape == (1, 512)
    got = np.concatenate([prefix.logits, last.logits])
    expected = naive_mtp_logits(config, text, mtp, main.hidden, PROMPT[1:steps])
    assert_close(got, expected, rtol=1e-10)
    # The MTP layer has its own KV, so the main model's pages are untouched by it.
    again = NumpyRunner(config, text, num_pages=8, num_slots=1, dtype=np.float64)
    again.prefill(PrefillChunk(0, PROMPT[:steps], 0, table))
    np.testing.assert_array_equal(runner.key_pages[:len(config.attention_layers)],
                                  again.key_pages)


@pytest.mark.parametrize("family", ["moe", "next"])
def test_mtp_head_moe_shapes_and_chunk_consistency(family):
    runner = make(family, mtp=True)
    main = runner.prefill_with_hidden(PrefillChunk(0, PROMPT[:30], 0, [0], all_logits=True))
    whole = runner.mtp_prefill(main.hidden[:29], PROMPT[1:30], 0, [0])
    first = runner.mtp_prefill(main.hidden[:10], PROMPT[1:11], 0, [1])
    rest = runner.mtp_prefill(main.hidden[10:29], PROMPT[11:30], 10, [1])
    assert whole.logits.shape == (29, 512)
    assert_close(np.concatenate([first.logits, rest.logits]), whole.logits)
    with pytest.raises(ValueError, match="MTP hidden states must be"):
        runner.mtp_prefill(main.hidden[:3], PROMPT[1:3], 0, [0])
