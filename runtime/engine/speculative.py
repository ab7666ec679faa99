"""Speculative decoding: draft proposals, one verification row per round, exact acceptance.

A round of one sequence whose last committed token x_n sits at position n:

1. Proposal (at most the unit's `DecodeWork.draft_room` tokens, greedy):
   - n-gram copy: the most recent earlier occurrence of the last `ngram_min_match` tokens in
     the request's prompt + output; the tokens that followed it (`NgramIndex`);
   - MTP: the runner's MTP head (`ModelRunner.mtp_draft`), chained `draft_tokens` times.
   With both on, the longer proposal is verified (MTP is then only caught up, not chained).
2. Verification: one `StepRow` of [x_n, d_1 .. d_k] at positions n .. n+k with every logit row
   and the state after each position in the lane's snapshot slots (`SlotLayout`).
3. Acceptance, "sample and compare": position j's target token is sampled from its logits by
   the request's own sampler (`LiveRequest.step`: its mask, penalties, draw counter, thinking
   controls and limits, exactly as a plain decode step would), then committed; the round goes
   on while the sample equals the draft d_{j+1}. Every committed token is therefore the token
   plain decoding commits at that point (same logits, bit for bit, by the step contract; same
   constraint state, since the constraint is advanced by each committed token before the next
   position's mask is asked for; same draw number), so greedy and seeded output equal plain
   decoding, and the output distribution is the target's. For a point-mass draft (ours are
   greedy) this accepts d with probability p(d) and otherwise yields a sample of p conditioned
   on != d, which is exactly what rejection sampling with q = delta_d does (accept with
   min(1, p/q) = p(d), resample from the residual norm(max(p - q, 0))).
   A stop token, the output or context limit, or a thinking-control insertion ends the round
   at that position, as it would end plain decoding there.
   On a runner that samples on its device (and with `device_sampling` on), a group whose units
   have no constraint, no penalties and no logprobs is sampled there (`ModelRunner.step_sampled`):
   position j's inputs are the unit's current ones with draw number + j, which is what plain
   decoding would use there once the drafts before it were accepted, so the ids are the
   device sampler's picks of the same logits; only ids come back (not 1 + k logits rows a
   unit), and seeded output equals plain device-sampled decoding exactly. Other groups take
   their logits to the host as above.
4. Commit: `runner.commit(lane, snapshots[j])` keeps the state after the last kept position
   j (the rejected positions' recurrent states are dropped; their KV rows lie beyond the
   sequence's length and are overwritten before any query reads them); the scheduler keeps
   1 + j positions and returns the pages taken only for rejected ones.

The MTP head's KV cache follows the main model ("catch-up", `MtpRow`): before a sequence's
next computation, the head runs over the positions its last computation kept (prompt chunks
and verified rounds alike), paired with the committed tokens after them; the last of those
positions' logits is the next round's first draft. When another request computed on the
lane in between (a pause or preemption freed it), the kept states are gone: the sequence then
drafts nothing until its next computation was caught up (its output is unchanged; only drafts
are lost).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

from runtime.engine.request_state import LiveRequest, StepResult
from runtime.engine.scheduler_records import DecodeWork, ScheduledBatch
from runtime.model.runner import MTP_MAX_DRAFTS, ModelRunner, MtpRow, StepRow

MAX_MTP_DRAFTS = MTP_MAX_DRAFTS  # Qwen3.5/3.6 MTP heads: 1..5 drafts per round (seed 000)
MAX_NGRAM_DRAFTS = 63


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings (fixed at startup).

    method: "off" or "mtp" (the runner's MTP head drafts `draft_tokens` per round).
    draft_tokens: MTP drafts per round, 1..5.
    ngram_draft_tokens: most n-gram copy drafts per round (0: off), 1..63.
    ngram_min_match: tokens that must match before the copy is proposed.
    adaptive: `--draft-tokens auto`: each round drafts the MTP length, up to `draft_tokens`,
        that the request's measured acceptance and the runner's `round_cost` make fastest
        (`best_draft_count`).
    """

    method: str = "off"
    draft_tokens: int = 3
    ngram_draft_tokens: int = 0
    ngram_min_match: int = 12
    adaptive: bool = False

    def __post_init__(self):
        if self.method not in ("off", "mtp"):
            raise ValueError(f"speculative method must be off or mtp, got {self.method!r}")
        if not 1 <= self.draft_tokens <= MAX_MTP_DRAFTS:
            raise ValueError(f"draft_tokens must be in 1..{MAX_MTP_DRAFTS}, "
                             f"got {self.draft_tokens}")
        if not 0 <= self.ngram_draft_tokens <= MAX_NGRAM_DRAFTS:
            raise ValueError(f"ngram_draft_tokens must be in 0..{MAX_NGRAM_DRAFTS}, "
                             f"got {self.ngram_draft_tokens}")
        if self.ngram_min_match < 1:
            raise ValueError(f"ngram_min_match must be >= 1, got {self.ngram_min_match}")
        if self.adaptive and not self.mtp:
            raise ValueError("adaptive draft lengths are for MTP drafts (method mtp)")

    @property
    def mtp(self) -> bool:
        return self.method == "mtp"

    @property
    def enabled(self) -> bool:
        return self.mtp or self.ngram_draft_tokens > 0

    @property
    def max_drafts(self) -> int:
        """Most draft tokens one round verifies."""
        return max(self.draft_tokens if self.mtp else 0, self.ngram_draft_tokens)


