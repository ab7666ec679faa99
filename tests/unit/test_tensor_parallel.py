"""Tensor parallel on a simulated world: the sharding plan, zero-copy shards of an artifact, the
N-rank NumPy forward against the unsharded one, and the sampling decision over sharded logits."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.artifact import ArtifactWriter, open_artifact
from runtime.model.config import ModelConfig
from runtime.model.numpy_runner import NumpyRunner
from runtime.model.random_weights import random_weights, tiny_config_dict
from runtime.model.runner import DecodeItem, PrefillChunk
from runtime.model.sampling import RowSampling, decide, decide_sharded, pack_mask
from runtime.model.sharding import ShardingError, ShardPlan, shard_component
from runtime.model.tp_reference import TensorParallelReference
from test_model_config import QWEN36_27B, QWEN36_35B_A3B

# Tiny models whose heads split over 4 ranks: 8 query / 2 KV heads (KV heads replicated at 4),
# 4 key / 8 value GDN heads, MLP 128, experts 32, shared expert 48, vocabulary 512.
FOUR_WAY = dict(num_attention_heads=8, linear_num_key_heads=4, linear_num_value_heads=8)
PROMPT = [(7 * i + 3) % 509 + 1 for i in range(70)]    # crosses a 64-token page and GDN chunk
PAGES = dict(num_pages=6, num_slots=2, dtype=np.float64)


def tiny(family: str, **overrides) -> tuple[ModelConfig, dict]:
    config = ModelConfig.from_dict(tiny_config_dict(family, **FOUR_WAY, **overrides))
    return config, random_weights(config, seed={"dense": 1, "moe": 2, "next": 3}[family])


def test_the_27b_plan_per_world_size():
    config = ModelConfig.from_dict(QWEN36_27B)
    expect = {1: ((0, 24), (0, 4), 16, 48, 17408), 2: ((12, 24), (2, 4), 8, 24, 8704),
              4: ((18, 24), (3, 4), 4, 12, 4352), 8: ((21, 24), (3, 4), 2, 6, 2176)}
    for n, (q_heads, kv_heads, key_heads, value_heads, inter) in expect.items():
        plan = ShardPlan.build(config, n)
        last = n - 1
        assert plan.q_heads(last) == q_heads and plan.kv_heads(last) == kv_heads
        local = plan.rank_config(last)
        assert (local.linear_num_key_heads, local.linear_num_value_heads) == (key_heads, value_heads)
        assert local.intermediate_size == inter and local.vocab_size == 248320
        assert plan.vocab(last) == (248320 - 248320 // n, 248320)
    # Eight ranks over four KV heads: each KV head on the two ranks whose query heads read it.
    plan = ShardPlan.build(config, 8)
    assert [plan.kv_heads(r) for r in range(8)] == [(h, h + 1) for h in (0, 0, 1, 1, 2, 2, 3, 3)]
    group = config.num_attention_heads // config.num_key_value_heads
    for r in range(8):
        q0, q1 = plan.q_heads(r)
        assert {h // group for h in range(q0, q1)} == {plan.kv_heads(r)[0]}
    assert plan.rank_config(5).num_key_value_heads == 1


def test_the_27b_tensor_slices_at_two_ranks():
    plan = ShardPlan.build(ModelConfig.from_dict(QWEN36_27B), 2)
    attn, gdn = "layers.3.self_attn.", "layers.0.linear_attn."
    shard = plan.tensor_shard
    assert shard(attn + "q_proj.weight", 1).ranges == ((12 * 512, 24 * 512),)   # [q | gate] per head
    assert shard(attn + "k_proj.weight", 1).ranges == ((512, 1024),)
    assert (shard(attn + "o_proj.weight", 1).axis, shard(attn + "o_proj.weight", 1).ranges) == (1, ((3072, 6144),))
    # [q | k | v] rows: key heads 8..15 (128 each) in q and k, value heads 24..47 in v.
    assert shard(gdn + "in_proj_qkv.weight", 1).ranges == ((1024, 2048), (3072, 4096), (7168, 10240))
    assert shard(gdn + "conv1d.weight", 1).ranges == shard(gdn + "in_proj_qkv.weight", 1).ranges
    assert shard(gdn + "in_proj_b.weight", 1).ranges == ((24, 48),)
    assert shard(gdn + "A_log", 0).ranges == ((0, 24),)
    assert shard(gdn + "out_proj.weight", 0).axis == 1
    assert shard("layers.0.mlp.down_proj.weight", 1).ranges == ((8704, 17408),)
    for replicated in ("embed_tokens.weight", gdn + "norm.weight", attn + "q_norm.weight",
                       "layers.0.input_layernorm.weight", "norm.weight"):
        assert shard(replicated, 1) is None
    assert shard("lm_head.weight", 1).ranges == ((124160, 248320),)
    with pytest.raises(ShardingError, match="no tensor-parallel rule for tensor 'layers.0.odd.weight'"):
        shard("layers.0.odd.weight", 0)


def test_moe_experts_split_by_columns_and_the_router_is_replicated():
    plan = ShardPlan.build(ModelConfig.from_dict(QWEN36_35B_A3B), 4)
    mlp = "layers.0.mlp."
    assert plan.tensor_shard(mlp + "experts.gate_up_proj", 2).ranges == ((256, 384), (768, 896))
    down = plan.tensor_shard(mlp + "experts.down_proj", 2)
    assert (down.axis, down.ranges) == (2, ((256, 384),))
    assert plan.tensor_shard(mlp + "experts.7.up_proj.weight", 1).ranges == ((128, 256),)
    assert plan.tensor_shard(mlp + "gate.weight", 1) is None
    assert plan.tensor_shard(mlp + "shared_expert_gate.weight", 1) is None
    assert plan.tensor_shard(mlp + "shared_expert.down_proj.weight", 3).ranges == ((384, 512),)


@pytest.mark.parametrize("overrides, n, message", [
    ({}, 3, r"must be one of \(1, 2, 4, 8\)"),
    ({"num_attention_heads": 6}, 4, r"num_attention_heads \(6\) is not divisible by 4"),
    ({"num_key_value_heads": 4, "num_attention_heads": 12}, 8, r"num_attention_heads \(12\)"),
    ({"num_key_value_heads": 3, "num_attention_heads": 6}, 2, r"num_key_value_heads \(3\)"),
    ({"num_key_value_heads": 1, "num_attention_heads": 8}, 8, None),
    ({"linear_num_key_heads": 2, "linear_num_value_heads": 6}, 4, r"linear_num_key_heads \(2\)"),
    ({"intermediate_size": 100}, 8, r"intermediate_size \(100\)"),
    ({"vocab_size": 510}, 4, r"vocab_size \(510\)"),
])
def test_impossible_splits_are_refused_naming_the_field(overrides, n, message):
    config = ModelConfig.from_dict(tiny_config_dict("dense", **{**FOUR_WAY, "linear_num_key_heads": 8,
                                                                "linear_num_value_heads": 8, **overrides}))
    if message is None:    # one KV head on all 8 ranks is a valid replication
        assert [ShardPlan.build(config, n).kv_heads(r) for r in range(n)] == [(0, 1)] * n
        return
    with pytest.raises(ShardingError, match=message):
        ShardPlan.build(config, n)


def test_rank_slices_put_back_together_are_the_tensors():
    config, weights = tiny("moe")
    plan = ShardPlan.build(config, 2)
    shards = [plan.shard_arrays(weights, r) for r in range(2)]
    for name, full in weights.items():
        shard = plan.tensor_shard(name, 0)
        if shard is None or "k_proj" in name or "v_proj" in name:
            continue
        if len(shard.ranges) == 1:
            assert np.array_equal(np.concatenate([s[name] for s in shards], axis=shard.axis), full), name
    # Multi-range shards: the q, k, v blocks of each rank interleave back to the fused order.
    qkv = "layers.0.linear_attn.in_proj_qkv.weight"
    blocks = [np.split(s[qkv], [32, 64]) for s in shards]   # q, k: 2 key heads x 16; v: 4 x 16
    assert np.array_equal(np.concatenate([b[i] for i in range(3) for b in blocks]), weights[qkv])
    gate_up = "layers.1.mlp.experts.gate_up_proj"
    halves = [np.split(s[gate_up], 2, axis=1) for s in shards]
    assert np.array_equal(np.concatenate([h[i] for i in range(2) for h in halves], axis=1), weights[gate_up])


def test_component_shards_are_zero_copy_views_of_the_memory_map(tmp_path):
    config, weights = tiny("dense")
    path = tmp_path / "tiny.infernix"
    with ArtifactWriter(path) as writer:
        writer.add_component("text", tiny_config_dict("dense", **FOUR_WAY))
        for name, values in weights.items():
            writer.add_tensor("text", name, values, "bf16")
    plan = ShardPlan.build(config, 4)
    with open_artifact(path) as artifact:
        text = artifact.component("text")
        shards = shard_component(plan, text, 3)
        arrays = plan.shard_arrays({name: text.f32(name) for name in text.tensor_names()}, 3)
        for name, shard in shards.items():
            raw = text.raw(name)
            for view in shard.parts["data"]:
                assert np.shares_memory(view, raw) and not view.flags.owndata, name
            decoded = np.concatenate([(v.astype(np.uint32) << 16).view(np.float32) for v in shard.parts["data"]],
                                     axis=0 if plan.tensor_shard(name, 3) is None else plan.tensor_shard(name, 3).axis)
            assert decoded.shape == shard.shape and np.array_equal(decoded, arrays[name]), name
        assert shards["lm_head.weight"].shape == (128, 64)


def run_both(config, weights, n):
    """Prefill the prompt (all logits), then four greedy decode steps, on both; returns the
    per-step logits (unsharded, sharded as concatenated) and the greedy ids."""
    ref = NumpyRunner(config, weights, **PAGES)
    table = [0, 1]
    with TensorParallelReference(config, weights, n, **PAGES) as tp:
        chunk = PrefillChunk(0, PROMPT, 0, table, all_logits=True)
        want, got = [ref.prefill_with_hidden(chunk).logits], [tp.prefill(chunk)]
        ids_ref, ids_tp = [], []
        greedy = RowSampling(greedy=True)
        for step in range(4):
            ids_ref.append(decide(want[-1][-1], greedy).token)
            ids_tp.append(tp.sample([g[-1:] for g in got[-1]], [greedy])[0].token)
            pos = len(PROMPT) + step
            want.append(ref.decode_with_hidden([DecodeItem(0, ids_ref[-1], pos, table)]).logits)
            got.append(tp.decode([DecodeItem(0, ids_tp[-1], pos, table)]))
        calls = tp.world.calls
    return want, [np.concatenate(g, axis=1) for g in got], ids_ref, ids_tp, calls


@pytest.mark.parametrize("family", ["dense", "moe", "next"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_sharded_forward_equals_the_unsharded_runner(family, n):
    config, weights = tiny(family)
    want, got, ids_ref, ids_tp, calls = run_both(config, weights, n)
    for w, g in zip(want, got):
        assert g.shape == w.shape
        if n == 1:   # the same code path with the identity sum: bit for bit
            assert np.array_equal(g, w)
        else:
            assert np.abs(g - w).max() <= 1e-12 * np.abs(w).max()
    assert ids_tp == ids_ref
    # Two all-reduces a layer (mixer, MLP) in each of the 5 forwards.
    assert calls == 5 * 2 * config.num_hidden_layers


def test_tied_embedding_heads_shard_the_embedding_rows():
    config, weights = tiny("dense", tie_word_embeddings=True)
    want, got, ids_ref, ids_tp, _ = run_both(config, weights, 2)
    assert np.abs(got[0] - want[0]).max() <= 1e-12 * np.abs(want[0]).max()
    assert ids_tp == ids_ref


def sharded(logits, n):
    return np.split(logits, n), [i * len(logits) // n for i in range(n)]


def assert_same_draw(logits, row, n):
    a = decide(logits, row)
    b = decide_sharded(*sharded(logits, n), row)
    assert (b.token, b.u, b.margin) == (a.token, a.u, a.margin)
    assert np.array_equal(b.ids, a.ids) and np.array_equal(b.probs, a.probs)
    return a


def test_sharded_decision_equals_the_unsharded_one():
    rng = np.random.default_rng(5)
    logits = rng.standard_normal(512).astype(np.float32) * 3
    logits[[10, 300, 301, 480]] = 9.0            # a four-way tie across three shards
    allowed = np.ones(512, bool)
    allowed[300] = False
    rows = [RowSampling(greedy=True),
            RowSampling(greedy=True, bitmask=pack_mask(allowed)),
            RowSampling(greedy=False, temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, seed=11, draw_index=3),
            RowSampling(greedy=False, temperature=1.3, top_k=7, seed=4, draw_index=9,
                        penalty_ids=np.array([10, 255, 256, 480], np.int32),
                        penalty_deltas=np.array([0.5, -4.0, 2.0, 0.25], np.float32),
                        bitmask=pack_mask(allowed))]
    for row in rows:
        for n in (1, 2, 4, 8):
            assert_same_draw(logits, row, n)
    assert decide(logits, rows[0]).token == 10 and decide(logits, rows[1]).token == 10
    # Many draws of one sampled row: the shards decide every one as the whole vocabulary does.
    tokens = {assert_same_draw(logits, RowSampling(greedy=False, top_k=20, seed=s), 4).token
              for s in range(40)}
    assert len(tokens) > 3
    # No id allowed anywhere: the dead end on every shard and in the merge.
    dead = RowSampling(greedy=True, bitmask=pack_mask(np.zeros(512, bool)))
    assert decide_sharded(*sharded(logits, 4), dead).token == -1
