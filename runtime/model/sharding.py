"""Tensor-parallel sharding plan: which slice of every weight each of N ranks (GPUs) holds.

`ShardPlan.build(config, world_size)` checks that the model splits over N ranks (N in 1, 2, 4, 8)
and refuses, naming the field, what does not. Per rank it gives the head and column ranges,
the rank's local `ModelConfig` (the same model with 1/N of the heads and columns: the layer code
runs unchanged on it), and for every canonical tensor name the `TensorShard` it holds.

The split (Megatron style; the table with the 27B's numbers is in docs/architecture.md):

- gated attention: query heads (with their output gate: `q_proj` rows are per head
  `[q | gate]`) split evenly; KV heads split evenly when N <= Hkv, else each KV head is
  replicated on N / Hkv consecutive ranks (the ranks whose query heads read it), so a rank
  always holds exactly the KV heads its query heads use; `o_proj` row-parallel (its input
  columns of the rank's query heads);
- Gated DeltaNet: key heads split evenly and value heads follow their key head (value head h
  reads key head h // r, so a rank's key heads own a contiguous block of value heads); the
  `in_proj_qkv` rows and the conv channels are three ranges (q, k and v parts), `z`, `b`, `a`,
  `A_log`, `dt_bias` the rank's value heads, the gated norm's [dv] weight is shared by all heads
  (replicated); `out_proj` row-parallel;
- dense MLP and the MoE shared expert: gate/up column-parallel, down row-parallel;
- MoE routed experts: expert columns (every rank holds 1/N of every expert's intermediate
  columns), the router and the shared-expert gate replicated. Expert parallelism would make a
  decode step's slowest rank the one most of the k picked experts live on; with expert columns
  every rank reads exactly 1/N of the picked experts' bytes whatever the routing;
- embedding replicated (a lookup reads a few rows, so it costs memory, not bandwidth, and needs
  no collective); lm_head vocabulary-parallel (rows [r V/N, (r+1) V/N)); for tied embeddings
  those rows of the replicated embedding;
- norms, q/k norms, MTP `fc` and MTP norms replicated.

All-reduces (sum of the ranks' partial outputs, the only collective in the forward pass): after
`o_proj`, after `out_proj`, after the MLP's `down` (dense) or the MoE combine (routed + gated
shared expert summed on the rank first), so 2 per layer. The sampler reads the sharded logits
(`runtime.model.sampling.decide_sharded`).

Loading: `shard_arrays` slices a mapping of float arrays (the NumPy reference), and
`shard_component` returns zero-copy views of an artifact component's stored parts, so a rank
reads only its own bytes of the memory-mapped file.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from runtime.model.config import ModelConfig

WORLD_SIZES = (1, 2, 4, 8)
"""Ranks of one host's NVLink domain we plan for."""

Range = tuple[int, int]


class ShardingError(ValueError):
    """The model does not split over the requested number of ranks."""


@dataclass(frozen=True)
class TensorShard:
    """What one rank holds of a tensor: the element `ranges` [start, stop) along `axis`,
    concatenated in this order (one range for most tensors; q, k and v parts for the GDN input
    projection and conv; gate and up groups for fused experts)."""

    axis: int
    ranges: tuple[Range, ...]

    @property
    def size(self) -> int:
        return sum(stop - start for start, stop in self.ranges)


