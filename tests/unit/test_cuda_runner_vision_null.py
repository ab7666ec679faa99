"""`CudaRunner` with a vision tower on the null device: what reaches the device for a prompt with
an image. Kernels do not run here, so the tower's encoder is swapped for the NumPy tower (its rows
are then real values to find in the residual); `tests/gpu/test_vision_cuda.py` runs it all on a
GPU against the CPU backend. Needs the built kernels and skips without them."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.model.runner import DecodeItem, PrefillChunk

from null_cuda import built_or_skip


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from runtime.artifact import open_artifact
    from runtime.cuda.null import NullDevice
    from runtime.media.image import ImageRules, prepare_image
    from runtime.media.placement import expand_pads
    from runtime.model.gpu.runner import CudaRunner
    from runtime.model.vision_reference import MediaEmbedder, VisionConfig, VisionTower
    from runtime.model.weights import ComponentTensors
    from tools.make_tiny import make_tiny

    path = make_tiny(tmp_path_factory.mktemp("vision") / "v.infernix", vision=True)
    artifact = open_artifact(path)
    component = artifact.component("vision")
    tower = VisionTower(VisionConfig.from_dict(component.config), ComponentTensors(component))
    runner = built_or_skip(lambda: CudaRunner.from_artifact(artifact, vision=True, num_pages=16, num_slots=2,
                                                            device=NullDevice(total_memory=2 << 30),
                                                            prefill_chunk=64))
    runner._media.embedder = MediaEmbedder(tower)      # real rows: the null device runs no kernel
    config = artifact.component("text").config
    rules = ImageRules(patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=16, max_pixels=64 * 96)
    image = prepare_image(np.random.default_rng(1).integers(0, 256, (64, 96, 3), dtype=np.uint8), rules)
    text = list(range(20, 30))
    ids = text + [config["vision_start_token_id"], config["image_token_id"], config["vision_end_token_id"]] + text
    ids, media = expand_pads(ids, [image], config["image_token_id"], 2)
    yield runner, tower, np.asarray(ids), media
    runner.close()
    artifact.close()


def meta_block(runner) -> dict:
    steps, st = runner.steps, runner.storage
    return steps.meta_views(st.meta_hosts[steps._meta_turn].array(np.int32, st.meta_count))


def test_prefill_rotary_rows_and_media_rows(model):
    from runtime.model.mrope import mrope_positions

    runner, tower, ids, media = model
    st = runner.storage
    assert "rope_pos" in st.meta_off and st.rope_rows == st.rope_positions + st.rows
    (span,) = media
    pads = np.flatnonzero(ids == tower.config.image_token_id)
    assert len(pads) == 6 and pads[0] == span.offset == 11           # 64 x 96 pixels: 2 x 3 merged
    runner.prefill(PrefillChunk(slot=0, token_ids=ids.tolist(), start_pos=0, page_table=[0], media=media))
    meta = meta_block(runner)
    t = len(ids)
    # A piece with a block rotates every row at its own table row past the positions.
    np.testing.assert_array_equal(meta["rope_pos"][:t], st.rope_positions + np.arange(t))
    np.testing.assert_array_equal(meta["pos"][:t], np.arange(t))
    piece = runner._media.piece(ids, 0, media)
    rope = mrope_positions(np.arange(t), media, 2)
    assert rope[1, 11:17].tolist() == [11, 11, 11, 12, 12, 12] and rope[2, 11:17].tolist() == [11, 12, 13] * 2
    assert rope[0, 17] == 11 + 3 and piece.tables is not None      # text resumes at start + extent
    ((row0, rows),) = piece.embeddings
    assert row0 == 11 and rows.shape == (6, runner.config.hidden_size)
    from runtime.artifact.formats import bf16_to_f32
    np.testing.assert_allclose(bf16_to_f32(rows), tower.encode(span.patches, span.grid), rtol=1e-2, atol=1e-2)


def test_decode_after_an_image_rotates_at_the_shift(model):
    runner, tower, ids, media = model
    t = len(ids)
    runner.decode([DecodeItem(slot=0, token_id=5, pos=t, page_table=[0], media=media),
                   DecodeItem(slot=1, token_id=6, pos=3, page_table=[1])])
    meta = meta_block(runner)
    # 6 pads take an extent of 3 positions: text after them rotates 3 behind its KV position.
    assert meta["pos"][:2].tolist() == [t, 3] and meta["rope_pos"][:2].tolist() == [t - 3, 3]
    # The shift is for that step only: a text step next rotates at the KV positions.
    runner.decode([DecodeItem(slot=1, token_id=6, pos=4, page_table=[1])])
    assert meta_block(runner)["rope_pos"][0] == 4


def test_media_without_a_tower_is_refused(tmp_path):
    from runtime.cuda.null import NullDevice
    from runtime.model.gpu.runner import CudaRunner
    from runtime.model.runner import MediaSpan
    from tools.make_tiny import make_tiny

    path = make_tiny(tmp_path / "t.infernix", family="dense", seed=0, vocab="small")
    runner = built_or_skip(lambda: CudaRunner.from_artifact(path, num_pages=4, num_slots=1,
                                                            device=NullDevice(total_memory=1 << 30),
                                                            prefill_chunk=64))
    try:
        assert "rope_pos" not in runner.storage.meta_off
        span = MediaSpan(offset=0, grid=(1, 2, 2), patches=np.zeros((4, 1536), np.float32))
        with pytest.raises(ValueError, match="no vision tower"):
            runner.prefill(PrefillChunk(slot=0, token_ids=[1, 2], start_pos=0, page_table=[0], media=(span,)))
    finally:
        runner.close()
