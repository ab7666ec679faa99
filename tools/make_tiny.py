"""Tiny random-weight Qwen3.5 / Qwen3.5-MoE / Qwen3-Next models for tests and demos.

    python -m tools.make_tiny OUT.infernix [--moe] [--next] [--seed N] [--vocab small|real]
                              [--hf-dir DIR] [--vision]

Writes a Hugging Face-format directory laid out like the real releases (Qwen3.5:
`model.language_model.*`, wrapped `text_config`, fused experts in the main layers and per-expert
MTP experts; Qwen3-Next: `model.*`, flat config, fused `in_proj_qkvz`/`in_proj_ba`, per-expert
experts), then converts it with `tools.convert`, so every tiny model also exercises the converter.

Shape: 4 layers (3 Gated DeltaNet + 1 full attention), hidden 256, attention 4 q / 2 kv heads of
64 (partial rotary 0.25), GDN 2 k-heads / 4 v-heads of 32 (so v-heads share k-heads), conv 4,
dense MLP 512 or 8 experts top-2 of 64 with a 64-wide shared expert, and a 1-layer MTP head.
Norm weights, A_log and dt_bias are random, not their identity initialisation, so a `w` vs
`1 + w` mix-up shows. `--vocab small`: a 512-row vocabulary with a byte-level BPE trained on a
built-in text plus all Qwen special tokens. `--vocab real`: the real Qwen tokenizer (248,320 rows
for Qwen3.5, 151,936 for Qwen3-Next) with tied embeddings to keep the file small (~130 MB).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

import numpy as np

from runtime.artifact import formats
from tools import convert

CHAT_TEMPLATES = Path(__file__).parent / "chat_templates"
SMALL_VOCAB = 512
SMALL_BPE_TOKENS = 448        # byte alphabet + merges; the special tokens follow
REAL_VOCAB = {"qwen3_5": 248320, "qwen3_next": 151936}     # padded embedding rows

# Training text for the small BPE: mixed languages, chat words, code and JSON, so that common
# pieces of test prompts become single tokens and the rest falls back to bytes.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. The user asks a question and the assistant answers.
You are a helpful assistant. Please think step by step, then give the final answer.
What is the weather like today in Paris? It is sunny, with a light breeze from the west.
system user assistant tool function parameter arguments name description required properties
{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
def main(argv):\n    for index, value in enumerate(values):\n        print(index, value)\n    return 0
import numpy as np; x = np.zeros((4, 4), dtype=np.float32); y = x @ x.T + 1.0
Le renard brun saute par-dessus le chien paresseux. Où est la bibliothèque, s'il vous plaît?
Der schnelle braune Fuchs springt über den faulen Hund. Grüße aus München und Köln!
El zorro marrón salta sobre el perro perezoso. ¿Dónde está la estación de tren?
敏捷的棕色狐狸跳过了懒狗。今天天气很好，我们去公园散步吧。
素早い茶色の狐が怠け者の犬を飛び越える。こんにちは、世界！
Быстрая коричневая лиса прыгает через ленивую собаку. Привет, мир!
1234567890 3.14159 2.71828 100% 42 + 58 = 100; the answer is 42.
Thinking about the problem: first, we read the input; second, we compute; finally, we reply.
"""


# ---------------------------------------------------------------------------------------------
# tokenizers