@dataclass(frozen=True)
class ShardPlan:
    """The split of `config` over `world_size` ranks; build with `ShardPlan.build`."""

    config: ModelConfig
    world_size: int

    @classmethod
    def build(cls, config: ModelConfig, world_size: int) -> "ShardPlan":
        n = world_size
        if isinstance(n, bool) or n not in WORLD_SIZES:
            raise ShardingError(f"tensor parallel size must be one of {WORLD_SIZES} "
                                f"(GPUs of one host), got {world_size!r}")
        c = config

        def divides(field: str, value: int, why: str) -> None:
            if value % n:
                raise ShardingError(f"tensor parallel {n}: {field} ({value}) is not divisible "
                                    f"by {n}; {why}")

        divides("num_attention_heads", c.num_attention_heads, "each rank needs whole query heads")
        if n <= c.num_key_value_heads:
            divides("num_key_value_heads", c.num_key_value_heads, "each rank needs whole KV heads")
        elif n % c.num_key_value_heads:
            raise ShardingError(f"tensor parallel {n}: more ranks than num_key_value_heads "
                                f"({c.num_key_value_heads}) replicates each KV head on "
                                f"{n} / {c.num_key_value_heads} ranks, which must be a whole "
                                "number")
        divides("linear_num_key_heads", c.linear_num_key_heads,
                "Gated DeltaNet splits by key head (its value heads follow it)")
        if c.intermediate_size is not None:
            divides("intermediate_size", c.intermediate_size, "the MLP splits by columns")
        if c.num_experts:
            divides("moe_intermediate_size", c.moe_intermediate_size,
                    "every expert splits by columns")
            divides("shared_expert_intermediate_size", c.shared_expert_intermediate_size,
                    "the shared expert splits by columns")
        divides("vocab_size", c.vocab_size, "the lm_head splits by vocabulary rows")
        return cls(config, n)

    # --- ranges per rank ------------------------------------------------------------------------

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range (world size {self.world_size})")

    def even(self, total: int, rank: int) -> Range:
        """Rank's block of `total` items split evenly (the plan checked divisibility)."""
        self._check_rank(rank)
        size = total // self.world_size
        return rank * size, (rank + 1) * size

    def q_heads(self, rank: int) -> Range:
        return self.even(self.config.num_attention_heads, rank)

    def kv_heads(self, rank: int) -> Range:
        """The KV heads rank's query heads read (one replicated head when N > Hkv)."""
        c = self.config
        if self.world_size <= c.num_key_value_heads:
            return self.even(c.num_key_value_heads, rank)
        self._check_rank(rank)
        head = rank // (self.world_size // c.num_key_value_heads)
        return head, head + 1

    def key_heads(self, rank: int) -> Range:
        return self.even(self.config.linear_num_key_heads, rank)

    def value_heads(self, rank: int) -> Range:
        """The value heads of the rank's key heads (value head h reads key head h // r)."""
        return self.even(self.config.linear_num_value_heads, rank)

    def vocab(self, rank: int) -> Range:
        """lm_head rows (vocabulary ids) the rank computes logits for."""
        return self.even(self.config.vocab_size, rank)

    def rank_config(self, rank: int) -> ModelConfig:
        """The model as rank `rank` runs it: 1/N of the heads and columns, the full vocabulary
        for token ids and the embedding (the lm_head's rows are `vocab(rank)`)."""
        c = self.config
        kv0, kv1 = self.kv_heads(rank)

        def part(size: int | None) -> int | None:
            return None if size is None else size // self.world_size

        return dataclasses.replace(
            c, num_attention_heads=c.num_attention_heads // self.world_size,
            num_key_value_heads=kv1 - kv0,
            linear_num_key_heads=c.linear_num_key_heads // self.world_size,
            linear_num_value_heads=c.linear_num_value_heads // self.world_size,
            intermediate_size=part(c.intermediate_size),
            moe_intermediate_size=part(c.moe_intermediate_size),
            shared_expert_intermediate_size=part(c.shared_expert_intermediate_size))

    # --- tensors --------------------------------------------------------------------------------

    def tensor_shard(self, name: str, rank: int) -> TensorShard | None:
        """The slice of canonical tensor `name` (text or MTP component) rank holds; None when it
        holds all of it (replicated). An unknown name is an error, never silently replicated."""
        self._check_rank(rank)
        match = _LAYER_NAME.fullmatch(name)
        role = match.group(1) if match else name
        if role in _REPLICATED:
            return None
        if role == "lm_head.weight":
            return TensorShard(0, (self.vocab(rank),))
        rule = _RULES.get(role)
        if rule is None:
            expert = _EXPERT_NAME.fullmatch(role)
            if expert is None:
                raise ShardingError(f"no tensor-parallel rule for tensor {name!r}")
            rule = _RULES["mlp.experts.*." + expert.group(1)]
        return rule(self, rank)

    def shard_arrays(self, tensors: Mapping[str, np.ndarray], rank: int) -> dict[str, np.ndarray]:
        """Rank's tensors of a name -> array mapping: views for one range, copies for several."""
        out = {}
        for name in tensors:
            shard = self.tensor_shard(name, rank)
            array = tensors[name]
            out[name] = array if shard is None else _take(array, shard)
        return out