@dataclass(frozen=True)
class SlotLayout:
    """How the runner's state slots are split, fixed at startup: lanes [0, num_lanes), then
    `snapshots_per_lane` verification snapshots per lane, then spare slots (`first_spare`
    onward, e.g. the prefix cache's saved states). A runner needs `num_slots` >= `reserved`."""

    num_lanes: int
    snapshots_per_lane: int = 0

    @property
    def reserved(self) -> int:
        return self.num_lanes * (1 + self.snapshots_per_lane)

    @property
    def first_spare(self) -> int:
        return self.reserved

    def snapshot_slots(self, lane: int) -> range:
        start = self.num_lanes + lane * self.snapshots_per_lane
        return range(start, start + self.snapshots_per_lane)

    @classmethod
    def for_config(cls, num_lanes: int, config: SpeculativeConfig) -> "SlotLayout":
        """k + 1 snapshot slots per lane: a round of k drafts verifies k + 1 positions."""
        return cls(num_lanes, config.max_drafts + 1 if config.enabled else 0)


class NgramIndex:
    """A request's prompt + committed output with, for every `min_match`-token run but the
    last, where it most recently ended: a proposal is one dictionary look-up, and each
    committed token costs one insertion."""

    def __init__(self, tokens: Sequence[int], min_match: int):
        self.min_match = min_match
        self.tokens: list[int] = []
        self._last_end: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        m = self.min_match
        for token in tokens:
            # The run ending at the old last token stops being the suffix: index it now.
            end = len(self.tokens)
            if end >= m:
                self._last_end[tuple(self.tokens[end - m:end])] = end
            self.tokens.append(int(token))

    def propose(self, max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens that followed the last earlier occurrence of the suffix."""
        m = self.min_match
        if max_tokens < 1 or len(self.tokens) < m:
            return []
        end = self._last_end.get(tuple(self.tokens[-m:]))
        if end is None:
            return []
        return self.tokens[end:end + max_tokens]


@dataclass
class _SequenceState:
    """Per request: its tokens (n-gram index) and the positions its last computation kept
    whose MTP catch-up is still due: (lane slot, first position, count)."""

    ngram: NgramIndex
    catch_up: Optional[tuple[int, int, int]] = None
    ngram_proposal: list[int] = field(default_factory=list)
    mtp_drafts: int = 0            # MTP drafts its next unit verifies (`draft_room`)
    # MTP acceptance by draft position j (0-based): rounds that verified draft j with every
    # draft before it accepted, and of those, the rounds that accepted it too.
    tested: list[int] = field(default_factory=lambda: [0] * MAX_MTP_DRAFTS)
    accepted: list[int] = field(default_factory=lambda: [0] * MAX_MTP_DRAFTS)

    def record(self, drafted: int, accepted: int) -> None:
        for j in range(min(drafted, accepted + 1)):
            self.tested[j] += 1
            self.accepted[j] += j < accepted


def best_draft_count(tested: Sequence[int], accepted: Sequence[int], most: int,
                     cost: Callable[[int], float]) -> int:
    """The draft count k in 1..most with the most tokens per decode step of cost: a round of k
    drafts commits 1 + sum over i <= k of the chance that drafts 1..i are all accepted, each
    draft's chance estimated as (accepted + 1) / (tested + 2) (so an untried position counts
    as even odds), and costs `cost(k)` decode steps."""
    best, best_rate = 1, -1.0
    expected, chain = 1.0, 1.0
    for k in range(1, most + 1):
        chain *= (accepted[k - 1] + 1) / (tested[k - 1] + 2)
        expected += chain
        rate = expected / cost(k)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


@dataclass(frozen=True)
class RoundOutcome:
    """One decode unit's result: what it committed, the drafts verified, and the drafts
    accepted (whose positions are kept). With `error` (a sampling or constraint failure at
    some position) `result` holds the tokens committed before it; the request then ends."""

    result: StepResult
    error: Optional[Exception]
    drafted: int
    accepted: int


class Speculation:
    """The engine's speculative decoding: proposals, verification rows, acceptance, commits.

    Engine-thread only. The engine calls `draft_room` before `Scheduler.schedule`, `catch_up`
    before a prefill chunk, `run` for a group of decode units, and `after_update` once the
    scheduler has taken the step's tokens.
    """

    def __init__(self, config: SpeculativeConfig, runner: ModelRunner, layout: SlotLayout,
                 device_sampling: bool = False):
        if not config.enabled:
            raise ValueError("speculative decoding is off")
        if config.mtp and runner.mtp_layers < 1:
            raise ValueError("--spec mtp needs the model's MTP head, and this runner has none "
                             "loaded (an artifact without an mtp component?)")
        if runner.num_slots < layout.reserved:
            raise ValueError(f"speculative decoding needs {layout.reserved} state slots "
                             f"({layout.num_lanes} lanes and {layout.snapshots_per_lane} "
                             f"snapshots each), the runner has {runner.num_slots}")
        self.config = config
        self.runner = runner
        self.layout = layout
        # Sample verification rows on the runner's device where every unit allows it
        # (`_samples_on_device`): only ids come back instead of 1 + k logits rows per unit.
        self.device_sampling = device_sampling and runner.samples_on_device
        self._states: dict[str, _SequenceState] = {}
        # Lane slot -> the request whose computation the runner's kept hidden states are from
        # (another request may have used the lane since: a pause or preemption frees it).
        self._computed_on: dict[int, str] = {}

    def add(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        self._states[request_id] = _SequenceState(
            NgramIndex(prompt_ids, self.config.ngram_min_match))

    def remove(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    # --- before the schedule ----------------------------------------------------------------

    def draft_room(self, live: Mapping[str, LiveRequest]) -> dict[str, int]:
        """Request id -> the most drafts its next decode unit verifies: the round must fit
        the output and context limits (k drafts commit up to k + 1 tokens, at positions up to
        n + k), and n-gram-only requests draft only what their index proposes."""
        room = {}
        for request_id, state in self._states.items():
            request = live.get(request_id)
            if request is None:
                continue
            limit = min(request.request.max_new_tokens - len(request.output_ids),
                        request.max_context - request.total_len) - 1
            mtp = state.mtp_drafts = min(self._mtp_count(state), limit) if self.config.mtp else 0
            state.ngram_proposal = state.ngram.propose(min(self.config.ngram_draft_tokens, limit))
            room[request_id] = max(mtp, len(state.ngram_proposal), 0)
        return room

    def _mtp_count(self, state: _SequenceState) -> int:
        """MTP drafts this round: `draft_tokens`, or with `adaptive` the fastest count."""
        if not self.config.adaptive:
            return self.config.draft_tokens
        return best_draft_count(state.tested, state.accepted, self.config.draft_tokens,
                                lambda k: self.runner.round_cost(k, True))

    # --- MTP catch-up -----------------------------------------------------------------------

    def _catch_up_row(self, request_id: str, slot: int, start_pos: int,
                      page_table: Sequence[int], num_drafts: int) -> Optional[MtpRow]:
        """The MTP row due before this sequence computes from `start_pos` on: the kept
        positions of its last computation, if they end right there on the same lane (after a
        preemption the sequence replays from 0 and the head is caught up again as it goes)."""
        state = self._states[request_id]
        due, state.catch_up = state.catch_up, None
        if not self.config.mtp or due is None:
            return None
        due_slot, first, count = due
        if due_slot != slot or self._computed_on.get(slot) != request_id \
                or first + count != start_pos:
            return None
        tokens = state.ngram.tokens[first + 1:first + count + 1]
        return MtpRow(slot, tokens, first, page_table, num_drafts)

    def catch_up(self, request_id: str, slot: int, start_pos: int,
                 page_table: Sequence[int]) -> None:
        """Before a prefill chunk: run the head over the positions the last chunk kept."""
        row = self._catch_up_row(request_id, slot, start_pos, page_table, 0)
        if row is not None:
            self.runner.mtp_draft([row])

    # --- a round ----------------------------------------------------------------------------

    def allows_step_ahead(self, group: Sequence[DecodeWork]) -> bool:
        """Whether a plain decode step of the group may be computed ahead (`decode_sampled`'s
        lookahead): never with MTP (every step is a round), nor when a unit has n-gram drafts
        now (the next step most likely verifies: the match goes on). Nothing matching, the
        pipelined step costs n-gram drafting nothing; a match that appears at the token sampled
        here waits one step, the step ahead being used as a plain one (`StepExecutor.run`)."""
        return not self.config.mtp and not any(work.draft_room > 0 for work in group)

    def verifies(self, group: Sequence[DecodeWork]) -> bool:
        """Whether the group needs a verification round: with MTP always (its head is caught up
        every step), else only when some unit has n-gram drafts. A group with nothing to verify
        decodes as plain rows instead, keeping the runner's device sampling."""
        return self.config.mtp or any(work.draft_room > 0 for work in group)

    def run(self, group: Sequence[DecodeWork], live: Mapping[str, LiveRequest],
            masks: Mapping) -> dict[str, RoundOutcome]:
        """Draft, verify in one `step`, accept and commit for every unit of the group.
        masks: request id -> the constraint mask future of the unit's first position. Runner
        failures propagate (the engine isolates the group); sampling failures end one unit."""
        drafts, from_mtp = self._proposals(group)
        rows = []
        for work, proposal in zip(group, drafts):
            snapshots = None
            if proposal:
                snapshots = tuple(self.layout.snapshot_slots(work.slot)[:len(proposal) + 1])
            rows.append(StepRow(work.slot, (work.token_id, *proposal), work.pos, work.page_table,
                                logits="all", snapshots=snapshots))
        if self._samples_on_device(group, live):
            vocab = self.runner.vocab_size
            picks = self.runner.step_sampled(rows, lambda: [
                [live[work.request_id].sampler.row_sampling(vocab, None, ahead=p) for p in range(len(row.token_ids))]
                for work, row in zip(group, rows)])
            steps = [lambda p, unit=live[work.request_id], ids=ids: unit.step_sampled(int(ids[p]))
                     for work, ids in zip(group, picks)]
        else:
            logits = self.runner.step(rows)
            # Only the first position's mask was computed ahead (from the committed state); later
            # ones are asked for after the previous token advanced the constraint.
            steps = [lambda p, unit=live[work.request_id], row_logits=row_logits, mask=masks.get(work.request_id):
                     unit.step(row_logits[p], mask if p == 0 else None)
                     for work, row_logits in zip(group, logits)]
        outcomes = {}
        for work, row, proposal, mtp, step_at in zip(group, rows, drafts, from_mtp, steps):
            outcome = _accept(proposal, step_at, bool(live[work.request_id].request.logprobs))
            if row.snapshots is not None and outcome.error is None:
                self.runner.commit(work.slot, row.snapshots[outcome.accepted])
            if mtp:
                self._states[work.request_id].record(outcome.drafted, outcome.accepted)
            outcomes[work.request_id] = outcome
        return outcomes

    def _samples_on_device(self, group: Sequence[DecodeWork], live: Mapping[str, LiveRequest]) -> bool:
        """Whether the group's verification rows are sampled on the device: the runner can, the
        engine allows it, and every position's inputs follow from the unit's current state alone
        (no constraint, whose mask at a position depends on the tokens before it; no penalties,
        whose deltas count them; no logprobs, which need the logits on the host). A later
        position's inputs are then the first's with one more draw per position, exactly what
        plain decoding would give it after accepting the drafts before it."""
        if not self.device_sampling:
            return False
        for work in group:
            unit = live[work.request_id]
            if unit.request.constraint is not None or unit.request.logprobs \
                    or not unit.sampler.unchanged_by_tokens:
                return False
        return True

    def _proposals(self, group: Sequence[DecodeWork]) -> tuple[list[list[int]], list[bool]]:
        """Each unit's drafts: the n-gram copy when it is longer than what MTP would draft,
        else MTP's (the MTP call also catches the head up for every unit); and whether they
        are MTP's."""
        proposals: list[list[int]] = []
        from_mtp: list[bool] = []
        mtp_rows, mtp_units = [], []
        for index, work in enumerate(group):
            state = self._states[work.request_id]
            ngram = state.ngram_proposal[:work.draft_room]
            mtp_count = min(state.mtp_drafts, work.draft_room)
            use_mtp = mtp_count > len(ngram)
            proposals.append([] if use_mtp else ngram)
            from_mtp.append(use_mtp)
            row = self._catch_up_row(work.request_id, work.slot, work.pos, work.page_table,
                                     mtp_count if use_mtp else 0)
            if row is not None:
                mtp_rows.append(row)
                mtp_units.append(index)
        if mtp_rows:
            for index, row_drafts in zip(mtp_units, self.runner.mtp_draft(mtp_rows)):
                if row_drafts:
                    proposals[index] = row_drafts
        return proposals, from_mtp

    # --- after the scheduler took the tokens -------------------------------------------------

    def after_update(self, batch: ScheduledBatch, committed: Mapping[str, Sequence[int]],
                     accepted: Mapping[str, int]) -> None:
        """Record each computed sequence's kept positions (its MTP catch-up) and its new
        tokens (the n-gram index)."""
        for work in (*batch.prefills, *batch.decodes):
            self._computed_on[work.slot] = work.request_id
        for work in batch.prefills:
            state = self._states.get(work.request_id)
            if state is not None:
                state.catch_up = (work.slot, work.start_pos, work.num_tokens)
        for work in batch.decodes:
            state = self._states.get(work.request_id)
            if state is not None and work.request_id in committed:
                state.catch_up = (work.slot, work.pos, 1 + accepted.get(work.request_id, 0))
        for request_id, tokens in committed.items():
            state = self._states.get(request_id)
            if state is not None:
                state.ngram.extend(tokens)


def _accept(proposal: Sequence[int], step_at: Callable[[int], StepResult], wants_logprobs: bool) -> RoundOutcome:
    """Sample and compare (module docstring, step 3) over one verification row: `step_at(p)`
    samples and commits position p's token (from its logits on the host, or the id the device
    sampled for it)."""
    tokens: list[int] = []
    inserted: list[bool] = []
    logprobs: Optional[list[dict]] = [] if wants_logprobs else None
    finish = None
    error = None
    position = 0
    while True:
        try:
            result = step_at(position)
        except Exception as exc:  # noqa: BLE001 - sampling / constraint failure ends the unit
            error = exc
            break
        tokens.extend(result.token_ids)
        inserted.extend(result.inserted)
        if logprobs is not None and result.logprobs:
            logprobs.extend(result.logprobs)
        finish = result.finish_reason
        if finish is not None or len(result.token_ids) > 1 or position == len(proposal) \
                or result.token_ids[0] != proposal[position]:
            break
        position += 1
    return RoundOutcome(StepResult(tuple(tokens), tuple(inserted), finish, logprobs), error,
                        len(proposal), position)
