"""What a speculative round with k MTP drafts costs on `CudaRunner`, in decode steps (issue 21's
target at the 27B shape, BF16: k = 3 within 1.2x a decode step at batch 1, 1.4x at batch 8).

A round is what the engine runs per decode unit (`runtime.engine.speculative`): `mtp_draft` (the
head caught up over the verified positions of the round before, then chained k times), one
verification step of 1 + k tokens per row with every position's greedy id picked on the device
(`step_sampled`: the engine's path for rounds without constraints, penalties or logprobs), and
`commit`. The catch-up covers all 1 + k positions of the last verification row, as after a round
that accepted every draft (the most rows it can take); a decode step is the same rows with one
token each (`verify_step.rows_for`), its id picked on the device too (`decode_sampled` without
the look-ahead). `verify_logits_ms` is the verification step with every logit row read back
instead (the path of constrained rounds). Wall time of back-to-back rounds over the same
positions.

Synthetic weights draft noise, so acceptance is not measured here: `projected_tok_s` is the decode
speed a round would give at `TOKENS_PER_ROUND` tokens per round at k = 3 (the acceptance published
for this model family's MTP head, bonus token included): assumed, not measured.
"""

from __future__ import annotations

from typing import Any

from bench.timing import median_event_seconds, wall_ms
from bench.verify_step import rows_for, sampled_step_ms, step_ms
from runtime.model.runner import MtpRow
from runtime.model.sampling import RowSampling

TOKENS_PER_ROUND = {3: 2.5}  # assumed acceptance (issue 21: about 2.5 tokens a round at k = 3)


def _chain_gpu_ms(runner: Any, k: int, batch: int) -> float | None:
    """GPU time of the chain graph of drafts 2..k alone (`mtp_chain.DraftChain`), replayed back to
    back; None where the chain runs from the host."""
    chain = runner._mtp.chain
    graph = chain.graphs.get((batch,) * (k - 1)) if chain is not None and k > 1 else None
    if graph is None:
        return None
    return median_event_seconds(runner.device, runner.stream, graph.replay) * 1e3


def use_draft_vocab(runner: Any, vocab: int) -> None:
    """Give `runner` a fresh MTP head drafting over `vocab` ids, as `CudaRunner(mtp_draft_vocab=vocab)`
    builds it (so one run compares draft vocabularies on the same weights; the head's kept rows
    start empty, and `run` fills them with a verification step before it drafts)."""
    from runtime.model.gpu.mtp import MtpHead

    runner._mtp.close()
    runner.mtp_draft_vocab = vocab
    runner._mtp = MtpHead(runner, vocab)


def run(runner: Any, batches: list[int], drafts: list[int], context: int, pages_per_row: int,
        steps: int, vocabs: list[int] = ()) -> list[dict[str, Any]]:
    """One result per (draft vocabulary, batch, k): ms of a decode step, of the verification step
    alone, of the drafting's parts (the catch-up alone, catch-up + draft 1 with its read-back, all
    k drafts), of a whole round, and the round in decode steps. vocabs: the draft vocabularies to
    time (`use_draft_vocab`; none: the runner's own)."""
    out = []
    for vocab in vocabs or [runner.mtp_draft_vocab]:
        if vocab != runner.mtp_draft_vocab:
            use_draft_vocab(runner, vocab)
        out += _run_vocab(runner, batches, drafts, context, pages_per_row, steps)
    return out


