"""What the CUDA runner sends to the driver, recorded on the null device, for launch-sequence tests.

`TracingDevice` is a `NullDevice` that also logs every host<->device copy, device copy, memset
and launch (graph captures and replays included) in order, each as one line: the function or
copy kind, its addresses and sizes, and a digest of the bytes sent (kernel parameters, uploaded
data). The null device hands out addresses deterministically, so two runners that reserve the
same buffers in the same order and launch the same kernels with the same arguments produce the
same lines.

`SCENARIO` drives a runner through prefill pieces, all-position and last logits, decode graphs
per bucket, eager decode, look-ahead (used and dropped) and device sampling; `trace` returns its
lines per phase. `tests/data/gpu_runner_trace.json` holds the lines recorded from the runner
before it became the `runtime.model.gpu` package (regenerate only after an intended change:
`python -m tests.unit.gpu_trace tests/data/gpu_runner_trace.json`).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

from runtime.cuda.null import NullDevice
from runtime.model.runner import DecodeItem, PrefillChunk
from runtime.model.sampling import RowSampling

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "data" / "gpu_runner_trace.json"
RUNNER_SHAPE = {"num_pages": 16, "num_slots": 4, "prefill_chunk": 64}


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


class TracingDevice(NullDevice):
    """A `NullDevice` that logs what reaches the driver (see the module docstring)."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.log: list[str] = []
        self.uploads: list[tuple[int, bytes]] = []  # (device address, bytes) of every htod copy

    def memcpy_htod(self, dst: int, src: np.ndarray, stream: Any = None) -> None:
        data = np.ascontiguousarray(src).view(np.uint8).reshape(-1).tobytes()
        self.log.append(f"htod {dst:#x} {len(data)} {_digest(data)}")
        self.uploads.append((dst, data))
        super().memcpy_htod(dst, src, stream)

    def memcpy_dtoh(self, dst: np.ndarray, src: int, stream: Any = None) -> np.ndarray:
        self.log.append(f"dtoh {src:#x} {dst.nbytes}")
        return super().memcpy_dtoh(dst, src, stream)

    def memcpy_dtod(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self.log.append(f"dtod {dst:#x} {src:#x} {nbytes}")
        super().memcpy_dtod(dst, src, nbytes, stream)

    def memset_d8(self, ptr: int, value: int, nbytes: int, stream: Any) -> None:
        self.log.append(f"memset8 {ptr:#x} {value} {nbytes}")
        super().memset_d8(ptr, value, nbytes, stream)

    def launch(self, func: Any, config: Any, stream: Any, params_address: int, param_sizes: Any = ()) -> None:
        capturing = stream.handle in self._capturing
        super().launch(func, config, stream, params_address, param_sizes)
        rec = (self._capturing[stream.handle] if capturing else self.launches)[-1]
        self.log.append(f"{'capture' if capturing else 'launch'} {rec.function} {rec.grid} {rec.block} "
                        f"{rec.smem} {rec.cluster} {_digest(b''.join(rec.params))}")

    def graph_launch(self, graph: Any, stream: Any) -> None:
        self.log.append(f"replay {graph.nodes} nodes")
        super().graph_launch(graph, stream)


def _greedy(n: int) -> Callable[[], list[RowSampling]]:
    return lambda: [RowSampling(greedy=True)] * n


def _decode_graphs(r: Any) -> None:
    items = [DecodeItem(slot=0, token_id=5, pos=149, page_table=[0, 1, 2]),
             DecodeItem(slot=1, token_id=7, pos=2, page_table=[3])]
    r.decode(items)  # capture bucket 2, replay
    r.decode(items)  # replay
    r.decode(items[:1])  # capture bucket 1


def _decode_eager(r: Any) -> None:
    r.steps.cuda_graphs = False
    try:
        r.decode([DecodeItem(slot=0, token_id=9, pos=150, page_table=[0, 1, 2]),
                  DecodeItem(slot=1, token_id=3, pos=3, page_table=[3]),
                  DecodeItem(slot=2, token_id=4, pos=0, page_table=[4])])
    finally:
        r.steps.cuda_graphs = True


def _lookahead(r: Any) -> None:
    items = [DecodeItem(slot=2, token_id=5, pos=10, page_table=[5]),
             DecodeItem(slot=3, token_id=7, pos=20, page_table=[6])]
    ids = r.decode_sampled(items, _greedy(2), lookahead=True)
    nxt = [DecodeItem(it.slot, int(t), it.pos + 1, it.page_table) for it, t in zip(items, ids)]
    r.decode_sampled(nxt, _greedy(2), lookahead=True)  # uses the step ahead, queues another
    other = [DecodeItem(it.slot, it.token_id + 1, it.pos + 1, it.page_table) for it in nxt]
    r.decode_sampled(other, _greedy(2))  # drops it


SCENARIO: list[tuple[str, Callable[[Any], Any]]] = [
    ("prefill_all_logits", lambda r: r.prefill(PrefillChunk(slot=0, token_ids=list(range(1, 150)), start_pos=0,
                                                            page_table=[0, 1, 2], all_logits=True))),
    ("prefill_last", lambda r: r.prefill(PrefillChunk(slot=1, token_ids=[5, 6], start_pos=0, page_table=[3]))),
    ("decode_graphs", _decode_graphs),
    ("decode_eager", _decode_eager),
    ("slots", lambda r: (r.copy_slot(0, 2), r.reset_slot(3))),
    ("lookahead", _lookahead),
    ("prefill_sampled", lambda r: r.prefill_sampled(
        PrefillChunk(slot=1, token_ids=list(range(1, 100)), start_pos=2, page_table=[3, 7]), _greedy(1))),
]


def trace(runner_class: Any, tiny_path: Path, scenario: list | None = None,
          synthetic_seed: int | None = None) -> dict[str, list[str]]:
    """Lines logged per phase: `construct` (a digest of the construction's lines and their
    count: thousands of weight uploads) then each phase of the scenario. With a seed, the
    runner fills synthetic weights of the tiny model's shapes instead of reading them."""
    device = TracingDevice(total_memory=2 << 30)
    if synthetic_seed is None:
        runner = runner_class.from_artifact(tiny_path, device=device, **RUNNER_SHAPE)
    else:
        from runtime.artifact import open_artifact
        from runtime.model.config import ModelConfig

        with open_artifact(tiny_path) as artifact:
            config = ModelConfig.from_dict(artifact.component("text").config)
        runner = runner_class.synthetic(config, synthetic_seed, device=device, **RUNNER_SHAPE)
    try:
        built = device.log
        phases = {"construct": [f"{len(built)} lines {_digest(chr(10).join(built).encode())}"]}
        for name, act in scenario or SCENARIO:
            device.log = []
            act(runner)
            phases[name] = device.log
        return phases
    finally:
        runner.close()


def traced_runner(runner_class: Any, tiny_path: Path, **shape: Any) -> Any:
    """A runner of the tiny model on a fresh `TracingDevice` (`runner.device`), log emptied."""
    device = TracingDevice(total_memory=2 << 30)
    runner = runner_class.from_artifact(tiny_path, device=device, **{**RUNNER_SHAPE, **shape})
    device.log, device.uploads = [], []
    return runner


def tiny_model(path: Path) -> Path:
    from tools.make_tiny import make_tiny

    make_tiny(path, family="dense", seed=0, vocab="small")
    return path


if __name__ == "__main__":
    import tempfile

    from runtime.model.gpu.runner import CudaRunner

    with tempfile.TemporaryDirectory() as tmp:
        tiny = tiny_model(Path(tmp) / "tiny.infernix")
        lines = {"artifact": trace(CudaRunner, tiny), "synthetic": trace(CudaRunner, tiny, SCENARIO[:2], 3)}
    Path(sys.argv[1]).write_text(json.dumps(lines, indent=0) + "\n")
