"""The arithmetic of `bench/step_breakdown.py`, apart from the GPU: what each launch of a step is
(kernel family, the part of the model it belongs to), the bytes it must move where they follow from
its key, and the table grouped by part and family against the step's captured-graph time.

Parts. A step's launch list is the forward pass in order (`layers.Forward.bind`): the embedding,
then per layer its input norm, mixer, post norm, MLP, then the final norm and the lm_head; the
MTP head and its chain add device copies and the sampler. The hidden norms (`rmsnorm` launches of
the runner's `norm` / `add_norm` keys) split the list into segments, and a segment is named for
the families in it: "gdn" (conv1d, gdn, gdn_chunked), "attention" (attention, attention_prefill,
attention_wgmma), "moe_mlp" (moe, moe_grouped), "dense_mlp" (silu_mul alone), else "projection"
(the MTP head's fc). Some launches are named on their own whatever their segment: "norms", "lm_head"
(a linear whose key names the lm_head), "embedding", "sampling" and "copies" (device copies, which
are not kernels).

Bytes (`launch_bytes`): a linear's weight (N x K at 2, 1 or 0.5 bytes a value for gemv / gemm_sm90,
gemv_fp8, gemv_nvfp4, scales left out) plus its bf16 input rows and its output rows (bf16, or fp32
for the router's GEMM); the MoE kernels' router
and expert weights, counting min(M x k, E) routed experts + the shared one read once each (exact at
one row, an upper bound where rows share experts), plus their activation rows. Other launches:
unknown (None), left out of the bandwidth column.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

from runtime.cuda.manifest import DTYPE_BYTES

MIXERS = {"conv1d": "gdn", "gdn": "gdn", "gdn_chunked": "gdn", "attention": "attention",
          "attention_prefill": "attention", "attention_wgmma": "attention", "moe": "moe_mlp",
          "moe_grouped": "moe_mlp", "silu_mul": "dense_mlp"}
SEGMENT_ORDER = ("gdn", "attention", "moe_mlp", "dense_mlp")  # the first present names a segment
LINEAR_BYTES = {"gemv": 2.0, "gemm_sm90": 2.0, "gemv_fp8": 1.0, "gemv_nvfp4": 0.5}
COPY = "copy"  # the family of a launch that is not a kernel (a device copy)


@dataclass(frozen=True)
class LaunchInfo:
    """One launch of a step: kernel family and variant key ("copy" and its class name for a
    device copy) and its rows M (None where it takes no M)."""

    family: str
    key: str
    rows: int | None
    out_bytes: int = 2  # bytes of an output value (a linear's: 4 for an FP32-out GEMM)


def describe(launch: Any) -> LaunchInfo:
    """The `LaunchInfo` of a bound kernel launch (`runtime.cuda.kernels.BoundLaunch`) or a device
    copy of a step's list (`gpu.mtp_chain.DeviceCopy`, `DeviceCopy2D`)."""
    from runtime.cuda.kernels import BoundLaunch

    if not isinstance(launch, BoundLaunch):
        return LaunchInfo(COPY, type(launch).__name__, None)
    entry = launch.kernel.entry
    out = entry.tensors.get("out")
    return LaunchInfo(entry.family, entry.key, launch.sizes.get("M"), DTYPE_BYTES[out.dtype] if out else 2)


def parts(infos: Sequence[LaunchInfo], norm_keys: Sequence[str]) -> list[str]:
    """The part of the model each launch belongs to (module docstring)."""
    out: list[str] = []
    segment: list[int] = []

    def close() -> None:
        names = {MIXERS[infos[i].family] for i in segment if infos[i].family in MIXERS}
        name = next((n for n in SEGMENT_ORDER if n in names), "projection")
        for i in segment:
            out[i] = name
        segment.clear()

    for i, info in enumerate(infos):
        own = _own_part(info, norm_keys)
        out.append(own or "")
        if own == "norms":
            close()
        elif own is None:
            segment.append(i)
    close()
    return out


def _own_part(info: LaunchInfo, norm_keys: Sequence[str]) -> str | None:
    if info.family == COPY:
        return "copies"
    if info.family == "rmsnorm" and info.key in norm_keys:
        return "norms"
    if info.family in LINEAR_BYTES and "lm_head" in info.key:
        return "lm_head"
    if info.family in ("embedding", "sampling"):
        return info.family
    return None


def _numbers(key: str, names: str) -> dict[str, int] | None:
    """{name: value} of `_<name><digits>` fields of a variant key, or None where one is missing."""
    found = {}
    for name in names:
        match = re.search(rf"(?:^|_){name}(\d+)(?:_|$)", key)
        if match is None:
            return None
        found[name] = int(match.group(1))
    return found


