"""`CudaRunner`'s host side on the null device: layout, binding, validation, graphs per bucket.

Kernels do not run here (the null device records launches), so this checks what reaches the
driver, not values; `tests/gpu/test_cuda_runner.py` checks values on a GPU. Needs the built
kernels (`python build_kernels.py`) and skips without them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from runtime.model.runner import DecodeItem, PrefillChunk

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    from runtime.cuda.manifest import ManifestError
    from runtime.cuda.null import NullDevice
    from runtime.model.cuda_runner import CudaRunner
    from tools.make_tiny import make_tiny

    if not (REPO / "build" / "kernels" / "sm_90a" / "manifest.json").exists():
        pytest.skip("kernels not built")
    path = tmp_path_factory.mktemp("tiny") / "tiny.infernix"
    make_tiny(path, family="dense", seed=0, vocab="small")
    device = NullDevice(total_memory=2 << 30)
    try:
        r = CudaRunner.from_artifact(path, num_pages=16, num_slots=4, device=device, prefill_chunk=64)
    except ManifestError as exc:
        pytest.skip(f"kernels not built: {exc}")
    except Exception as exc:  # a stale or partial build
        if type(exc).__name__ in ("KernelMissing", "KernelStale"):
            pytest.skip(str(exc))
        raise
    yield r
    r.close()


def test_shapes_and_pieces(runner):
    out = runner.prefill(PrefillChunk(slot=0, token_ids=list(range(1, 150)), start_pos=0, page_table=[0, 1, 2],
                                      all_logits=True))
    assert out.shape == (149, runner.vocab_size) and out.dtype == np.float32
    last = runner.prefill(PrefillChunk(slot=1, token_ids=[5, 6], start_pos=0, page_table=[3]))
    assert last.shape == (1, runner.vocab_size)


def test_decode_graph_per_bucket(runner):
    dev = runner.device
    items = [DecodeItem(slot=0, token_id=5, pos=149, page_table=[0, 1, 2]),
             DecodeItem(slot=1, token_id=7, pos=2, page_table=[3])]
    before = len(runner._graphs)
    assert runner.decode(items).shape == (2, runner.vocab_size)
    assert runner.decode(items[:1]).shape == (1, runner.vocab_size)
    assert len(runner._graphs) == before + 2  # buckets 2 and 1
    n = len(dev.launches)
    runner.decode(items)
    replayed = dev.launches[n:]
    assert replayed and all(launch.graph_replay for launch in replayed)


def test_rejects_bad_requests(runner):
    with pytest.raises(ValueError, match="slot"):
        runner.decode([DecodeItem(slot=9, token_id=1, pos=0, page_table=[0])])
    with pytest.raises(ValueError, match="distinct"):
        runner.decode([DecodeItem(slot=0, token_id=1, pos=0, page_table=[0])] * 2)
    with pytest.raises(ValueError, match="page table"):
        runner.prefill(PrefillChunk(slot=0, token_ids=[1] * 70, start_pos=0, page_table=[0]))
    with pytest.raises(ValueError, match="token ids"):
        runner.prefill(PrefillChunk(slot=0, token_ids=[runner.vocab_size], start_pos=0, page_table=[0]))
    with pytest.raises(ValueError, match="max_batch"):
        runner.decode([DecodeItem(slot=i % 4, token_id=1, pos=0, page_table=[0]) for i in range(9)])
