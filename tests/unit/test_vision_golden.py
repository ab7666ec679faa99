"""The NumPy vision path against transformers' Qwen3.5 (golden data, tools/make_golden_vision.py).

The committed checkpoint goes through the product path (tools.convert -> .infernix -> NumpyRunner
with the vision component), then the tower's merged embeddings, the MRoPE positions, the
full-prompt logits and one cached decode step are compared with the oracle's within the
tolerance of test_model_golden. The images' patches were made by our preprocessing; the test
also checks that it still makes them from the stored pixels.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from runtime.media.image import ImageRules, prepare_image
from runtime.model import mrope
from runtime.model.numpy_runner import NumpyRunner
from runtime.model.runner import PAGE_SIZE, DecodeItem, MediaSpan, PrefillChunk
from tests.unit.test_model_golden import TOLERANCE, relative_error, write_small_tokenizer
from tools import convert

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden" / "vision"
RULES = ImageRules(min_pixels=4 * 32 * 32, max_pixels=16 * 32 * 32)   # as the generator's


@pytest.fixture(scope="module")
def golden():
    with np.load(GOLDEN / "golden.npz") as data:
        return dict(data)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    work = tmp_path_factory.mktemp("vision")
    source = work / "hf"
    source.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(GOLDEN / name, source / name)
    write_small_tokenizer(source, 512)
    return convert.convert(source, work / "vision.infernix", convert.Recipe("bf16"), log=None)


def spans(golden) -> tuple[MediaSpan, ...]:
    ids = golden["ids"]
    starts = [i + 1 for i in np.flatnonzero(ids == 503)]          # after each vision_start
    return tuple(MediaSpan(offset=int(start), grid=tuple(int(v) for v in golden[f"grid_{i}"]),
                           patches=golden[f"patches_{i}"], digest=f"golden-{i}")
                 for i, start in enumerate(starts))


def test_preprocessing_still_makes_the_golden_patches(golden):
    for i in range(2):
        image = prepare_image(golden[f"pixels_{i}"], RULES)
        assert image.grid == tuple(golden[f"grid_{i}"])
        np.testing.assert_array_equal(image.patches, golden[f"patches_{i}"])


def test_mrope_positions_match_transformers(golden):
    ids = golden["ids"]
    ours = mrope.mrope_positions(np.arange(len(ids)), spans(golden), merge=2)
    np.testing.assert_array_equal(ours, golden["positions"])
    # The text after the last image resumes at its start + extent: a negative delta here.
    assert ours[0, -1] - (len(ids) - 1) == (3 - 6) + (4 - 4)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tower_logits_and_decode_match_transformers(golden, artifact, dtype):
    runner = NumpyRunner.from_artifact(artifact, num_pages=2, num_slots=2, dtype=dtype,
                                       vision=True)
    media = spans(golden)
    for i, span in enumerate(media):
        embeds = runner.vision.tower.encode(span.patches, span.grid)
        assert relative_error(embeds, golden[f"image_embeds_{i}"]) <= TOLERANCE
    ids = golden["ids"].tolist()
    logits = runner.prefill(PrefillChunk(0, ids, 0, [0], all_logits=True, media=media))
    assert relative_error(logits, golden["logits"]) <= TOLERANCE
    runner.reset_slot(1)
    # The prefix in two chunks (the first ends inside image 0), then the decode step.
    runner.prefill(PrefillChunk(1, ids[:9], 0, [1], media=media))
    runner.prefill(PrefillChunk(1, ids[9:-1], 9, [1], media=media))
    decode = runner.decode([DecodeItem(1, ids[-1], len(ids) - 1, [1], media=media)])[0]
    assert relative_error(decode, golden["decode_logits"]) <= TOLERANCE
    assert len(ids) < PAGE_SIZE


def test_golden_catches_plain_positions_and_missing_embeddings(golden, artifact, monkeypatch):
    """With 1-D positions for the images, or with the pads' own embeddings, the logits move far
    beyond the tolerance: the comparison above does test MRoPE and the placement."""
    ids, media = golden["ids"].tolist(), spans(golden)
    runner = NumpyRunner.from_artifact(artifact, num_pages=1, num_slots=1, vision=True)
    text_only = runner.prefill(PrefillChunk(0, ids, 0, [0], all_logits=True))
    assert relative_error(text_only, golden["logits"]) > 100 * TOLERANCE
    monkeypatch.setattr(mrope, "mrope_positions",
                        lambda positions, spans, merge: np.broadcast_to(positions,
                                                                        (3, *positions.shape)))
    runner.reset_slot(0)
    plain = runner.prefill(PrefillChunk(0, ids, 0, [0], all_logits=True, media=media))
    assert relative_error(plain, golden["logits"]) > 100 * TOLERANCE
