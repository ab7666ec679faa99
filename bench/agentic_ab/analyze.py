"""Analysis of one seed's run (`analyze(seed_dir)`) and of several (`aggregate(out_dir)`).

Per arm it joins the client rows (client.jsonl) with the server's request log where the arm
has one (Infernix `--request-log`: `request_done` lines, joined on `seed`, else on `tag`);
aborted attempts and the warm-up are left out. Server counts win over the client's usage;
a server that reports no cached tokens counts as 0 cached. TTFT is the server's (`ttft_s`,
from request received) when every arm has a log that covers every request, else the client's
clock (first token - send) for all arms, so arms are always compared on one clock.

Request metrics get 95 % block-bootstrap intervals over blocks of BLOCK consecutive requests
(by send time); a change against the control resamples the same blocks of the requests both
arms ran (paired). Output tok/s at k in flight comes from the client's timeline: segments
where exactly k requests were in flight and all k were decoding, each request assumed to
stream its tokens evenly between its first token and its end; resampled in blocks of BLOCK
segments. Writes summary.json and report.md (bench.agentic_ab.report).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from bench.agentic_ab import report
from bench.agentic_ab.stats import Resamples, independent_interval

BLOCK = 10
GROUPS = {"loop": "continuing", "after_idle": "continuing", "after_edit": "continuing",
          "retry": "continuing", "abort_retry": "continuing", "subagent_loop": "continuing",
          "report": "continuing", "final": "continuing", "cold_resume": "new_long",
          "compaction": "new_long", "check": "new_long", "subagent_first": "subagent_first",
          "restart": "restart"}
COLD_MIN_TOKENS = 4096  # at scale 1: prompts this long with no cache hit time the prefill
MIN_ROWS = 5  # a metric over fewer requests (a class seen once) gets no interval


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class ArmRun:
    name: str
    info: dict  # arm.json
    rows: list[dict]  # joined, measured requests, by send time
    timeline: list[dict]  # every client row, aborted ones included (they hold the server)
    server_log: bool
    unmatched: int  # measured rows the server log does not have


def load_arm(seed_dir: Path, name: str) -> ArmRun:
    arm_dir = seed_dir / name
    info = json.loads((arm_dir / "arm.json").read_text()) if (arm_dir / "arm.json").exists() \
        else {"errors": [f"{name}: no arm.json (the arm did not run)"]}
    client = read_jsonl(arm_dir / "client.jsonl")
    log_path = arm_dir / "request_log.jsonl"
    done = [r for r in read_jsonl(log_path) if r.get("event") == "request_done"]
    by_seed = {r["seed"]: r for r in done if r.get("seed") is not None}
    by_tag = {r["tag"]: r for r in done if r.get("tag")}
    rows, unmatched = [], 0
    for row in client:
        if row["aborted"]:
            continue
        server = by_seed.get(row["seed"]) or by_tag.get(row["tag"])
        unmatched += bool(done) and server is None
        source = server if server is not None else row
        prompt = source.get("prompt_tokens") or 0
        cached = source.get("cached_tokens") or 0
        client_ttft = None if row["t_first"] is None else row["t_first"] - row["t_send"]
        rows.append({**row, "prompt": prompt, "cached": cached, "prefilled": prompt - cached,
                     "completion": source.get("completion_tokens") or 0,
                     "client_ttft": client_ttft,
                     "server_ttft": None if server is None else server.get("ttft_s"),
                     "queue": None if server is None else server.get("queue_wait_s"),
                     "group": GROUPS.get(row["class"], row["class"])})
    rows.sort(key=lambda r: r["t_send"])
    return ArmRun(name, info, rows, client, bool(done), unmatched)


class Columns:
    """The joined rows as numpy columns, so a statistic over bootstrap indices is cheap."""

    def __init__(self, rows: list[dict], server_clock: bool, cold_seeds: set[int]):
        def column(key, default=np.nan):
            return np.array([default if r.get(key) is None else r[key] for r in rows],
                            dtype=float)
        self.n = len(rows)
        self.ttft = column("server_ttft" if server_clock else "client_ttft")
        self.prefill_s = self.ttft - (np.nan_to_num(column("queue"), nan=0.0) if server_clock
                                      else 0.0)
        self.prompt, self.cached = column("prompt", 0), column("cached", 0)
        self.prefilled = self.prompt - self.cached
        self.cls = np.array([r["class"] for r in rows])
        self.group = np.array([r["group"] for r in rows])
        self.main = np.array([r["main"] for r in rows], dtype=bool)
        self.cold = np.array([r["seed"] in cold_seeds for r in rows], dtype=bool)


def _masked_mean(values: np.ndarray, mask: np.ndarray) -> float:
    chosen = values[mask]
    chosen = chosen[np.isfinite(chosen)]
    return float(np.mean(chosen)) if len(chosen) else float("nan")


def _ratio(top: float, bottom: float) -> float:
    return top / bottom if bottom else float("nan")


def _finite(values: np.ndarray) -> np.ndarray:
    return values[np.isfinite(values)]


def _quantile(values: np.ndarray, q: float) -> float:
    finite = _finite(values)
    return float(np.percentile(finite, q)) if len(finite) else float("nan")


@dataclass
class Metric:
    key: str
    label: str
    unit: str  # s, tok, %, tok/s, count
    change: str  # rel (percent), points, abs
    value: Callable[[Columns, np.ndarray], float]
    rows: Callable[[Columns], np.ndarray] | None = None  # the requests it is computed over


def _covered(metric: Metric, columns: Columns) -> int:
    return columns.n if metric.rows is None else int(np.sum(metric.rows(columns)))


def _ttft_of(key: str, label: str, field: str, name: str) -> Metric:
    return Metric(key, label, "s", "rel",
                  lambda c, i: _masked_mean(c.ttft[i], getattr(c, field)[i] == name),
                  lambda c: getattr(c, field) == name)


REQUEST_METRICS = [
    Metric("ttft_mean", "TTFT, mean", "s", "rel",
           lambda c, i: float(np.mean(_finite(c.ttft[i]))) if len(_finite(c.ttft[i]))
           else float("nan")),
    Metric("ttft_median", "TTFT, median", "s", "rel", lambda c, i: _quantile(c.ttft[i], 50)),
    Metric("ttft_p90", "TTFT, p90", "s", "rel", lambda c, i: _quantile(c.ttft[i], 90)),
    _ttft_of("ttft_continuing", "TTFT, continuing turns", "group", "continuing"),
    _ttft_of("ttft_new_long", "TTFT, new long prompts", "group", "new_long"),
    _ttft_of("ttft_subagent_first", "TTFT, subagent first turns", "group", "subagent_first"),
    _ttft_of("ttft_retry", "TTFT, user retries", "cls", "retry"),
    _ttft_of("ttft_after_edit", "TTFT, after a history edit", "cls", "after_edit"),
    Metric("cached_share", "prompt tokens served from cache", "%", "points",
           lambda c, i: 100 * _ratio(c.cached[i].sum(), c.prompt[i].sum())),
    Metric("prompt_tokens", "prompt tokens", "tok", "rel", lambda c, i: float(c.prompt[i].sum())),
    Metric("cached_tokens", "prompt tokens from cache", "tok", "rel",
           lambda c, i: float(c.cached[i].sum())),
    Metric("prefilled_tokens", "prompt tokens prefilled", "tok", "rel",
           lambda c, i: float(c.prefilled[i].sum())),
    Metric("full_reprefill_main", "continuing main-session turns that re-prefilled the whole "
           "prompt", "count", "abs",
           lambda c, i: float(np.sum(c.main[i] & (c.group[i] == "continuing") &
                                     (c.cached[i] == 0)))),
    Metric("full_reprefill_subagent", "subagent turns after the first that re-prefilled the "
           "whole prompt", "count", "abs",
           lambda c, i: float(np.sum((c.cls[i] == "subagent_loop") & (c.cached[i] == 0)))),
    Metric("cold_prefill_tok_s", "prefill tok/s with no cache hit (matched cold prompts)",
           "tok/s", "rel",
           lambda c, i: _ratio(c.prefilled[i][c.cold[i]].sum(),
                               np.nansum(c.prefill_s[i][c.cold[i]])), lambda c: c.cold),
]
COUNT_DENOMINATORS = {"full_reprefill_main": lambda c: int(np.sum(
    c.main & (c.group == "continuing"))), "full_reprefill_subagent": lambda c: int(np.sum(
        c.cls == "subagent_loop"))}


def decode_segments(timeline: list[dict], k: int) -> np.ndarray:
    """(seconds, tokens) of the timeline's segments where exactly k requests were in flight
    and all k were past their first token."""
    requests = [r for r in timeline if r["t_done"] is not None]
    edges = sorted({t for r in requests for t in (r["t_send"], r["t_first"], r["t_done"])
                    if t is not None})
    rates = {id(r): (r["completion_tokens"] - 1) / (r["t_done"] - r["t_first"])
             for r in requests if r["t_first"] is not None and (r["completion_tokens"] or 0) > 1
             and r["t_done"] > r["t_first"]}
    out = []
    for start, end in zip(edges, edges[1:]):
        mid = (start + end) / 2
        flying = [r for r in requests if r["t_send"] <= mid < r["t_done"]]
        decoding = [r for r in flying if id(r) in rates and r["t_first"] <= mid]
        if len(flying) == k and len(decoding) == k:
            out.append((end - start, sum(rates[id(r)] for r in decoding) * (end - start)))
    return np.array(out, dtype=float).reshape(-1, 2)


def _rate(segments: np.ndarray) -> Callable[[np.ndarray], float]:
    return lambda i: _ratio(segments[i, 1].sum(), segments[i, 0].sum())


def _change(kind: str, arm: float, control: float) -> float:
    if kind == "rel":
        return 100 * (arm / control - 1) if control else float("nan")
    return arm - control


def _clean(value: float) -> float | None:
    return None if value is None or not np.isfinite(value) else round(float(value), 4)


def _entry(value: float, ci) -> dict:
    return {"value": _clean(value), "lo": _clean(ci[0]) if ci else None,
            "hi": _clean(ci[1]) if ci else None}


def analyze(seed_dir: Path) -> dict:
    seed_dir = Path(seed_dir)
    run = json.loads((seed_dir / "run.json").read_text())
    plan = json.loads((seed_dir / "plan.json").read_text())
    names, control = run["arms"], run["control"]
    arms = {name: load_arm(seed_dir, name) for name in names}
    errors = [e for arm in arms.values() for e in arm.info.get("errors", [])]
    warnings = [w for arm in arms.values() for w in arm.info.get("warnings", [])]
    planned = sum(1 for a in plan["actors"].values() for s in a["steps"]
                  if "seed" in s and "abort_after_s" not in s)
    for arm in arms.values():
        failed = [r for r in arm.rows if r["error"]]
        errors += [f"{arm.name}: {r['tag']} failed: {r['error']}" for r in failed]
        if len(arm.rows) != planned:
            errors.append(f"{arm.name}: {len(arm.rows)} of {planned} planned requests ran")
        if arm.unmatched:
            warnings.append(f"{arm.name}: {arm.unmatched} requests missing from the server log")
    server_clock = all(a.server_log and not a.unmatched for a in arms.values())
    cold_min = max(64, int(COLD_MIN_TOKENS * plan["scale"]))
    seed_sets = [{r["seed"] for r in a.rows if r["cached"] == 0 and r["prompt"] >= cold_min
                  and not r["error"]} for a in arms.values()]
    cold = set.intersection(*seed_sets) if seed_sets else set()
    columns = {name: Columns(a.rows, server_clock, cold) for name, a in arms.items()}

    summary = {"seed": plan["seed"], "scale": plan["scale"], "control": control,
               "arms_order": run.get("order", names), "api": run.get("api"),
               "scripted_lengths": run.get("scripted_lengths"), "source": plan["source"],
               "ttft_clock": "server" if server_clock else "client", "planned": planned,
               "cold_min_tokens": cold_min, "cold_requests": len(cold), "arms": {},
               "changes": {}, "classes": {}}
    segments = {name: {k: decode_segments(a.timeline, k) for k in (1, 2)}
                for name, a in arms.items()}
    for name, arm in arms.items():
        c = columns[name]
        every, samples = np.arange(c.n), Resamples(c.n, BLOCK)
        metrics = {m.key: _entry(m.value(c, every), samples.interval(
            lambda i, m=m: m.value(c, i)) if _covered(m, c) >= MIN_ROWS else None)
            for m in REQUEST_METRICS}
        for k in (1, 2):
            seg = segments[name][k]
            metrics[f"output_tok_s_{k}"] = _entry(_rate(seg)(np.arange(len(seg))), Resamples(
                len(seg), BLOCK).interval(_rate(seg)))
        metrics["wall_s"] = _entry(arm.info.get("wall_s", float("nan")), None)
        summary["arms"][name] = {
            "command": arm.info.get("command"), "server_log": arm.server_log,
            "requests": c.n, "failed": sum(1 for r in arm.rows if r["error"]),
            "completion_tokens": int(sum(r["completion"] for r in arm.rows)),
            "denominators": {k: f(c) for k, f in COUNT_DENOMINATORS.items()},
            "metrics": metrics}
        summary["classes"][name] = {
            cls: {"n": int(np.sum(c.cls == cls)),
                  "ttft_mean": _clean(_masked_mean(c.ttft, c.cls == cls)),
                  "cached_share": _clean(100 * _ratio(c.cached[c.cls == cls].sum(),
                                                      c.prompt[c.cls == cls].sum()))}
            for cls in sorted(set(c.cls))}
    for name in names:
        if name != control:
            summary["changes"][name] = _changes(arms[name], arms[control], server_clock, cold,
                                                segments[name], segments[control])
    summary["errors"], summary["warnings"] = errors, warnings
    summary["valid"] = not errors
    (seed_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (seed_dir / "report.md").write_text(report.render(summary, {n: a.rows for n, a in
                                                                arms.items()}))
    return summary


def _changes(arm: ArmRun, control: ArmRun, server_clock: bool, cold: set[int],
             arm_segments: dict, control_segments: dict) -> dict:
    """Each metric's change against the control, on the requests both arms ran (paired by
    seed, blocks by the control's send order)."""
    by_seed = {r["seed"]: r for r in arm.rows}
    paired_control = [r for r in control.rows if r["seed"] in by_seed]
    a = Columns([by_seed[r["seed"]] for r in paired_control], server_clock, cold)
    c = Columns(paired_control, server_clock, cold)
    every, samples = np.arange(c.n), Resamples(c.n, BLOCK)
    out = {}
    for m in REQUEST_METRICS:
        def change(i, m=m):
            return _change(m.change, m.value(a, i), m.value(c, i))
        ci = samples.interval(change) if _covered(m, c) >= MIN_ROWS else None
        out[m.key] = {**_entry(change(every), ci), "kind": m.change}
    for k in (1, 2):
        sa, sc = arm_segments[k], control_segments[k]
        value = _change("rel", _rate(sa)(np.arange(len(sa))), _rate(sc)(np.arange(len(sc))))
        ci = independent_interval(Resamples(len(sa), BLOCK), _rate(sa), Resamples(
            len(sc), BLOCK, seed=1), _rate(sc), lambda x, y: _change("rel", x, y))
        out[f"output_tok_s_{k}"] = {**_entry(value, ci), "kind": "rel"}
    out["wall_s"] = {**_entry(_change("rel", arm.info.get("wall_s", np.nan),
                                      control.info.get("wall_s", np.nan)), None), "kind": "rel"}
    return out


