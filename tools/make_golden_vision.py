"""Golden data for the NumPy vision path, from Hugging Face transformers' Qwen3.5 model.

Builds a tiny random `Qwen3_5ForConditionalGeneration` (the text model of `make_golden`'s dense
family plus a 2-block vision tower) in float32 with eager attention, feeds it a prompt with two
images of different grids, and writes

    tests/data/golden/vision/config.json        composite HF config (`text_config`, `vision_config`)
    tests/data/golden/vision/model.safetensors  bf16 weights (`model.language_model.*`,
                                                `model.visual.*`; tied head)
    tests/data/golden/vision/golden.npz         the oracle's outputs (below)

golden.npz:
    ids [T] int64, pixels_0 / pixels_1 [H, W, 3] uint8 (the decoded images),
    patches_0 / patches_1 [N, 1536] float32 and grid_0 / grid_1 [3]: the tower's input, made by
        `runtime.media.image.prepare_image` (transformers' image processor needs Pillow or
        torchvision, so the oracle here is the model, not the resize),
    image_embeds_0 / image_embeds_1 [N/4, H]: the merger's outputs,
    positions [3, T]: transformers' MRoPE position ids (`get_rope_index`),
    logits [T, V]: the full prompt; decode_logits [V]: ids[-1] as one cached decode step after
        ids[:-1] (it uses the rope delta).

Weights are drawn as `make_golden` draws them (norms perturbed, everything rounded to bf16 and
kept in float32), LayerNorm affines of the tower perturbed too. Made on the CPU (2 cores, torch
2.13.0+cpu, transformers 5.24.0, about 5 s):

    python tools/make_golden_vision.py --out tests/data/golden/vision

Needs torch, transformers and safetensors: a dev tool, never imported by the runtime.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.media.image import ImageRules, prepare_image  # noqa: E402
from tools.make_golden import perturb_and_round, text_config_kwargs  # noqa: E402

SEED = 4321
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 505, 506, 503, 504
VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
              patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
              num_position_embeddings=64, hidden_act="gelu_pytorch_tanh",
              rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
# 4..16 merged tokens: image 0 (60 x 90) -> 64 x 96 pixels, grid 1 x 4 x 6 (6 tokens, extent 3);
# image 1 (40 x 120) -> 32 x 128, grid 1 x 2 x 8 (4 tokens, extent 4).
RULES = ImageRules(min_pixels=4 * 32 * 32, max_pixels=16 * 32 * 32)
IMAGE_SHAPES = ((60, 90), (40, 120))


def build_model():
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = text_config_kwargs("dense")
    config = Qwen3_5Config(text_config=text, vision_config=VISION, image_token_id=IMAGE_TOKEN,
                           video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
                           vision_end_token_id=VISION_END, tie_word_embeddings=True)
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = Qwen3_5ForConditionalGeneration(config).float().eval()
    generator = torch.Generator().manual_seed(SEED)
    perturb_and_round(model, generator)
    with torch.no_grad():               # LayerNorms start at weight 1, bias 0: perturb them too
        for name, param in model.named_parameters():
            if name.startswith("model.visual.") and "norm" in name:
                noise = torch.randn(param.shape, generator=generator)
                param.copy_((param + 0.2 * noise).to(torch.bfloat16).float())
    return config, model


def prompt(rng: np.random.Generator, counts: list[int]) -> list[int]:
    text = lambda n: rng.integers(0, 490, n).tolist()  # noqa: E731 (ids below the specials)
    ids = text(5)
    for i, count in enumerate(counts):
        ids += [VISION_START] + [IMAGE_TOKEN] * count + [VISION_END] + text(4 if i == 0 else 6)
    return ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.use_deterministic_algorithms(True)
    config, model = build_model()
    rng = np.random.default_rng(SEED)
    decoded = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in IMAGE_SHAPES]
    images = [prepare_image(pixels, RULES) for pixels in decoded]
    ids = prompt(rng, [image.merged_tokens(2) for image in images])
    input_ids = torch.tensor([ids])
    pixel_values = torch.from_numpy(np.concatenate([image.patches for image in images]))
    grid = torch.tensor([image.grid for image in images])
    types = (input_ids == IMAGE_TOKEN).int()
    with torch.no_grad():
        embeds = model.model.get_image_features(pixel_values, grid, return_dict=True).pooler_output
        positions, _ = model.model.get_rope_index(input_ids, mm_token_type_ids=types,
                                                  image_grid_thw=grid)
        logits = model(input_ids=input_ids, pixel_values=pixel_values, image_grid_thw=grid,
                       mm_token_type_ids=types).logits[0]
        model.model.rope_deltas = None
        prefix = model(input_ids=input_ids[:, :-1], pixel_values=pixel_values,
                       image_grid_thw=grid, mm_token_type_ids=types[:, :-1], use_cache=True)
        cache = prefix.past_key_values
        decode = model(input_ids=input_ids[:, -1:], cache=cache, use_cache=True,
                       mm_token_type_ids=types[:, -1:]).logits[0, -1]
    args.out.mkdir(parents=True, exist_ok=True)
    golden = {"ids": np.array(ids, np.int64), "positions": positions[:, 0].numpy(),
              "logits": logits.numpy(), "decode_logits": decode.numpy()}
    for i, image in enumerate(images):
        golden.update({f"pixels_{i}": decoded[i], f"patches_{i}": image.patches,
                       f"grid_{i}": np.array(image.grid), f"image_embeds_{i}": embeds[i].numpy()})
    np.savez_compressed(args.out / "golden.npz", **golden)
    document = config.to_dict()
    document["text_config"]["mtp_num_hidden_layers"] = 0
    (args.out / "config.json").write_text(json.dumps(document, indent=2, sort_keys=True))
    tensors = {name: value.to(torch.bfloat16).contiguous()
               for name, value in model.state_dict().items() if name != "lm_head.weight"}
    save_file(tensors, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    print(f"wrote {args.out}: T={len(ids)}, max |logit| {float(logits.abs().max()):.4f}, "
          f"torch {torch.__version__}, transformers {transformers.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