def _take(array: np.ndarray, shard: TensorShard) -> np.ndarray:
    pieces = [_slice(array, shard.axis, r) for r in shard.ranges]
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=shard.axis)


def _slice(array: np.ndarray, axis: int, span: Range) -> np.ndarray:
    index = [slice(None)] * array.ndim
    index[axis] = slice(*span)
    return array[tuple(index)]


def _scaled(span: Range, factor: int, offset: int = 0) -> Range:
    return offset + span[0] * factor, offset + span[1] * factor


def _q_proj(plan: ShardPlan, rank: int) -> TensorShard:
    return TensorShard(0, (_scaled(plan.q_heads(rank), 2 * plan.config.head_dim),))


def _kv_proj(plan: ShardPlan, rank: int) -> TensorShard:
    return TensorShard(0, (_scaled(plan.kv_heads(rank), plan.config.head_dim),))


def _o_proj(plan: ShardPlan, rank: int) -> TensorShard:
    return TensorShard(1, (_scaled(plan.q_heads(rank), plan.config.head_dim),))


def _conv_channels(plan: ShardPlan, rank: int) -> TensorShard:
    """The q, k and v channel blocks of the rank's heads (in_proj_qkv rows, conv1d channels)."""
    c = plan.config
    keys, values = plan.key_heads(rank), plan.value_heads(rank)
    dk, key_dim = c.linear_key_head_dim, c.linear_key_dim
    return TensorShard(0, (_scaled(keys, dk), _scaled(keys, dk, key_dim),
                           _scaled(values, c.linear_value_head_dim, 2 * key_dim)))


def _value_rows(plan: ShardPlan, rank: int) -> TensorShard:
    return TensorShard(0, (_scaled(plan.value_heads(rank), plan.config.linear_value_head_dim),))


def _value_heads(plan: ShardPlan, rank: int) -> TensorShard:
    return TensorShard(0, (plan.value_heads(rank),))


def _out_proj(plan: ShardPlan, rank: int) -> TensorShard:
    return TensorShard(1, (_scaled(plan.value_heads(rank), plan.config.linear_value_head_dim),))


def _next_qkvz(plan: ShardPlan, rank: int) -> TensorShard:
    """Qwen3-Next's fused projection is grouped by key head: one contiguous block per rank."""
    c = plan.config
    group = 2 * c.linear_key_head_dim + 2 * c.value_heads_per_key_head * c.linear_value_head_dim
    return TensorShard(0, (_scaled(plan.key_heads(rank), group),))


def _next_ba(plan: ShardPlan, rank: int) -> TensorShard:
    return TensorShard(0, (_scaled(plan.key_heads(rank), 2 * plan.config.value_heads_per_key_head),))


def _columns(width: Callable[[ModelConfig], int], axis: int):
    """Column-parallel (axis 0 of [I, H]) or row-parallel (axis 1 of [H, I]) over the
    intermediate width `width(config)`."""
    def rule(plan: ShardPlan, rank: int) -> TensorShard:
        return TensorShard(axis, (plan.even(width(plan.config), rank),))
    return rule


def _dense(c: ModelConfig) -> int:
    return c.intermediate_size


def _expert(c: ModelConfig) -> int:
    return c.moe_intermediate_size


def _shared(c: ModelConfig) -> int:
    return c.shared_expert_intermediate_size


