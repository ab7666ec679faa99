"""report.md from a summary (bench.agentic_ab.analyze): the validity verdict first, then the
headline table (one column per arm, one per change against the control, with 95 % intervals),
the table by request class and the per-request detail."""

from __future__ import annotations

HEADLINE = [
    ("ttft_mean", "TTFT, mean"), ("ttft_median", "TTFT, median"), ("ttft_p90", "TTFT, p90"),
    ("ttft_continuing", "TTFT, continuing turns"), ("ttft_new_long", "TTFT, new long prompts"),
    ("ttft_subagent_first", "TTFT, subagent first turns"), ("ttft_retry", "TTFT, user retries"),
    ("ttft_after_edit", "TTFT, after a history edit"),
    ("cached_share", "prompt tokens served from cache"), ("prompt_tokens", "prompt tokens"),
    ("cached_tokens", "prompt tokens from cache"), ("prefilled_tokens", "prompt tokens prefilled"),
    ("full_reprefill_main", "main-session continuing turns that re-prefilled the whole prompt"),
    ("full_reprefill_subagent", "subagent turns that re-prefilled the whole prompt"),
    ("cold_prefill_tok_s", "prefill tok/s, no cache hit"),
    ("output_tok_s_1", "output tok/s, one request in flight"),
    ("output_tok_s_2", "output tok/s, two requests in flight"),
    ("wall_s", "workload wall time"),
]
UNITS = {"cached_share": "%", "prompt_tokens": "", "cached_tokens": "", "prefilled_tokens": "",
         "full_reprefill_main": "", "full_reprefill_subagent": "", "cold_prefill_tok_s": "",
         "output_tok_s_1": "", "output_tok_s_2": ""}


def _number(value, key: str) -> str:
    if value is None:
        return "–"
    unit = UNITS.get(key, " s")
    if key.startswith("ttft") or key == "wall_s":
        return f"{value:.3f}{unit}" if abs(value) < 10 else f"{value:.1f}{unit}"
    if key == "cached_share":
        return f"{value:.1f} %"
    if key.startswith("full_reprefill"):
        return f"{value:.0f}"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.1f}"


def _cell(entry: dict, key: str) -> str:
    text = _number(entry["value"], key)
    if entry.get("lo") is not None:
        text += f" [{_number(entry['lo'], key)}, {_number(entry['hi'], key)}]"
    return text


def _change_cell(entry: dict) -> str:
    def fmt(v):
        if entry["kind"] == "rel":
            return f"{v:+.1f} %"
        if entry["kind"] == "points":
            return f"{v:+.1f} pt"
        return f"{v:+.0f}"
    if entry["value"] is None:
        return "–"
    text = fmt(entry["value"])
    if entry.get("lo") is not None:
        text += f" [{fmt(entry['lo'])}, {fmt(entry['hi'])}]"
    return text


def _verdict(summary: dict) -> list[str]:
    lines = [f"**Run valid: {'yes' if summary['valid'] else 'NO'}**", ""]
    if summary["errors"]:
        lines += ["Errors (any error makes the run invalid):", ""]
        lines += [f"- {e}" for e in summary["errors"]] + [""]
    if summary["warnings"]:
        lines += ["Validity warnings:", ""] + [f"- {w}" for w in summary["warnings"]] + [""]
    return lines


def _headline(summary: dict, interval_note: str) -> list[str]:
    arms, control = list(summary["arms"]), summary["control"]
    others = [a for a in arms if a != control]
    head = ["metric"] + [f"{a}{' (control)' if a == control else ''}" for a in arms] + \
        [f"{a} vs {control}" for a in others]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, label in HEADLINE:
        if key not in summary["arms"][control]["metrics"]:
            continue
        denominators = summary["arms"][control].get("denominators", {})
        suffix = f" (of {denominators[key]})" if key in denominators else ""
        cells = [_cell(summary["arms"][a]["metrics"][key], key) for a in arms]
        cells += [_change_cell(summary["changes"][a][key]) for a in others]
        lines.append(f"| {label}{suffix} | " + " | ".join(cells) + " |")
    return lines + ["", interval_note, ""]