def _run_vocab(runner: Any, batches: list[int], drafts: list[int], context: int, pages_per_row: int,
               steps: int) -> list[dict[str, Any]]:
    out = []
    for batch in batches:
        decode = sampled_step_ms(runner, rows_for(batch, 1, context, pages_per_row, runner.max_batch, False,
                                                  runner.vocab_size), steps)
        for k in drafts:
            verify = rows_for(batch, k + 1, context, pages_per_row, runner.max_batch, True, runner.vocab_size)
            verify_ms = sampled_step_ms(runner, verify, steps)
            verify_logits_ms = step_ms(runner, verify, steps)
            greedy = [[RowSampling(greedy=True)] * row.num_tokens for row in verify]

            # The positions the verification rows keep, paired with the tokens after them.
            def mtp(n: int) -> list[MtpRow]:
                return [MtpRow(row.slot, [(t + 1) % runner.vocab_size for t in row.token_ids], context,
                               row.page_table, n) for row in verify]

            def round_() -> None:
                runner.mtp_draft(mtp(k))
                runner.step_sampled(verify, lambda: greedy)
                for row in verify:
                    runner.commit(row.slot, row.snapshots[0])  # noise drafts: the first position kept

            runner.step(verify)  # the kept hidden rows the first draft reads
            catch_up_ms = wall_ms(steps, lambda: runner.mtp_draft(mtp(0)))
            first_ms = wall_ms(steps, lambda: runner.mtp_draft(mtp(1)))
            draft_ms = wall_ms(steps, lambda: runner.mtp_draft(mtp(k)))
            chain_gpu = _chain_gpu_ms(runner, k, batch)
            round_ms = wall_ms(steps, round_)
            result = {"batch": batch, "draft_tokens": k, "context": context, "draft_vocab": runner.mtp_draft_vocab,
                      "decode_ms": decode, "verify_ms": verify_ms, "verify_logits_ms": verify_logits_ms,
                      "catch_up_ms": catch_up_ms,
                      "first_draft_ms": first_ms - catch_up_ms,
                      "chained_draft_ms": (draft_ms - first_ms) / (k - 1) if k > 1 else 0.0,
                      "chain_gpu_ms": chain_gpu, "draft_ms": draft_ms, "round_ms": round_ms,
                      "rest_ms": round_ms - draft_ms - verify_ms, "decode_steps": round_ms / decode}
            if k in TOKENS_PER_ROUND:
                result["assumed_tokens_per_round"] = TOKENS_PER_ROUND[k]
                result["projected_tok_s"] = batch * TOKENS_PER_ROUND[k] / round_ms * 1e3
                result["plain_tok_s"] = batch / decode * 1e3
            out.append(result)
            print(result, flush=True)
    return out


def render(results: list[dict[str, Any]]) -> str:
    lines = ["| batch | k | context | draft vocab | decode step ms | round ms | round in decode steps | plain tok/s | "
             "projected tok/s (assumed tokens/round) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        projected = (f"{r['projected_tok_s']:.1f} ({r['assumed_tokens_per_round']})" if "projected_tok_s" in r
                     else "n/a")
        plain = f"{r['plain_tok_s']:.1f}" if "plain_tok_s" in r else "n/a"
        lines.append(f"| {r['batch']} | {r['draft_tokens']} | {r['context']} | {r['draft_vocab']} | "
                     f"{r['decode_ms']:.2f} | {r['round_ms']:.2f} | {r['decode_steps']:.2f}x | {plain} | {projected} |")
    lines += ["", "Where a round's time goes (ms, wall): the verification step alone (ids picked on the device; "
              "with every logit row read back instead in brackets), the head's catch-up alone, "
              "draft 1 (its greedy pick and the read-back, over the catch-up), each chained draft (drafts 2..k; "
              "GPU time of the chain graph alone in brackets), and the rest of the round (commit, host work):", "",
              "| batch | k | verify | catch-up | draft 1 | each chained draft (chain GPU) | all drafting | rest |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        gpu = f" ({r['chain_gpu_ms']:.2f})" if r.get("chain_gpu_ms") is not None else ""
        lines.append(f"| {r['batch']} | {r['draft_tokens']} | {r['verify_ms']:.2f} ({r['verify_logits_ms']:.2f}) | "
                     f"{r['catch_up_ms']:.2f} | "
                     f"{r['first_draft_ms']:.2f} | {r['chained_draft_ms']:.2f}{gpu} | {r['draft_ms']:.2f} | "
                     f"{r['rest_ms']:.2f} |")
    lines.append("(synthetic weights: the acceptance is assumed, not measured; the catch-up covers all 1 + k "
                 "positions)")
    return "\n".join(lines)
