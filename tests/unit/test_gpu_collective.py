"""The all-reduce points of a tensor-parallel rank's launch list, on the null device.

No collective runs here (no NCCL, one process): a recording `Collective` checks that the launch
list holds one all-reduce after each mixer's output projection and each MLP's `down`, over the
delta rows the next `add_norm` reads, and that without a collective the list is the single-GPU
one (the recorded trace in `test_gpu_runner_step.py` checks that byte for byte). Needs the built
kernels and skips without them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_trace import tiny_model, traced_runner

REPO = Path(__file__).resolve().parents[2]


class RecordingCollective:
    """A `Collective` of rank 0 of 2 that records its calls instead of reducing."""

    rank = 0
    world_size = 2

    def __init__(self):
        self.calls: list[tuple[int, int, str, object]] = []

    def all_reduce(self, buffer_ptr, count, dtype, stream):
        self.calls.append((buffer_ptr, count, dtype, stream))


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    from runtime.cuda.manifest import ManifestError
    from runtime.model.gpu.runner import CudaRunner

    if not (REPO / "build" / "kernels" / "sm_90a" / "manifest.json").exists():
        pytest.skip("kernels not built")
    path = tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.infernix")
    try:
        r = traced_runner(CudaRunner, path)
    except ManifestError as exc:
        pytest.skip(f"kernels not built: {exc}")
    yield r
    r.close()


def forward(runner, collective):
    from runtime.model.gpu.layers import Forward

    return Forward(runner.config, runner.kernels, runner.library, runner.storage, runner.layout,
                   runner.slots.phys_slots, collective=collective)


@pytest.mark.parametrize("rows, prefill", [(4, False), (64, True)])
def test_one_all_reduce_after_each_row_parallel_projection(runner, rows, prefill):
    from runtime.model.gpu.collective import AllReduce
    from runtime.model.gpu.layers import StepShape

    st = runner.storage
    shape = StepShape(m=rows, nseq=1 if prefill else rows, t=rows if prefill else 1,
                      splits=st.decode_splits, min_split=st.decode_min_split, prefill=prefill)
    collective = RecordingCollective()
    sharded = forward(runner, collective).bind(shape)
    single = forward(runner, None).bind(shape)
    points = [i for i, launch in enumerate(sharded) if isinstance(launch, AllReduce)]
    layers = runner.config.num_hidden_layers
    assert len(points) == 2 * layers                      # mixer and MLP of every layer
    # Apart from the all-reduces the launches are the single-GPU ones, kernel by kernel.
    kernels = [launch for launch in sharded if not isinstance(launch, AllReduce)]
    assert [(k.kernel.entry.key, k.param_bytes()) for k in kernels] == \
        [(k.kernel.entry.key, k.param_bytes()) for k in single]
    linear_keys = {runner.kernels.linear(n, k, rows)[1] for n, k in
                   ((runner.config.hidden_size, runner.config.num_attention_heads * runner.config.head_dim),
                    (runner.config.hidden_size, runner.config.linear_value_dim),
                    (runner.config.hidden_size, runner.config.intermediate_size))}
    for i in points:
        # Each sits between a projection into the delta rows and the add_norm reading them.
        assert sharded[i - 1].kernel.entry.key in linear_keys
        assert sharded[i + 1].kernel.entry.key == runner.kernels.add_norm
    stream = object()
    for i in points:
        sharded[i](stream)
    delta = st.buf["delta"]
    assert collective.calls == [(delta, rows * runner.config.hidden_size, "bf16", stream)] * (2 * layers)