def small_tokenizer_json() -> bytes:
    """A byte-level BPE on `_CORPUS` with Qwen's pre-tokenizer regex and special tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, \
        pre_tokenizers, trainers
    from tools.tokenizer_json import FAMILIES
    _, _, specials, pattern = FAMILIES["qwen3_5"]
    tokenizer = Tokenizer(models.BPE(ignore_merges=True))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=SMALL_BPE_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer)
    tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False)
                                  for s in specials])
    return tokenizer.to_str().encode()


def special_ids(tokenizer_json: bytes) -> dict[str, int]:
    return {t["content"]: t["id"] for t in json.loads(tokenizer_json)["added_tokens"]}


def real_special_ids(tok_family: str) -> dict[str, int]:
    """Special token ids of the real vocabulary, without parsing its 10 MB tokenizer.json."""
    from tools.tokenizer_json import FAMILIES
    _, first_id, specials, _ = FAMILIES[tok_family]
    return {token: first_id + i for i, token in enumerate(specials)}


def chat_template(family: str) -> Optional[bytes]:
    """Our maintained template for the family, if the text layer has written it yet."""
    names = ["qwen3_next.jinja", "qwen3_5.jinja"] if family == "next" else ["qwen3_5.jinja"]
    for name in names:
        if (CHAT_TEMPLATES / name).is_file():
            return (CHAT_TEMPLATES / name).read_bytes()
    return None


# ---------------------------------------------------------------------------------------------
# config and weights

def tiny_text_config(family: str, vocab_size: int, ids: dict[str, int], tie: bool) -> dict:
    text = {
        "vocab_size": vocab_size, "hidden_size": 256, "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"], "full_attention_interval": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
        "attention_bias": False, "attn_output_gate": True, "initializer_range": 0.02,
        "tie_word_embeddings": tie, "dtype": "bfloat16", "mamba_ssm_dtype": "float32",
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|endoftext|>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    if family == "dense":
        text["intermediate_size"] = 512
    else:
        text.update({"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                     "shared_expert_intermediate_size": 64})
    if family == "next":
        # Qwen3-Next: flat config, rope at top level, no MRoPE, MTP undeclared (qwen-arch 1.1).
        text.update({"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
                     "rope_theta": 1e7, "partial_rotary_factor": 0.25, "intermediate_size": 512,
                     "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []})
        return text
    text.update({"model_type": "qwen3_5_text" if family == "dense" else "qwen3_5_moe_text",
                 "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                     "partial_rotary_factor": 0.25, "mrope_section": [3, 3, 2],
                                     "mrope_interleaved": True}})
    arch = "Qwen3_5ForConditionalGeneration" if family == "dense" else \
        "Qwen3_5MoeForConditionalGeneration"
    return {"architectures": [arch], "model_type": "qwen3_5" if family == "dense" else "qwen3_5_moe",
            "text_config": text, "tie_word_embeddings": tie, "language_model_only": True,
            "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"],
            "vision_end_token_id": ids["<|vision_end|>"]}


# The tiny vision tower: 2 blocks of width 64 (2 heads of 32), MLP 128, merge 2 into the LM
# hidden size. The pixel budget is small (64 to 1024 merged tokens) so test images stay cheap.
TINY_VISION = {"model_type": "qwen3_5_vision", "depth": 2, "hidden_size": 64, "num_heads": 2,
               "intermediate_size": 128, "hidden_act": "gelu_pytorch_tanh", "in_channels": 3,
               "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
               "out_hidden_size": 256, "num_position_embeddings": 64,
               "deepstack_visual_indexes": [],
               "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0}}
TINY_PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16,
                     "temporal_patch_size": 2, "merge_size": 2,
                     "size": {"shortest_edge": 64 * 32 * 32, "longest_edge": 1024 * 32 * 32},
                     "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
# Video: Qwen3.5's frame rule (2 fps, 4..768 frames, here at most 16) and a budget of 8 to 128
# merged tokens per video (frames * pixels, a frame group being 2 frames).
TINY_VIDEO_PREPROCESSOR = {"video_processor_type": "Qwen3VLVideoProcessor", "patch_size": 16,
                           "temporal_patch_size": 2, "merge_size": 2, "fps": 2,
                           "min_frames": 4, "max_frames": 16,
                           "size": {"shortest_edge": 8 * 32 * 32 * 2,
                                    "longest_edge": 128 * 32 * 32 * 2},
                           "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


def vision_tensors(rng: np.random.Generator, config: dict) -> dict[str, np.ndarray]:
    """Random tower weights under `model.visual.*`: LayerNorm weights around 1 and biases around
    0 (so a missing affine shows), linears and embeddings like the text model's."""
    from runtime.model.vision_reference import VisionConfig, vision_tensor_shapes

    out = {}
    for name, shape in vision_tensor_shapes(VisionConfig.from_dict(config)).items():
        if "norm" in name:
            value = rng.uniform(0.8, 1.2, shape) if name.endswith("weight") else \
                rng.uniform(-0.1, 0.1, shape)
        elif name.endswith("bias"):
            value = rng.uniform(-0.1, 0.1, shape)
        elif name == "pos_embed.weight":
            value = rng.uniform(-0.5, 0.5, shape)
        else:
            fan_in = int(np.prod(shape[1:]))
            value = rng.uniform(-1, 1, shape) * np.sqrt(3.0 / fan_in)
        out["model.visual." + name] = value.astype(np.float32)
    return out