def _fused_experts(plan: ShardPlan, rank: int) -> TensorShard:
    """[E, 2I, H] gate rows then up rows: the rank's columns of both groups."""
    inter = plan.config.moe_intermediate_size
    span = plan.even(inter, rank)
    return TensorShard(1, (span, (inter + span[0], inter + span[1])))


_REPLICATED = frozenset({
    "embed_tokens.weight", "norm.weight", "fc.weight", "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight", "linear_attn.norm.weight",
    "mlp.gate.weight", "mlp.shared_expert_gate.weight"})

# Rules by layer role (the name after `layers.{i}.`; per-expert names match `experts.*.`).
_RULES = {
    "self_attn.q_proj.weight": _q_proj,
    "self_attn.k_proj.weight": _kv_proj,
    "self_attn.v_proj.weight": _kv_proj,
    "self_attn.o_proj.weight": _o_proj,
    "linear_attn.in_proj_qkv.weight": _conv_channels,
    "linear_attn.conv1d.weight": _conv_channels,
    "linear_attn.in_proj_z.weight": _value_rows,
    "linear_attn.in_proj_b.weight": _value_heads,
    "linear_attn.in_proj_a.weight": _value_heads,
    "linear_attn.A_log": _value_heads,
    "linear_attn.dt_bias": _value_heads,
    "linear_attn.out_proj.weight": _out_proj,
    "linear_attn.in_proj_qkvz.weight": _next_qkvz,
    "linear_attn.in_proj_ba.weight": _next_ba,
    "mlp.gate_proj.weight": _columns(_dense, 0),
    "mlp.up_proj.weight": _columns(_dense, 0),
    "mlp.down_proj.weight": _columns(_dense, 1),
    "mlp.experts.gate_up_proj": _fused_experts,
    "mlp.experts.down_proj": _columns(_expert, 2),
    "mlp.experts.*.gate_proj.weight": _columns(_expert, 0),
    "mlp.experts.*.up_proj.weight": _columns(_expert, 0),
    "mlp.experts.*.down_proj.weight": _columns(_expert, 1),
    "mlp.shared_expert.gate_proj.weight": _columns(_shared, 0),
    "mlp.shared_expert.up_proj.weight": _columns(_shared, 0),
    "mlp.shared_expert.down_proj.weight": _columns(_shared, 1),
}
_LAYER_NAME = re.compile(r"layers\.\d+\.(.+)")
_EXPERT_NAME = re.compile(r"mlp\.experts\.\d+\.((?:gate|up|down)_proj\.weight)")


@dataclass(frozen=True)
class ComponentShard:
    """A rank's part of one stored tensor: per stored part, one zero-copy view of the memory map
    per range (the upload copies them back to back, as the fused device slots already do)."""

    name: str
    format: str
    shape: tuple[int, ...]          # the rank's logical shape
    parts: dict[str, tuple[np.ndarray, ...]]


def shard_component(plan: ShardPlan, component: Any, rank: int) -> dict[str, ComponentShard]:
    """Rank's views of every tensor of an artifact component (`runtime.artifact.reader.
    Component`): basic slices of `component.raw`, so nothing is read until the bytes are used.

    BF16 and FP32 tensors only: a slice of an FP8 (128 x 128 scale blocks) or NVFP4 tensor must
    also slice its scales, and the GPU path reads BF16 only so far, so those formats are refused
    by name instead of being half supported.
    """
    out = {}
    for name in component.tensor_names():
        entry = component.entry(name)
        shard = plan.tensor_shard(name, rank)
        if shard is None:
            out[name] = ComponentShard(name, entry.format, tuple(entry.shape),
                                       {part: (component.raw(name, part),) for part in entry.parts})
            continue
        if entry.format not in ("bf16", "fp32"):
            raise ShardingError(f"tensor {name} is {entry.format}; tensor-parallel slicing reads "
                                "bf16 and fp32 tensors only so far")
        data = component.raw(name)
        shape = list(entry.shape)
        shape[shard.axis] = shard.size
        out[name] = ComponentShard(name, entry.format, tuple(shape),
                                   {"data": tuple(_slice(data, shard.axis, r) for r in shard.ranges)})
    return out