def aggregate(out_dir: Path) -> dict:
    """Seeds combined: per arm and metric the mean over seeds with min-max; per change the
    mean of each seed's change against that seed's control, with min-max."""
    out_dir = Path(out_dir)
    seeds = [json.loads(p.read_text()) for p in sorted(out_dir.glob("seed-*/summary.json"))]
    if not seeds:
        raise FileNotFoundError(f"no seed-*/summary.json under {out_dir}")

    def spread(values):
        values = [v for v in values if v is not None]
        if not values:
            return {"value": None, "lo": None, "hi": None}
        return {"value": round(float(np.mean(values)), 4), "lo": min(values), "hi": max(values)}

    first = seeds[0]
    combined = {"seeds": [s["seed"] for s in seeds], "scale": first["scale"],
                "control": first["control"], "api": first["api"],
                "scripted_lengths": first["scripted_lengths"], "source": first["source"],
                "ttft_clock": "/".join(sorted({s["ttft_clock"] for s in seeds})),
                "valid": all(s["valid"] for s in seeds),
                "errors": [f"seed {s['seed']}: {e}" for s in seeds for e in s["errors"]],
                "warnings": [f"seed {s['seed']}: {w}" for s in seeds for w in s["warnings"]],
                "arms": {}, "changes": {}}
    for name, arm in first["arms"].items():
        combined["arms"][name] = {
            "command": arm["command"], "requests": sum(s["arms"][name]["requests"] for s in seeds),
            "metrics": {key: spread([s["arms"][name]["metrics"][key]["value"] for s in seeds])
                        for key in arm["metrics"]}}
    for name, changes in first["changes"].items():
        combined["changes"][name] = {
            key: {**spread([s["changes"][name][key]["value"] for s in seeds]),
                  "kind": entry["kind"]} for key, entry in changes.items()}
    (out_dir / "summary.json").write_text(json.dumps(combined, indent=1) + "\n")
    (out_dir / "report.md").write_text(report.render_aggregate(combined))
    return combined
