"""The MoE MLP of a prefill chunk through the grouped GEMMs (cute_kernels/moe_grouped.py).

After the `moe` family's router logits and routing (ids and weights per row, the shared expert
in the last slot), a prefill step sorts the rows by expert on the device (`perm`), gathers them
(`gather`), runs the gate/up grouped GEMM, SwiGLU (`silu_mul`), the down grouped GEMM, and sums
each row's slots in order (`combine`). Every launch is sized for the capacity of the step's row
count, and the number of tiles in use is read on the device, so the step captures in a graph.

Buffers (`storage.Storage`, sized for `capacity(rows)`): `moe_pos` [rows, P] and `moe_src`,
`moe_tiles` (int32), `moe_gu` [C, 2I] and `moe_gact` [C, I] bf16, and `moe_rows`: the gathered
rows xg [C, H] bf16, then (xg read by the gate/up GEMM is dead by then) the down GEMM's fp32
rows [C, H].

FP8 experts (`weights.FP8` stacks): the layer's two stacks are first dequantised into a BF16
scratch (`moe_dequant`, one layer's experts: gate/up then down) by cute_kernels/dequant_weights.py,
and the grouped GEMMs read that; the extra traffic and the rounding are in that module's docstring.
NVFP4 experts (`weights.NVFP4` stacks) the same through cute_kernels/dequant_nvfp4.py (code x block
scale x the row's global, rounded once to bf16; 0.56 bytes a weight read, 2 written).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoePrefill:
    """Variant keys of the prefill MoE launches for one model shape, and the tile size its
    segments are padded to."""

    perm: str
    gather: str
    gate_up: str
    silu: str
    down: str
    combine: str
    bm: int
    slots: int  # P: k routed slots + the shared one
    experts: int  # E + 1 segments
    dequant_gate_up: str | None = None  # quantised experts: the dequantising keys of the two stacks
    dequant_down: str | None = None
    dequant_family: str = "dequant_weights"  # FP8: dequant_weights; NVFP4: dequant_nvfp4

    @classmethod
    def find(cls, library: Any, find: Any, config: Any, expert_format: str = "bf16") -> MoePrefill | None:
        """The variants for the model's MoE shape, or None (prefill then takes the decode
        kernels) when any of them was not compiled. expert_format "fp8_e4m3": the dequantising
        kernels of both stacks too (the stacks' rows per scale row as `WeightLayout._moe` lays
        them out: min(128, I) for gate/up, 128 for down); "nvfp4": `dequant_nvfp4` of both stacks'
        K."""
        from runtime.model.gpu.weights import FP8_BLOCK, NVFP4

        h, e, k = config.hidden_size, config.num_experts, config.num_experts_per_tok
        inter = config.moe_intermediate_size
        shape = {"H": h, "E": e, "K": k, "I": inter}
        keys = {kind: find(library, "moe_grouped", kind=kind, **shape) for kind in ("perm", "gather", "combine")}
        keys["gate_up"] = find(library, "moe_grouped", kind="gemm", proj="gate_up", E1=e + 1, N=2 * inter, K=h)
        keys["down"] = find(library, "moe_grouped", kind="gemm", proj="down", E1=e + 1, N=h, K=inter)
        keys["silu"] = find(library, "silu_mul", I=inter)
        family = "dequant_nvfp4" if expert_format == NVFP4 else "dequant_weights"
        if expert_format == NVFP4:
            keys["dequant_gate_up"] = find(library, family, K=h)
            keys["dequant_down"] = find(library, family, K=inter)
        elif expert_format != "bf16":
            keys["dequant_gate_up"] = find(library, family, format=expert_format, K=h, BR=min(FP8_BLOCK, inter))
            keys["dequant_down"] = find(library, family, format=expert_format, K=inter, BR=FP8_BLOCK)
        if not all(keys.values()):
            return None
        bm = library.manifest.kernels[("moe_grouped", keys["perm"])].config["BM"]
        return cls(**keys, bm=bm, slots=k + 1, experts=e + 1, dequant_family=family)

    def required(self) -> list[tuple[str, str]]:
        dequant = [(self.dequant_family, key) for key in (self.dequant_gate_up, self.dequant_down) if key]
        return [("moe_grouped", self.perm), ("moe_grouped", self.gather), ("moe_grouped", self.gate_up),
                ("silu_mul", self.silu), ("moe_grouped", self.down), ("moe_grouped", self.combine), *dequant]

    def capacity(self, rows: int) -> int:
        """Rows of the permuted buffers for `rows` rows: every (row, slot) entry plus bm - 1
        padding rows per segment that can be non-empty, in whole tiles (the `perm` kernel's
        launch rule; cute_kernels/moe_grouped.capacity)."""
        entries = rows * self.slots
        return -(-(entries + min(self.experts, entries) * (self.bm - 1)) // self.bm) * self.bm

    def buffer_sizes(self, rows: int, hidden: int, inter: int) -> dict[str, int]:
        """Bytes of each workspace buffer for steps of up to `rows` rows."""
        c = self.capacity(rows)
        sizes = {"moe_pos": rows * self.slots * 4, "moe_src": c * 4, "moe_tiles": (c // self.bm + 1) * 4,
                 "moe_rows": c * hidden * 4, "moe_gu": c * 2 * inter * 2, "moe_gact": c * inter * 2}
        if self.dequant_gate_up:
            sizes["moe_dequant"] = self.experts * 3 * inter * hidden * 2  # one layer's stacks in bf16
        return sizes

    def bind(self, forward: Any, out: list, m: int, layer: dict, route: dict[str, int]) -> None:
        """The launches after routing, for m rows of `buf["h"]`, into `buf["delta"]`."""
        buf = forward.storage.buf
        c = self.capacity(m)
        rows = {"M": m, "C": c}
        gate_up, down = forward.w(layer["experts_gate_up"]), forward.w(layer["experts_down"])
        if self.dequant_gate_up:
            gate_up_slot, down_slot = layer["experts_gate_up"], layer["experts_down"]
            gate_up, down = buf["moe_dequant"], buf["moe_dequant"] + gate_up_slot.shape[0] * gate_up_slot.shape[1] * 2
            for key, slot, dst in ((self.dequant_gate_up, gate_up_slot, gate_up), (self.dequant_down, down_slot, down)):
                # The format's scales (NVFP4: the per-row globals too); dequant_nvfp4's rows are its size N.
                args = {"w": forward.w(slot), **forward.scales(slot), "out": dst}
                rows_size = "N" if self.dequant_family == "dequant_nvfp4" else "R"
                forward.launch(out, self.dequant_family, key, args, {rows_size: slot.shape[0]})
        forward.launch(out, "moe_grouped", self.perm, {"ids": route["ids"], "pos": buf["moe_pos"],
                                                       "src": buf["moe_src"], "tiles": buf["moe_tiles"]}, rows)
        forward.launch(out, "moe_grouped", self.gather, {"x": buf["h"], "src": buf["moe_src"],
                                                         "tiles": buf["moe_tiles"], "xg": buf["moe_rows"]}, rows)
        forward.launch(out, "moe_grouped", self.gate_up, {"x": buf["moe_rows"], "w": gate_up,
                                                          "tiles": buf["moe_tiles"], "out": buf["moe_gu"]}, {"C": c})
        forward.launch(out, "silu_mul", self.silu, {"x": buf["moe_gu"], "out": buf["moe_gact"]}, {"M": c})
        forward.launch(out, "moe_grouped", self.down, {"x": buf["moe_gact"], "w": down,
                                                       "tiles": buf["moe_tiles"], "out": buf["moe_rows"]}, {"C": c})
        forward.launch(out, "moe_grouped", self.combine, {"dn": buf["moe_rows"], "pos": buf["moe_pos"],
                                                          "wts": route["wts"], "out": buf["delta"]}, rows)
