"""What a verification step costs on `CudaRunner`, in decode steps (issue 14's target: a row
of 1 + 3 tokens at batch 1 within 1.15x one decode step).

A verification row is `StepRow(n = k + 1, logits="all", snapshots=[k + 1 spare slots])`: the
logits of every position and the recurrent state after each one. Both sides go through
`runner.step` and end with the logits on the host, so the ratio compares like with like: the
decode side is the same rows with n = 1 and no snapshots (the decode graph of that bucket).
Wall time of back-to-back steps over the same positions (the KV rows they write are rewritten
each round; cost does not depend on the values).
"""

from __future__ import annotations

from typing import Any

from bench.timing import wall_ms
from runtime.model.runner import StepRow
from runtime.model.sampling import RowSampling


def rows_for(batch: int, n: int, context: int, pages_per_row: int, spare: int, verify: bool,
             runner_vocab: int) -> list[StepRow]:
    """`batch` rows of `n` tokens from position `context`; a verification row's snapshots are
    the slots after the lanes, `n` per row."""
    out = []
    for b in range(batch):
        snaps = list(range(spare + b * n, spare + (b + 1) * n)) if verify else None
        out.append(StepRow(slot=b, token_ids=[(1000 + b + i) % runner_vocab for i in range(n)], start_pos=context,
                           page_table=list(range(b * pages_per_row, (b + 1) * pages_per_row)),
                           logits="all" if verify else "last", snapshots=snaps))
    return out


def step_ms(runner: Any, rows: list[StepRow], steps: int) -> float:
    """Wall milliseconds of one `runner.step(rows)` (`timing.wall_ms`)."""
    return wall_ms(steps, lambda: runner.step(rows))


def sampled_step_ms(runner: Any, rows: list[StepRow], steps: int) -> float:
    """Wall milliseconds of one `runner.step_sampled(rows)` with greedy rows: the step with every
    position's id picked on the device and only the ids read back (what the engine runs for a
    round without constraints, penalties or logprobs)."""
    def greedy() -> list[list[RowSampling]]:
        return [[RowSampling(greedy=True)] * row.num_tokens for row in rows]

    return wall_ms(steps, lambda: runner.step_sampled(rows, greedy))


def run(runner: Any, batches: list[int], drafts: list[int], context: int, pages_per_row: int,
        steps: int) -> list[dict[str, Any]]:
    """One result per (batch, k): ms of the decode step, of the verification step, and the ratio."""
    out = []
    for batch in batches:
        decode = step_ms(runner, rows_for(batch, 1, context, pages_per_row, runner.max_batch, False, runner.vocab_size), steps)
        for k in drafts:
            verify = step_ms(runner, rows_for(batch, k + 1, context, pages_per_row, runner.max_batch, True,
                                           runner.vocab_size), steps)
            out.append({"batch": batch, "draft_tokens": k, "context": context, "decode_ms": decode,
                        "verify_ms": verify, "decode_steps": verify / decode})
            print(out[-1], flush=True)
    return out


def render(results: list[dict[str, Any]]) -> str:
    lines = ["| batch | row | context | decode step ms | verification step ms | in decode steps |",
             "|---:|---|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['batch']} | 1+{r['draft_tokens']} | {r['context']} | {r['decode_ms']:.2f} | "
                     f"{r['verify_ms']:.2f} | {r['decode_steps']:.2f}x |")
    return "\n".join(lines)