def launch_bytes(info: LaunchInfo) -> int | None:
    """Bytes the launch must move at least (module docstring), or None where not known."""
    m = info.rows
    if m is None:
        return None
    if info.family in LINEAR_BYTES:
        nk = _numbers(info.key, "nk")
        if nk is None:
            return None
        n, k = nk["n"], nk["k"]
        return int(n * k * LINEAR_BYTES[info.family]) + 2 * m * k + info.out_bytes * m * n
    if info.family != "moe":
        return None
    kind = info.key.split("_h")[0].split("_e")[0]
    if kind in ("logits", "logits_wide"):
        he = _numbers(info.key, "eh")
        return None if he is None else he["e"] * he["h"] * 2 + m * he["h"] * 2 + m * he["e"] * 4
    shape = _numbers(info.key, "heki")
    if shape is None:
        return None
    h, e, k, inter = shape["h"], shape["e"], shape["k"], shape["i"]
    experts = min(m * k, e) + 1
    if kind in ("up", "up_wide", "route_up"):
        return experts * 2 * inter * h * 2 + m * h * 2 + m * (k + 1) * inter * 2
    if kind in ("down", "down_wide"):
        return experts * h * inter * 2 + m * (k + 1) * inter * 2 + m * h * 2
    return None


def summarize(infos: Sequence[LaunchInfo], names: Sequence[str], us: Sequence[float], graph_us: float | None,
              copy_bw: float | None) -> dict[str, Any]:
    """The table of one step: rows per (part, family) with count, µs, % of the summed launches,
    bytes and GB/s and % of the copy bandwidth (where every launch of the row has known bytes),
    largest first; and the summed launches against the graph's step time (the gap: what the
    graph's launches cost beyond the kernels alone; negative where the kernels overlap less
    alone than in the graph, or run warmer)."""
    if not len(infos) == len(names) == len(us):
        raise ValueError(f"{len(infos)} launches, {len(names)} parts and {len(us)} times: one of each per launch")
    total = float(sum(us))
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for info, name, t in zip(infos, names, us):
        row = groups.setdefault((name, info.family), {"part": name, "family": info.family, "count": 0, "us": 0.0,
                                                     "bytes": 0, "keys": set()})
        row["count"] += 1
        row["us"] += float(t)
        row["keys"].add(info.key)
        b = launch_bytes(info)
        row["bytes"] = None if b is None or row["bytes"] is None else row["bytes"] + b
    rows = []
    for row in sorted(groups.values(), key=lambda r: -r["us"]):
        row["keys"] = sorted(row["keys"])
        row["pct"] = 100.0 * row["us"] / total if total else 0.0
        rate = row["bytes"] / (row["us"] * 1e-6) if row["bytes"] is not None and row["us"] > 0 else None
        row["gb_s"] = rate / 1e9 if rate is not None else None
        row["pct_copy_bw"] = 100.0 * rate / copy_bw if rate is not None and copy_bw else None
        rows.append(row)
    by_part: dict[str, float] = {}
    for name, t in zip(names, us):
        by_part[name] = by_part.get(name, 0.0) + float(t)
    return {"launches": len(infos), "sum_us": total, "graph_us": graph_us,
            "gap_us": graph_us - total if graph_us is not None else None, "copy_bw_gb_s": copy_bw / 1e9 if copy_bw else None,
            "rows": rows, "parts": dict(sorted(by_part.items(), key=lambda item: -item[1]))}


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def render(title: str, summary: dict[str, Any]) -> str:
    """Markdown of one step's `summarize` result."""
    s = summary
    lines = [f"### {title}", "",
             f"{s['launches']} launches; summed {s['sum_us']:.1f} µs; captured graph "
             f"{_cell(s['graph_us'], '.1f')} µs a step; gap (graph - sum) {_cell(s['gap_us'], '+.1f')} µs", "",
             "| part | µs | % |", "|---|---:|---:|"]
    lines += [f"| {name} | {t:.1f} | {100.0 * t / s['sum_us'] if s['sum_us'] else 0.0:.1f} |"
              for name, t in s["parts"].items()]
    lines += ["", "| part | family | count | µs | % of step | MB | GB/s | % of copy BW |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in s["rows"]:
        mb = r["bytes"] / 1e6 if r["bytes"] is not None else None
        lines.append(f"| {r['part']} | {r['family']} | {r['count']} | {r['us']:.1f} | {r['pct']:.1f} | "
                     f"{_cell(mb, '.2f')} | {_cell(r['gb_s'], '.0f')} | {_cell(r['pct_copy_bw'], '.0f')} |")
    return "\n".join(lines)
