"""A scripted `ModelRunner` for the speculative-decoding tests (no tests here).

`CopyRunner` is exact and stateful like a real runner: a slot's recurrent state is the token
history it consumed, every token is written to its KV page row, and each call checks that the
page rows before the new tokens hold exactly that history (so a wrongly kept draft position, a
missed commit or a page released too early shows). Verification rows (snapshots) and `commit`
follow the step contract.

Its model copies: when the last `match` tokens occurred earlier in the history, the token that
followed their most recent earlier occurrence gets a clear winner bonus (a prompt holding a file
that the output rewrites is copied); otherwise a hash of the last two tokens wins. A fixed
pseudo-random spread keeps sampling meaningful.

With `device_sampling=True` it samples on its "device" (`samples_on_device`): the `*_sampled`
calls pick each row's token with `decide`, the device sampler's host reference, over the same
logits, and count themselves in `sampled_calls`; `decode_sampled(lookahead=True)` records the
step it would compute ahead, which the next call uses or drops (`lookahead_steps`, counted as the
CUDA runner counts them).

Its MTP head (`mtp_layers = 1`) drafts what the model's greedy rule would say next, wrong
every `mtp_wrong_every`-th draft, and checks the catch-up contract: rows start where the slot's
latest computation started, pair its kept positions with the committed tokens, and cover every
position once and in order since the slot's reset.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from runtime.model.runner import (PAGE_SIZE, DecodeItem, MtpRow, PrefillChunk, StepRow,
                                  checked_rows)
from runtime.model.sampling import decide


class CopyRunner:

    def __init__(self, vocab_size=48, num_pages=32, num_slots=4, match=3, winner=6.0,
                 spread=1.0, mtp=False, mtp_wrong_every=0, seed=0, device_sampling=False):
        self.vocab_size = vocab_size
        self.num_pages = num_pages
        self.num_slots = num_slots
        self.match = match
        self.winner = winner
        self.spread = spread
        self.mtp_layers = 1 if mtp else 0
        # device_sampling: sample on the "device" (`decide`, the device sampler's reference) in
        # the `*_sampled` calls, counting them in `sampled_calls`.
        self.samples_on_device = device_sampling
        self.sampled_calls = {"decode": 0, "prefill": 0, "step": 0}
        self.mtp_wrong_every = mtp_wrong_every
        self.history: list[list[int]] = [[] for _ in range(num_slots)]
        self.kv = np.full((num_pages, PAGE_SIZE), -1, dtype=np.int64)
        self.noise = np.random.default_rng(seed).normal(size=(101, vocab_size)).astype(np.float32)
        self.kept: dict[int, tuple[int, int]] = {}        # slot -> (start, count) last computed
        self.mtp_end = [0] * num_slots                     # positions caught up since reset
        self.mtp_drafts = 0
        self.steps: list[list[int]] = []                   # token count of each row per step
        # Look-ahead (`decode_sampled`): the step computed ahead, and how many were used or
        # dropped (True / False) as the real runner counts them.
        self._ahead = None
        self.lookahead_steps = {True: 0, False: 0}

    # --- the model ---------------------------------------------------------------------------

    def next_greedy(self, history: Sequence[int]) -> int:
        """The winner of the logits after `history`."""
        m = self.match
        tail = list(history[-m:])
        for j in range(len(history) - m - 1, -1, -1):
            if list(history[j:j + m]) == tail:
                return int(history[j + m])
        last = list(history[-2:])
        return (sum((i + 3) * t for i, t in enumerate(last)) * 7 + 5) % self.vocab_size

    def logits_for(self, history: Sequence[int]) -> np.ndarray:
        row = self.noise[(len(history) * 13 + sum(history[-3:])) % 101] * self.spread
        row[self.next_greedy(history)] += self.winner
        return row

    def _run(self, slot: int, tokens: Sequence[int], start: int, table: Sequence[int],
             snapshots=None) -> np.ndarray:
        history = self.history[slot]
        assert len(history) == start, f"slot {slot} holds {len(history)}, not {start}"
        for pos, token in enumerate(history):
            assert self.kv[table[pos // PAGE_SIZE], pos % PAGE_SIZE] == token, \
                f"KV row of position {pos} lost"
        work = list(history)
        out = []
        for i, token in enumerate(tokens):
            pos = start + i
            assert pos // PAGE_SIZE < len(table), "page table does not cover the position"
            self.kv[table[pos // PAGE_SIZE], pos % PAGE_SIZE] = token
            work.append(int(token))
            out.append(self.logits_for(work))
            if snapshots is not None:
                self.history[snapshots[i]] = list(work)
        if snapshots is None:
            self.history[slot] = work
        self.kept[slot] = (start, len(tokens))
        return np.stack(out)

    # --- ModelRunner -------------------------------------------------------------------------

    def reset_slot(self, slot: int) -> None:
        self.history[slot] = []
        self.mtp_end[slot] = 0

    def copy_slot(self, src: int, dst: int) -> None:
        self.history[dst] = list(self.history[src])

    def prefill(self, chunk: PrefillChunk) -> np.ndarray:
        self._take_ahead()
        return self._run(chunk.slot, chunk.token_ids, chunk.start_pos, chunk.page_table)[-1:]

    def decode(self, items: Sequence[DecodeItem]) -> np.ndarray:
        self._take_ahead()
        return np.concatenate([self._run(i.slot, [i.token_id], i.pos, i.page_table)
                               for i in items])

    def step(self, rows: Sequence[StepRow]) -> list[np.ndarray]:
        self._take_ahead()
        checked_rows(rows, self.num_slots)
        self.steps.append([row.num_tokens for row in rows])
        out = []
        for row in rows:
            logits = self._run(row.slot, row.token_ids, row.start_pos, row.page_table,
                               row.snapshots)
            out.append(logits[list(row.logit_offsets())])
        return out

    def _take_ahead(self, items=None) -> None:
        """Count the step computed ahead, if any: used when `items` are exactly what it
        computed (slots, positions and the ids it was given), dropped otherwise."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            used = items is not None and ahead == [(i.slot, i.pos, i.token_id) for i in items]
            self.lookahead_steps[used] += 1

    def decode_sampled(self, items, sampling, lookahead=False) -> np.ndarray:
        assert self.samples_on_device
        self._take_ahead(items)
        self.sampled_calls["decode"] += 1
        logits = self.decode(items)
        ids = np.array([decide(row, each).token for row, each in zip(logits, sampling())], np.int32)
        if lookahead:
            self._ahead = [(i.slot, i.pos + 1, int(t)) for i, t in zip(items, ids)]
        return ids

    def prefill_sampled(self, chunk, sampling) -> np.ndarray:
        assert self.samples_on_device
        self.sampled_calls["prefill"] += 1
        (row,) = sampling()
        return np.array([decide(self.prefill(chunk)[-1], row).token], np.int32)

    def step_sampled(self, rows, sampling) -> list[np.ndarray]:
        assert self.samples_on_device
        self.sampled_calls["step"] += 1
        logits = self.step(rows)
        return [np.array([decide(x, each).token for x, each in zip(row_logits, per_position)], np.int32)
                for row_logits, per_position in zip(logits, sampling())]

    def commit(self, slot: int, snapshot: int) -> None:
        self.history[slot] = list(self.history[snapshot])

    def mtp_draft(self, rows: Sequence[MtpRow]) -> list[list[int]]:
        assert self.mtp_layers, "mtp_draft called on a runner without MTP"
        drafts = []
        for row in rows:
            start, count = self.kept[row.slot]
            assert row.start_pos == start and 1 <= len(row.token_ids) <= count, (row, start, count)
            assert row.start_pos == self.mtp_end[row.slot], "catch-up skipped or repeated"
            history = self.history[row.slot]
            m = len(row.token_ids)
            # The pairs are (h_i, x_{i+1}): every token but the last is already in the history.
            assert list(row.token_ids[:-1]) == history[start + 1:start + m], "catch-up tokens"
            self.mtp_end[row.slot] = start + m
            guess = history[:start + m] + [int(row.token_ids[-1])]
            row_drafts = []
            for _ in range(row.num_drafts):
                self.mtp_drafts += 1
                draft = self.next_greedy(guess)
                if self.mtp_wrong_every and self.mtp_drafts % self.mtp_wrong_every == 0:
                    draft = (draft + 1) % self.vocab_size
                row_drafts.append(draft)
                guess.append(draft)
            drafts.append(row_drafts)
        return drafts
