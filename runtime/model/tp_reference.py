"""A simulated tensor-parallel world on the CPU: N NumPy ranks and a fake all-reduce.

Each rank is a `RankRunner`: the reference `NumpyRunner` on the rank's local config
(`ShardPlan.rank_config`: 1/N of the heads and columns) and its shard of the weights
(`ShardPlan.shard_arrays`), whose `_reduce` hook (after every `o_proj`, `out_proj`, MLP `down`
and MoE combine) is the world's all-reduce. The ranks run SPMD, one thread each, as GPU ranks
run one process each: every rank executes the same forward on its shard and meets the others at
each all-reduce. `FakeAllReduce` adds the partial outputs in rank order 0, 1, ..., N-1, so every
rank gets the same sum (bit for bit), and with one rank the sum is the rank's own output: world
size 1 is the same code path and equals `NumpyRunner` exactly.

The lm_head is vocabulary-parallel: a rank's logits are its rows `ShardPlan.vocab(rank)`, and
`sample` takes each row's decision from the shards (`sampling.decide_sharded`) as the GPU ranks
would (each its top k candidates, merged). Prefill and decode return the per-rank logits.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from runtime.model.config import ModelConfig
from runtime.model.numpy_runner import NumpyRunner
from runtime.model.runner import DecodeItem, PrefillChunk
from runtime.model.sampling import RowDraw, RowSampling, decide_sharded
from runtime.model.sharding import ShardPlan

BARRIER_TIMEOUT_S = 120.0
"""A rank that never reaches an all-reduce (a bug) fails the others instead of hanging them."""


class FakeAllReduce:
    """In-process all-reduce over `world_size` threads: `all_reduce(rank, partial)` returns the
    sum of every rank's `partial`, added in rank order; `calls` counts rank 0's calls (the
    tests check where the collective sits)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.calls = 0
        self._partials: list[np.ndarray | None] = [None] * world_size
        self._barrier = threading.Barrier(world_size, timeout=BARRIER_TIMEOUT_S)

    def all_reduce(self, rank: int, partial: np.ndarray) -> np.ndarray:
        self._partials[rank] = partial
        self._barrier.wait()                       # every partial is in
        total = self._partials[0].copy()
        for other in self._partials[1:]:
            total += other
        if rank == 0:
            self.calls += 1
        self._barrier.wait()                       # nobody overwrites a partial still being read
        return total

    def abort(self) -> None:
        """Release ranks waiting at the barrier (they raise): a failed rank breaks the world, as
        a failed NCCL rank does."""
        self._barrier.abort()


class RankRunner(NumpyRunner):
    """One rank of the simulated world (see the module docstring); its logits are
    [rows, V / N] for the vocabulary ids `plan.vocab(rank)`."""

    def __init__(self, plan: ShardPlan, rank: int, weights: Mapping[str, np.ndarray],
                 world: FakeAllReduce, **runner_args: Any):
        super().__init__(plan.rank_config(rank), plan.shard_arrays(weights, rank),
                         vocab_rows=plan.vocab(rank), **runner_args)
        self.rank = rank
        self.world = world

    def _reduce(self, partial: np.ndarray) -> np.ndarray:
        return self.world.all_reduce(self.rank, partial)


class TensorParallelReference:
    """N ranks of `config` with `weights` (canonical text tensors); `runner_args` go to every
    rank's `NumpyRunner` (num_pages, num_slots, dtype, ...). Close it (or use `with`)."""

    def __init__(self, config: ModelConfig, weights: Mapping[str, np.ndarray], world_size: int,
                 **runner_args: Any):
        self.plan = ShardPlan.build(config, world_size)
        self.world = FakeAllReduce(world_size)
        self.ranks = [RankRunner(self.plan, r, weights, self.world, **runner_args)
                      for r in range(world_size)]
        self.vocab_starts = [self.plan.vocab(r)[0] for r in range(world_size)]
        self._threads = ThreadPoolExecutor(world_size, thread_name_prefix="tp-rank")

    def _run(self, call: Callable[[RankRunner], np.ndarray]) -> list[np.ndarray]:
        """`call` on every rank at once; the first failure aborts the world and is raised."""
        def guarded(rank: RankRunner) -> np.ndarray:
            try:
                return call(rank)
            except BaseException:
                self.world.abort()
                raise
        futures = [self._threads.submit(guarded, rank) for rank in self.ranks]
        return [future.result() for future in futures]

    def prefill(self, chunk: PrefillChunk) -> list[np.ndarray]:
        """Per rank: logits [1 or T, V / N] of its vocabulary ids (see `NumpyRunner.prefill`)."""
        return self._run(lambda rank: rank.prefill_with_hidden(chunk).logits)

    def decode(self, items: Sequence[DecodeItem]) -> list[np.ndarray]:
        """Per rank: logits [len(items), V / N] of its vocabulary ids."""
        return self._run(lambda rank: rank.decode_with_hidden(items).logits)

    def sample(self, logits_shards: Sequence[np.ndarray], rows: Sequence[RowSampling]
               ) -> list[RowDraw]:
        """Each row's decision from the ranks' logits of that row (`decide_sharded`)."""
        return [decide_sharded([shard[i] for shard in logits_shards], self.vocab_starts, row)
                for i, row in enumerate(rows)]

    def close(self) -> None:
        self._threads.shutdown()

    def __enter__(self) -> "TensorParallelReference":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
