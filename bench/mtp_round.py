"""What a speculative round with k MTP drafts costs on `CudaRunner`, in decode steps (issue 21's
target at the 27B shape, BF16: k = 3 within 1.2x a decode step at batch 1, 1.4x at batch 8).

A round is what the engine runs per decode unit (`runtime.engine.speculative`): `mtp_draft` (the
head caught up over the verified positions of the round before, then chained k times), one
verification step of 1 + k tokens per row with every logit row on the host, and `commit`. The
catch-up covers all 1 + k positions of the last verification row, as after a round that accepted
every draft (the most rows it can take); a decode step is the same rows with one token each
(`verify_step.rows_for`). Wall time of back-to-back rounds over the same positions.

Synthetic weights draft noise, so acceptance is not measured here: `projected_tok_s` is the decode
speed a round would give at `TOKENS_PER_ROUND` tokens per round at k = 3 (the acceptance published
for this model family's MTP head, bonus token included): assumed, not measured.
"""

from __future__ import annotations

import time
from typing import Any

from bench.verify_step import rows_for, wall_ms
from runtime.model.runner import MtpRow

TOKENS_PER_ROUND = {3: 2.5}  # assumed acceptance (issue 21: about 2.5 tokens a round at k = 3)


def _timed(steps: int, work) -> float:
    work()  # capture / warm-up
    work()
    t0 = time.perf_counter()
    for _ in range(steps):
        work()
    return (time.perf_counter() - t0) / steps * 1e3


def run(runner: Any, batches: list[int], drafts: list[int], context: int, pages_per_row: int,
        steps: int) -> list[dict[str, Any]]:
    """One result per (batch, k): ms of a decode step, of the drafting alone, of a whole round,
    and the round in decode steps."""
    out = []
    for batch in batches:
        decode = wall_ms(runner, rows_for(batch, 1, context, pages_per_row, runner.max_batch, False, runner.vocab_size),
                         steps)
        for k in drafts:
            verify = rows_for(batch, k + 1, context, pages_per_row, runner.max_batch, True, runner.vocab_size)
            # The positions the verification rows keep, paired with the tokens after them.
            mtp = [MtpRow(row.slot, [(t + 1) % runner.vocab_size for t in row.token_ids], context, row.page_table, k)
                   for row in verify]
            runner.step(verify)  # the kept hidden rows the first draft reads

            def draft() -> None:
                runner.mtp_draft(mtp)

            def round_() -> None:
                runner.mtp_draft(mtp)
                runner.step(verify)
                for row in verify:
                    runner.commit(row.slot, row.snapshots[0])  # noise drafts: the first position kept

            draft_ms = _timed(steps, draft)
            round_ms = _timed(steps, round_)
            result = {"batch": batch, "draft_tokens": k, "context": context, "decode_ms": decode, "draft_ms": draft_ms,
                      "round_ms": round_ms, "decode_steps": round_ms / decode}
            if k in TOKENS_PER_ROUND:
                result["assumed_tokens_per_round"] = TOKENS_PER_ROUND[k]
                result["projected_tok_s"] = batch * TOKENS_PER_ROUND[k] / round_ms * 1e3
                result["plain_tok_s"] = batch / decode * 1e3
            out.append(result)
            print(result, flush=True)
    return out


def render(results: list[dict[str, Any]]) -> str:
    lines = ["| batch | k | context | decode step ms | drafting ms | round ms | round in decode steps | "
             "plain tok/s | projected tok/s (assumed tokens/round) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        projected = (f"{r['projected_tok_s']:.1f} ({r['assumed_tokens_per_round']})" if "projected_tok_s" in r
                     else "n/a")
        plain = f"{r['plain_tok_s']:.1f}" if "plain_tok_s" in r else "n/a"
        lines.append(f"| {r['batch']} | {r['draft_tokens']} | {r['context']} | {r['decode_ms']:.2f} | "
                     f"{r['draft_ms']:.2f} | {r['round_ms']:.2f} | {r['decode_steps']:.2f}x | {plain} | {projected} |")
    lines.append("(synthetic weights: the acceptance is assumed, not measured; the catch-up covers all 1 + k "
                 "positions)")
    return "\n".join(lines)
