"""Fakes for engine tests (no tests here; the engine test files import them): a `ModelRunner`,
a constraint (`OnlyEven`) and a logger that keeps the warnings (`RecordingLog`).

The runner fake is exact and stateful like a real runner, so replay and batching bugs change its
output: each slot carries a running hash of every token it consumed (the recurrent state), each
token is written to its KV page row, and every call checks that the page table rows before the
new tokens hold exactly the history the slot hash was built from. Its logits put a clear winner
at `hash % V` plus a fixed pseudo-random spread, so greedy and sampled runs are both meaningful.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

from runtime.model.runner import PAGE_SIZE, DecodeItem, PrefillChunk
from runtime.model.sampling import pack_mask

MOD = 1_000_003


def fold(state: int, token: int, pos: int) -> int:
    return (state * 31 + token * 7 + pos + 1) % MOD


class FakeRunner:
    samples_on_device = False  # the engine samples its logits on the host

    def __init__(self, vocab_size=64, num_pages=32, num_slots=4, spread=2.0, winner=4.0,
                 seed=0):
        self.vocab_size = vocab_size
        self.num_pages = num_pages
        self.num_slots = num_slots
        self.state = [0] * num_slots
        self.length = [0] * num_slots
        self.kv = np.full((num_pages, PAGE_SIZE), -1, dtype=np.int64)
        self.noise = np.random.default_rng(seed).normal(size=(97, vocab_size)).astype(np.float32)
        self.spread = spread
        self.winner = winner
        self.calls: list[tuple] = []
        self.fail_prefill: Optional[Callable[[PrefillChunk], bool]] = None
        self.fail_decode: Optional[Callable[[Sequence[DecodeItem]], bool]] = None

    # --- the model ---------------------------------------------------------------------------

    def logits_for(self, state: int) -> np.ndarray:
        row = self.noise[state % 97] * self.spread
        row = row.copy()
        row[state % self.vocab_size] += self.winner
        return row

    def _check_history(self, slot: int, start: int, page_table: Sequence[int]) -> None:
        assert self.length[slot] == start, f"slot {slot} holds {self.length[slot]}, not {start}"
        state = 0
        for pos in range(start):
            token = int(self.kv[page_table[pos // PAGE_SIZE], pos % PAGE_SIZE])
            assert token >= 0, f"position {pos} of slot {slot} was never written"
            state = fold(state, token, pos)
        assert state == self.state[slot], "KV pages and slot state disagree"

    def _consume(self, slot: int, token: int, pos: int, page_table: Sequence[int]) -> None:
        assert pos // PAGE_SIZE < len(page_table), "page table does not cover the position"
        self.kv[page_table[pos // PAGE_SIZE], pos % PAGE_SIZE] = token
        self.state[slot] = fold(self.state[slot], token, pos)
        self.length[slot] = pos + 1

    # --- ModelRunner -------------------------------------------------------------------------

    def reset_slot(self, slot: int) -> None:
        self.state[slot] = 0
        self.length[slot] = 0

    def copy_slot(self, src: int, dst: int) -> None:
        self.state[dst] = self.state[src]
        self.length[dst] = self.length[src]

    def prefill(self, chunk: PrefillChunk) -> np.ndarray:
        self.calls.append(("prefill", chunk.slot, chunk.start_pos, len(chunk.token_ids)))
        if self.fail_prefill is not None and self.fail_prefill(chunk):
            raise RuntimeError("injected prefill failure")
        self._check_history(chunk.slot, chunk.start_pos, chunk.page_table)
        for offset, token in enumerate(chunk.token_ids):
            assert 0 <= token < self.vocab_size
            self._consume(chunk.slot, token, chunk.start_pos + offset, chunk.page_table)
        return self.logits_for(self.state[chunk.slot])[None, :]

    def decode(self, items: Sequence[DecodeItem]) -> np.ndarray:
        self.calls.append(("decode", len(items)))
        if self.fail_decode is not None and self.fail_decode(items):
            # A real runner may have touched some rows before failing: poison them.
            for item in items:
                self.state[item.slot] = -1
            raise RuntimeError("injected decode failure")
        assert len({item.slot for item in items}) == len(items), "two items share a slot"
        rows = []
        for item in items:
            self._check_history(item.slot, item.pos, item.page_table)
            self._consume(item.slot, item.token_id, item.pos, item.page_table)
            rows.append(self.logits_for(self.state[item.slot]))
        return np.stack(rows)


def reference_greedy(runner_factory, prompt: Sequence[int], max_new: int,
                     stop_ids=frozenset()) -> list[int]:
    """What a direct greedy loop on a fresh fake produces (the engine must match it)."""
    runner = runner_factory()
    state = 0
    out = []
    tokens = list(prompt)
    for pos, token in enumerate(tokens):
        state = fold(state, token, pos)
    while len(out) < max_new:
        token = int(np.argmax(runner.logits_for(state)))
        out.append(token)
        if token in stop_ids:
            break
        state = fold(state, token, len(tokens))
        tokens.append(token)
    return out


class OnlyEven:
    """A constraint that allows even ids only, for `limit` tokens, then only `end`."""

    def __init__(self, limit, end):
        self.limit, self.end, self.seen = limit, end, []

    def allowed_bitmask_u32(self, vocab_size):
        mask = np.zeros(vocab_size, dtype=bool)
        if len(self.seen) < self.limit:
            mask[0::2] = True
        else:
            mask[self.end] = True
        return pack_mask(mask)

    def commit(self, token_id):
        self.seen.append(token_id)

    def rollback(self, num_tokens):
        del self.seen[-num_tokens:]


class RecordingLog:
    """A logger (`Engine(logger=...)`, the session's settings) that keeps the formatted
    warnings and drops the rest."""

    def __init__(self):
        self.warnings = []

    def warning(self, message, *args):
        self.warnings.append(message % args if args else message)

    def info(self, *args):
        pass

    def debug(self, *args):
        pass