def render(summary: dict, rows: dict[str, list[dict]]) -> str:
    arms, control = list(summary["arms"]), summary["control"]
    lines = [f"# agentic_ab: seed {summary['seed']}, scale {summary['scale']}", ""]
    lines += _verdict(summary)
    source = summary["source"]
    lines += [f"- source tree: `{source.get('path')}` at `{source.get('rev')}` "
              f"({source.get('files')} files)",
              f"- API: {summary['api']}; scripted lengths: {summary['scripted_lengths']}; "
              f"arm order: {', '.join(summary['arms_order'])}; control: {control}",
              f"- TTFT clock: {summary['ttft_clock']}; planned requests: {summary['planned']}; "
              f"matched cold prompts (no cache hit in any arm, >= {summary['cold_min_tokens']} "
              f"tokens): {summary['cold_requests']}", ""]
    for name in arms:
        arm = summary["arms"][name]
        lines.append(f"- `{name}`: {arm['requests']} requests, {arm['failed']} failed, "
                     f"{arm['completion_tokens']:,} output tokens, server log: "
                     f"{'yes' if arm['server_log'] else 'no'}; command `{arm['command']}`")
    lines += ["", "## Headline", ""]
    lines += _headline(summary, "Brackets: 95 % block-bootstrap intervals (blocks of 10 "
                       "consecutive requests, or of 10 decode segments; none with fewer than 5 "
                       "blocks). Changes are paired on the requests both arms ran; `rel` in %, "
                       "shares in points, counts as differences. Sampled text differs between "
                       "arms, so compare rates, shares and per-class means, not totals.")
    lines += ["## By request class", "", "| class | " + " | ".join(
        f"{a}: n, mean TTFT, cached" for a in arms) + " |", "|---|" + "---|" * len(arms)]
    classes = sorted({c for a in arms for c in summary["classes"][a]})
    for cls in classes:
        cells = []
        for a in arms:
            entry = summary["classes"][a].get(cls)
            cells.append("–" if entry is None else
                         f"{entry['n']}, {_number(entry['ttft_mean'], 'ttft')}, "
                         f"{_number(entry['cached_share'], 'cached_share')}")
        lines.append(f"| {cls} | " + " | ".join(cells) + " |")
    lines += ["", "## Requests", "", "| tag | class | " + " | ".join(
        f"{a}: prompt / cached / TTFT / out / finish" for a in arms) + " |",
        "|---|---|" + "---|" * len(arms)]
    by_tag = {a: {r["tag"]: r for r in rows[a]} for a in arms}
    for row in rows[control] or next(iter(rows.values())):
        cells = []
        for a in arms:
            r = by_tag[a].get(row["tag"])
            ttft = r and (r["server_ttft"] if summary["ttft_clock"] == "server"
                          else r["client_ttft"])
            cells.append("–" if r is None else
                         f"{r['prompt']:,} / {r['cached']:,} / {_number(ttft, 'ttft')} / "
                         f"{r['completion']} / {r['error'] or r['finish']}")
        lines.append(f"| {row['tag']} | {row['class']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_aggregate(combined: dict) -> str:
    lines = [f"# agentic_ab: seeds {', '.join(map(str, combined['seeds']))}, scale "
             f"{combined['scale']}", ""]
    lines += _verdict(combined)
    lines += [f"- API: {combined['api']}; scripted lengths: {combined['scripted_lengths']}; "
              f"control: {combined['control']}; TTFT clock: {combined['ttft_clock']}", ""]
    for name, arm in combined["arms"].items():
        lines.append(f"- `{name}`: {arm['requests']} requests; command `{arm['command']}`")
    lines += ["", "## Headline", ""]
    lines += _headline(combined, "Brackets: min-max over seeds of each seed's value (arms) and "
                       "of each seed's change against that seed's control (changes); values "
                       "are means over seeds. Per-seed reports with intervals: seed-*/report.md.")
    return "\n".join(lines) + "\n"