def random_tensor(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Initial values by role, uniform (cheaper to draw than normal for the 63M-value real-vocab
    embedding). Linear weights get std 1/sqrt(fan_in), not HF's 0.02, so the tiny model's
    activations and logits keep useful magnitudes and greedy choices are clear."""
    def uniform(std: float, centre: float = 0.0) -> np.ndarray:
        values = rng.random(shape, dtype=np.float32)
        values -= np.float32(0.5)
        values *= np.float32(2 * np.sqrt(3) * std)     # uniform on [-a, a] has std a/sqrt(3)
        return values + np.float32(centre) if centre else values
    if name == "embed_tokens.weight":
        return uniform(0.125 if shape[0] > 100_000 else 0.5)
    if name == "lm_head.weight":
        return uniform(2.0 / np.sqrt(shape[1]))
    if name.endswith("linear_attn.norm.weight"):          # plain gated norm: around 1
        return uniform(0.1, centre=1.0)
    if "norm" in name:                                     # zero-centred norms: around 0
        return uniform(0.1)
    if name.endswith("A_log"):
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    if name.endswith("dt_bias"):
        return rng.uniform(0.5, 1.5, shape).astype(np.float32)
    if name.endswith("conv1d.weight"):
        return uniform(0.5)
    return uniform(1.0 / np.sqrt(shape[-1]))


def to_hf(family: str, component: str, name: str, value: np.ndarray) -> dict[str, np.ndarray]:
    """Checkpoint tensors (HF names) holding canonical tensor `name`, in the release layout."""
    if component == "mtp":
        prefix = "mtp."
    elif name == "lm_head.weight":
        prefix = ""
    else:
        prefix = "model." if family == "next" else "model.language_model."
    if name.endswith("conv1d.weight"):
        return {prefix + name: value[:, None, :]}
    per_expert = component == "mtp" or family == "next"
    if per_expert and name.endswith("mlp.experts.gate_up_proj"):
        base, inter = prefix + name.rsplit(".", 1)[0], value.shape[1] // 2
        out = {}
        for e, w in enumerate(value):
            out[f"{base}.{e}.gate_proj.weight"] = w[:inter]
            out[f"{base}.{e}.up_proj.weight"] = w[inter:]
        return out
    if per_expert and name.endswith("mlp.experts.down_proj"):
        base = prefix + name.rsplit(".", 1)[0]
        return {f"{base}.{e}.down_proj.weight": w for e, w in enumerate(value)}
    return {prefix + name: value}


def next_fuse(layer: dict[str, np.ndarray], text_cfg: dict) -> dict[str, np.ndarray]:
    """Qwen3-Next layout of one GDN layer's projections, built group by group as the Next
    checkpoint stores them: per k-head g, [q_g | k_g | v_g | z_g] and [b_g | a_g]."""
    hk, hv = text_cfg["linear_num_key_heads"], text_cfg["linear_num_value_heads"]
    dk, dv = text_cfg["linear_key_head_dim"], text_cfg["linear_value_head_dim"]
    r = hv // hk
    qkv, z = layer["in_proj_qkv"], layer["in_proj_z"]
    q, k, v = qkv[:hk * dk], qkv[hk * dk:2 * hk * dk], qkv[2 * hk * dk:]
    qkvz, ba = [], []
    for g in range(hk):
        heads = slice(g * r * dv, (g + 1) * r * dv)
        qkvz += [q[g * dk:(g + 1) * dk], k[g * dk:(g + 1) * dk], v[heads], z[heads]]
        ba += [layer["in_proj_b"][g * r:(g + 1) * r], layer["in_proj_a"][g * r:(g + 1) * r]]
    return {"in_proj_qkvz": np.concatenate(qkvz), "in_proj_ba": np.concatenate(ba)}


def write_hf_weights(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """model.safetensors in bf16 (float inputs are rounded to nearest even)."""
    from safetensors import TensorSpec, serialize_file
    keep = {name: np.ascontiguousarray(formats.f32_to_bf16(value))
            for name, value in tensors.items()}
    specs = {name: TensorSpec(dtype="bfloat16", shape=list(bits.shape),
                              data_ptr=bits.ctypes.data, data_len=bits.nbytes)
             for name, bits in keep.items()}
    serialize_file(specs, str(path), metadata={"format": "pt"})


def make_hf_dir(hf_dir: Path, *, family: str = "dense", seed: int = 0,
                vocab: str = "small", vision: bool = False) -> Path:
    """Write the tiny model as a Hugging Face directory; returns it. vision: add a tiny
    vision tower (`model.visual.*`, `vision_config`, a preprocessor config; Qwen3.5 only)."""
    if vision and family == "next":
        raise ValueError("Qwen3-Next has no vision tower")
    if family not in ("dense", "moe", "next"):
        raise ValueError(f"family must be dense, moe or next, not {family!r}")
    if vocab == "small":
        tokenizer_json, vocab_size = small_tokenizer_json(), SMALL_VOCAB
        ids = special_ids(tokenizer_json)
    elif vocab == "real":
        from tools.tokenizer_json import build_qwen_tokenizer_json
        tok_family = "qwen3_next" if family == "next" else "qwen3_5"
        # The builder is cached per argument list: call it the way the text tests do (default
        # argument for qwen3_5) so a test session builds the 248k vocabulary only once.
        tokenizer_json = build_qwen_tokenizer_json() if tok_family == "qwen3_5" else \
            build_qwen_tokenizer_json(tok_family)
        vocab_size = REAL_VOCAB[tok_family]
        ids = real_special_ids(tok_family)
    else:
        raise ValueError(f"vocab must be small or real, not {vocab!r}")
    tie = vocab == "real"
    config = tiny_text_config(family, vocab_size, ids, tie)
    text_cfg = convert.text_config(config, family)
    dims = convert.Dims.from_config(text_cfg, family)

    rng = np.random.default_rng(seed)
    hf: dict[str, np.ndarray] = {}
    for component, tensors in convert.model_tensors(dims, tie, mtp_layers=1).items():
        gdn: dict[str, dict[str, np.ndarray]] = {}
        for name, shape in tensors.items():
            value = random_tensor(rng, name, shape)
            layer, _, leaf = name.partition(".linear_attn.")
            if family == "next" and leaf.startswith("in_proj_"):
                gdn.setdefault(layer, {})[leaf.split(".")[0]] = value
                continue
            hf.update(to_hf(family, component, name, value))
        for layer, projections in gdn.items():
            for fused, value in next_fuse(projections, text_cfg).items():
                hf[f"model.{layer}.linear_attn.{fused}.weight"] = value

    if vision:
        config["vision_config"] = dict(TINY_VISION, out_hidden_size=text_cfg["hidden_size"])
        config["language_model_only"] = False
        hf.update(vision_tensors(rng, dict(config["vision_config"], **{
            k: config[k] for k in ("image_token_id", "vision_start_token_id",
                                   "vision_end_token_id")})))
    hf_dir.mkdir(parents=True, exist_ok=True)
    if vision:
        (hf_dir / "preprocessor_config.json").write_text(json.dumps(TINY_PREPROCESSOR, indent=2))
        (hf_dir / "video_preprocessor_config.json").write_text(
            json.dumps(TINY_VIDEO_PREPROCESSOR, indent=2))
    write_hf_weights(hf_dir / "model.safetensors", hf)
    (hf_dir / "config.json").write_text(json.dumps(config, indent=2))
    (hf_dir / "tokenizer.json").write_bytes(tokenizer_json)
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "add_bos_token": False, "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "model_max_length": 262144, "errors": "replace", "split_special_tokens": False},
        indent=2))
    (hf_dir / "generation_config.json").write_text(json.dumps({
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"], "do_sample": True, "temperature": 0.6,
        "top_k": 20, "top_p": 0.95}, indent=2))
    template = chat_template(family)
    if template is not None:
        (hf_dir / "chat_template.jinja").write_bytes(template)
    return hf_dir


def make_tiny(out_path, *, family: str = "dense", seed: int = 0, vocab: str = "small",
              hf_dir=None, log=None, on_phase=None, vision: bool = False) -> Path:
    """Write the tiny model as HF directory `hf_dir` (default: `<OUT stem>-hf` next to OUT)
    and as artifact `out_path`; returns the artifact path. `log`: stream for converter
    progress (None: quiet). `on_phase(text)`: called as each of the two phases starts."""
    out_path = Path(out_path)
    hf_dir = Path(hf_dir) if hf_dir is not None else out_path.with_name(out_path.stem + "-hf")
    if on_phase is not None:
        on_phase(f"1/2 random weights and the {vocab} vocabulary's tokenizer")
    make_hf_dir(hf_dir, family=family, seed=seed, vocab=vocab, vision=vision)
    if on_phase is not None:
        on_phase("2/2 converting to .infernix")
    return convert.convert(hf_dir, out_path, convert.Recipe("import"),
                           name=f"tiny-{family}{'-vision' if vision else ''}-{vocab}-seed{seed}",
                           log=log)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.make_tiny",
                                     description="Write a tiny random Qwen hybrid model.")
    parser.add_argument("out", type=Path, help="output .infernix file")
    family = parser.add_mutually_exclusive_group()
    family.add_argument("--moe", action="store_true", help="Qwen3.5-MoE layout")
    family.add_argument("--next", action="store_true", help="Qwen3-Next layout")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab", choices=("small", "real"), default="small")
    parser.add_argument("--vision", action="store_true", help="add a tiny vision tower")
    parser.add_argument("--hf-dir", type=Path, help="where the HF directory goes "
                        "(default: <OUT stem>-hf next to OUT)")
    args = parser.parse_args(argv)
    name = "moe" if args.moe else "next" if args.next else "dense"
    if chat_template(name) is None:
        print("note: tools/chat_templates has no template yet; none embedded", file=sys.stderr)
    make_tiny(args.out, family=name, seed=args.seed, vocab=args.vocab, hf_dir=args.hf_dir,
              log=sys.stderr, vision=args.vision)
    return 0


if __name__ == "__main__":
    sys.exit(main())
