"""tools/convert.py: HF checkpoint -> artifact round trips (bit-exact for bf16 and `import` of
quantised releases, within the format's bound for the fp8/nvfp4 recipes), sharded and per-expert
sources, Qwen3-Next regrouping, streaming memory, progress lines and every error path."""

import json
import re
import shutil
import tracemalloc

import numpy as np
import pytest

from runtime.artifact import formats, open_artifact
from tools import convert
from tools.convert import Checkpoint, ConvertError, Recipe
from tools.make_tiny import next_fuse, to_hf

ST_NAMES = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "U8": "uint8", "F32": "float32"}
QUANTIZED_HF = re.compile(r"(q|k|v|o|gate|up|down|out)_proj\.weight$|in_proj_(qkv|z|qkvz)\.weight$")


def hf_dir_of(artifact_path):
    return artifact_path.with_name(artifact_path.stem + "-hf")


def read_hf(directory):
    ck = Checkpoint(directory)
    return {name: (ck.dtype(name), ck.read(name)) for name in ck.where}


def save_hf(src, dst, tensors, config=None, shards=1):
    """Copy HF directory `src` to `dst` with `tensors` ({name: (dtype, array)}) as weights,
    split into `shards` files with an index when more than one."""
    from safetensors import TensorSpec, serialize_file
    dst.mkdir()
    for item in src.iterdir():
        if item.suffix != ".safetensors" and item.name != "model.safetensors.index.json":
            shutil.copy(item, dst / item.name)
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    names = list(tensors)
    weight_map = {}
    for index, chunk in enumerate(np.array_split(np.arange(len(names)), shards)):
        filename = "model.safetensors" if shards == 1 else \
            f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        keep = {names[i]: np.ascontiguousarray(tensors[names[i]][1]) for i in chunk}
        specs = {n: TensorSpec(dtype=ST_NAMES[tensors[n][0]], shape=list(a.shape),
                               data_ptr=a.ctypes.data, data_len=a.nbytes) for n, a in keep.items()}
        serialize_file(specs, str(dst / filename))
        weight_map.update({n: filename for n in keep})
    if shards > 1:
        (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dst


def unfuse_experts(tensors):
    """Per-expert checkpoint names instead of fused 3-D experts (as FP8/NVFP4 releases ship)."""
    out = {}
    for name, (dtype, array) in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            inter = array.shape[1] // 2
            for e, w in enumerate(array):
                out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = (dtype, w[:inter])
                out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = (dtype, w[inter:])
        elif name.endswith("mlp.experts.down_proj"):
            for e, w in enumerate(array):
                out[name.replace("down_proj", f"{e}.down_proj.weight")] = (dtype, w)
        else:
            out[name] = (dtype, array)
    return out


def quantize_hf(tensors, scheme):
    """Encode the linear weights as a quantised release would (qwen-arch.md section 6)."""
    out = {}
    for name, (dtype, array) in unfuse_experts(tensors).items():
        if not QUANTIZED_HF.search(name):
            out[name] = (dtype, array)
            continue
        module, w = name[:-len(".weight")], formats.bf16_to_f32(array)
        if scheme in ("fp8", "fp8_bf16_scales"):
            codes, scales = formats.fp8_block_quantize(w)
            out[name] = ("F8_E4M3", codes)
            out[f"{module}.weight_scale_inv"] = ("BF16", formats.f32_to_bf16(scales)) \
                if scheme == "fp8_bf16_scales" else ("F32", scales)
            continue
        packed, scales, global_scale = formats.nvfp4_quantize(w)
        if scheme == "modelopt":
            out[name] = ("U8", packed)
            out[f"{module}.weight_scale"] = ("F8_E4M3", scales)
            out[f"{module}.weight_scale_2"] = ("F32", global_scale.reshape(()))
            out[f"{module}.input_scale"] = ("F32", np.float32(0.5).reshape(()))
        else:                              # compressed-tensors: the global is a divisor
            out[f"{module}.weight_packed"] = ("U8", packed)
            out[f"{module}.weight_scale"] = ("F8_E4M3", scales)
            out[f"{module}.weight_global_scale"] = ("F32", (1 / global_scale).astype(np.float32))
            out[f"{module}.input_global_scale"] = ("F32", np.float32([2.0]))
    return out


def to_artifact(src, out, recipe="import", **kwargs):
    return convert.convert(src, out, Recipe(recipe, **kwargs), log=None)


FAMILY_OF = {"tiny_dense_path": "dense", "tiny_moe_path": "moe", "tiny_next_path": "next"}


# ---- bit-exact round trips -------------------------------------------------------------------

@pytest.mark.parametrize("fixture", list(FAMILY_OF))
def test_bf16_round_trip_is_bit_exact_and_covers_every_checkpoint_tensor(fixture, request):
    """Map every artifact tensor back to checkpoint names (the layout make_tiny writes) and
    compare bits: the converter must be the exact inverse, with nothing left over."""
    path, family = request.getfixturevalue(fixture), FAMILY_OF[fixture]
    source = read_hf(hf_dir_of(path))
    rebuilt = {}
    with open_artifact(path) as art:
        for component in art.component_names:
            comp = art.component(component)
            gdn = {}
            for name in comp.tensor_names():
                assert comp.entry(name).format == "bf16"
                bits = comp.raw(name)
                layer, _, leaf = name.partition(".linear_attn.")
                if family == "next" and leaf.startswith("in_proj_"):
                    gdn.setdefault(layer, {})[leaf.split(".")[0]] = bits
                    continue
                rebuilt.update(to_hf(family, component, name, bits))
            text_cfg = art.component("text").config
            for layer, projections in gdn.items():
                for fused, value in next_fuse(projections, text_cfg).items():
                    rebuilt[f"model.{layer}.linear_attn.{fused}.weight"] = value
    assert set(rebuilt) == set(source)
    for name, (dtype, array) in source.items():
        assert dtype == "BF16" and np.array_equal(rebuilt[name], array), name


def test_next_regroup_rows_follow_the_spec():
    # Hk=2, Hv=4 (r=2), dk=dv=1: each qkvz group is [q k v v z z], each ba group [b b a a].
    dims = convert.Dims(8, 16, 1, 1, 1, 2, 4, 1, 1, 4, 8, 0, 0, 0, ("linear_attention",), (False,))
    rows = convert.next_regroup_rows(dims)
    assert {k: v.tolist() for k, v in rows.items()} == {
        "q": [0, 6], "k": [1, 7], "v": [2, 3, 8, 9], "z": [4, 5, 10, 11],
        "b": [0, 1, 4, 5], "a": [2, 3, 6, 7]}


def test_sharded_source_with_index_gives_the_same_artifact(tiny_dense_path, tmp_path):
    src = hf_dir_of(tiny_dense_path)
    sharded = save_hf(src, tmp_path / "sharded", read_hf(src), shards=3)
    assert len(list(sharded.glob("*.safetensors"))) == 3
    out = to_artifact(sharded, tmp_path / "s.infernix")
    assert_same_tensors(out, tiny_dense_path)


def test_per_expert_source_equals_fused_source(tiny_moe_path, tmp_path):
    src = hf_dir_of(tiny_moe_path)
    per_expert = save_hf(src, tmp_path / "pe", unfuse_experts(read_hf(src)))
    assert_same_tensors(to_artifact(per_expert, tmp_path / "pe.infernix"), tiny_moe_path)


def assert_same_tensors(a_path, b_path):
    with open_artifact(a_path) as a, open_artifact(b_path) as b:
        assert a.component_names == b.component_names
        for component in a.component_names:
            ca, cb = a.component(component), b.component(component)
            assert ca.config == cb.config and ca.tensor_names() == cb.tensor_names()
            for name in ca.tensor_names():
                for part in ca.entry(name).parts:
                    assert np.array_equal(ca.raw(name, part), cb.raw(name, part)), name


# ---- quantised sources -----------------------------------------------------------------------

def expected_parts(source, hf_name, scheme):
    """The artifact parts an `import` must produce for one checkpoint linear weight."""
    module = hf_name[:-len(".weight")]
    if scheme.startswith("fp8"):
        scale_dtype, scale = source[f"{module}.weight_scale_inv"]
        scale = formats.bf16_to_f32(scale) if scale_dtype == "BF16" else scale
        return {"data": source[hf_name][1], "scale": scale}
    if scheme == "modelopt":
        return {"data": source[hf_name][1], "scale": source[f"{module}.weight_scale"][1],
                "global_scale": source[f"{module}.weight_scale_2"][1].reshape(1)}
    return {"data": source[f"{module}.weight_packed"][1],
            "scale": source[f"{module}.weight_scale"][1],
            "global_scale": (1 / source[f"{module}.weight_global_scale"][1]).astype(np.float32)}


@pytest.mark.parametrize("scheme", ["fp8", "fp8_bf16_scales", "modelopt", "ct"])
def test_import_of_quantized_release_is_bit_exact(scheme, tiny_moe_path, tmp_path):
    src = hf_dir_of(tiny_moe_path)
    source = quantize_hf(read_hf(src), scheme)
    out = to_artifact(save_hf(src, tmp_path / scheme, source), tmp_path / "q.infernix")
    fmt = "fp8_e4m3" if scheme.startswith("fp8") else "nvfp4"
    P = "model.language_model."
    with open_artifact(out) as art:
        text, mtp = art.component("text"), art.component("mtp")
        for comp, name, hf in [(text, "layers.0.linear_attn.in_proj_qkv.weight",
                                P + "layers.0.linear_attn.in_proj_qkv.weight"),
                               (text, "layers.3.self_attn.q_proj.weight",
                                P + "layers.3.self_attn.q_proj.weight"),
                               (mtp, "layers.0.mlp.shared_expert.down_proj.weight",
                                "mtp.layers.0.mlp.shared_expert.down_proj.weight")]:
            assert comp.entry(name).format == fmt
            for part, value in expected_parts(source, hf, scheme).items():
                assert np.array_equal(comp.raw(name, part), value), (name, part)
        # Fused experts: per-expert encodings stacked, gate|up rows concatenated, one global
        # (or one block-row range) per half: still bit-exact.
        for comp, base in [(text, P + "layers.1.mlp.experts"), (mtp, "mtp.layers.0.mlp.experts")]:
            entry = comp.entry(f"layers.{1 if comp is text else 0}.mlp.experts.gate_up_proj")
            assert (entry.format, entry.row_groups) == (fmt, 2)
            for part in entry.parts:
                want = np.stack([np.concatenate(
                    [expected_parts(source, f"{base}.{e}.{p}_proj.weight", scheme)[part]
                     for p in ("gate", "up")], axis=-1 if part == "global_scale" else -2)
                    for e in range(8)])
                assert np.array_equal(comp.raw(entry.name, part), want), part
        norm = text.raw("layers.0.input_layernorm.weight")
        assert np.array_equal(norm, source[P + "layers.0.input_layernorm.weight"][1])
        assert text.entry("layers.0.linear_attn.in_proj_a.weight").format == "bf16"
        assert art.metadata["recipe"] == "import"


def test_import_of_next_nvfp4_regroups_exactly(tiny_next_path, tmp_path):
    """nvfp4 scales are per row, so regrouping in_proj_qkvz moves encoded rows untouched."""
    src = hf_dir_of(tiny_next_path)
    source = quantize_hf(read_hf(src), "modelopt")
    out = to_artifact(save_hf(src, tmp_path / "n", source), tmp_path / "n.infernix")
    rows = None
    with open_artifact(out) as art:
        text = art.component("text")
        dims = convert.Dims.from_config(text.config, "next")
        rows = convert.next_regroup_rows(dims)
        fused = expected_parts(source, "model.layers.0.linear_attn.in_proj_qkvz.weight", "modelopt")
        qkv = np.concatenate([rows["q"], rows["k"], rows["v"]])
        for part in ("data", "scale"):
            assert np.array_equal(text.raw("layers.0.linear_attn.in_proj_qkv.weight", part),
                                  fused[part][qkv])
            assert np.array_equal(text.raw("layers.0.linear_attn.in_proj_z.weight", part),
                                  fused[part][rows["z"]])
        assert text.entry("layers.0.linear_attn.in_proj_b.weight").format == "bf16"


def test_bf16_recipe_dequantizes_quantized_sources(tiny_dense_path, tmp_path):
    src = hf_dir_of(tiny_dense_path)
    source = quantize_hf(read_hf(src), "fp8")
    out = to_artifact(save_hf(src, tmp_path / "f", source), tmp_path / "b.infernix", "bf16")
    name = "model.language_model.layers.0.mlp.down_proj.weight"
    parts = expected_parts(source, name, "fp8")
    want = formats.f32_to_bf16(formats.fp8_block_dequantize(parts["data"], parts["scale"]))
    with open_artifact(out) as art:
        text = art.component("text")
        assert text.entry("layers.0.mlp.down_proj.weight").format == "bf16"
        assert np.array_equal(text.raw("layers.0.mlp.down_proj.weight"), want)


def test_per_tensor_and_per_channel_fp8_sources(tiny_dense_path, tmp_path):
    """Per-tensor scales expand exactly into the block grid; per-channel scales cannot, so
    those weights are decoded (and re-encoded by the target format)."""
    src = hf_dir_of(tiny_dense_path)
    tensors = read_hf(src)
    codes = np.random.default_rng(0).integers(0, 0x7E, (512, 256)).astype(np.uint8)
    gate, up = P + "layers.0.mlp.gate_proj", P + "layers.0.mlp.up_proj"
    tensors[gate + ".weight"] = ("F8_E4M3", codes)
    tensors[gate + ".weight_scale"] = ("F32", np.float32(0.25).reshape(()))
    tensors[up + ".weight"] = ("F8_E4M3", codes)
    channel = np.linspace(0.1, 1, 512, dtype=np.float32).reshape(512, 1)
    tensors[up + ".weight_scale"] = ("F32", channel)
    out = to_artifact(save_hf(src, tmp_path / "f", tensors), tmp_path / "f.infernix")
    values = formats.e4m3_to_f32(codes)
    with open_artifact(out) as art:
        text = art.component("text")
        assert np.array_equal(text.raw("layers.0.mlp.gate_proj.weight"), codes)
        assert (text.raw("layers.0.mlp.gate_proj.weight", "scale") == 0.25).all()
        assert text.entry("layers.0.mlp.up_proj.weight").format == "fp8_e4m3"
        error = np.abs(text.f32("layers.0.mlp.up_proj.weight") - values * channel)
        assert (error <= np.abs(values * channel) / 16 + 1e-3).all()


@pytest.mark.parametrize("recipe", ["fp8", "nvfp4"])
def test_quantizing_recipes_stay_within_the_format_bound(recipe, tiny_moe_path, tmp_path):
    out = to_artifact(hf_dir_of(tiny_moe_path), tmp_path / "r.infernix", recipe,
                      keep_bf16=("*.self_attn.q_proj.weight",), quantize_lm_head=True)
    fmt = {"fp8": "fp8_e4m3", "nvfp4": "nvfp4"}[recipe]
    with open_artifact(out) as art, open_artifact(tiny_moe_path) as ref:
        for component in art.component_names:
            comp, base = art.component(component), ref.component(component)
            for name in comp.tensor_names():
                entry, exact = comp.entry(name), base.f32(name)
                quantize = (convert.QUANTIZABLE.search(name) or name == "lm_head.weight") \
                    and not name.endswith("q_proj.weight")
                assert entry.format == (fmt if quantize else "bf16"), name
                if not quantize:
                    assert np.array_equal(comp.raw(name), base.raw(name)), name
                    continue
                assert entry.row_groups == (2 if name.endswith("gate_up_proj") else 1)
                error = np.abs(comp.f32(name) - exact)
                if recipe == "fp8":   # within half an e4m3 ulp (plus the subnormal floor)
                    bound = np.abs(exact) / 16 + np.abs(exact).max() / 448 * 2 ** -10
                else:                 # within 0.18 of each 16-block's absmax
                    blocks = np.abs(exact).reshape(*exact.shape[:-1], -1, 16)
                    bound = np.repeat(blocks.max(axis=-1), 16, axis=-1) * 0.18
                assert (error <= bound + 1e-7).all(), name


# ---- streaming, progress, CLI ----------------------------------------------------------------

def peak_memory_of_conversion(src, out):
    tracemalloc.start()
    try:
        to_artifact(src, out, "nvfp4")
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_is_bounded_by_the_largest_tensor_not_the_model(tiny_dense_path, tmp_path):
    """Converting a 24-layer copy of the tiny model (~29 MB of weights) to nvfp4 peaks no
    higher than converting the 4-layer original: memory follows the largest tensor."""
    src = hf_dir_of(tiny_dense_path)
    tensors = read_hf(src)
    config = json.loads((src / "config.json").read_text())
    deep = {}
    for name, value in tensors.items():
        match = re.match(r"(model\.language_model\.layers\.)(\d+)(\..*)", name)
        if not match:
            deep[name] = value
            continue
        for repeat in range(6):
            deep[f"{match[1]}{int(match[2]) + 4 * repeat}{match[3]}"] = value
    config["text_config"]["num_hidden_layers"] = 24
    config["text_config"]["layer_types"] *= 6
    deep_dir = save_hf(src, tmp_path / "deep", deep, config=config)
    model_bytes = sum(a.nbytes for _, a in deep.values())
    largest_f32 = max(a.size for _, a in deep.values()) * 4
    del tensors, deep
    shallow_peak = peak_memory_of_conversion(src, tmp_path / "shallow.infernix")
    deep_peak = peak_memory_of_conversion(deep_dir, tmp_path / "deep.infernix")
    print(f"peak {shallow_peak / 1e6:.1f} MB (4 layers), {deep_peak / 1e6:.1f} MB (24 layers); "
          f"largest tensor in fp32 {largest_f32 / 1e6:.1f} MB; model {model_bytes / 1e6:.1f} MB")
    assert model_bytes > 25e6
    assert deep_peak < 1.2 * shallow_peak + 1e6
    assert deep_peak < 12 * largest_f32 < model_bytes / 2


def test_cli_progress_per_tensor_on_stderr(tiny_dense_path, tmp_path, capsys):
    out = tmp_path / "cli.infernix"
    assert convert.main([str(hf_dir_of(tiny_dense_path)), str(out), "--recipe", "fp8"]) == 0
    captured = capsys.readouterr()
    lines = [l for l in captured.err.splitlines() if l.startswith("[")]
    with open_artifact(out) as art:
        total = sum(len(art.component(c).tensor_names()) for c in art.component_names)
        assert art.component("text").entry("layers.0.mlp.up_proj.weight").format == "fp8_e4m3"
    assert len(lines) == total and captured.out == ""
    assert re.match(r"\[\s+1/\d+\] text/embed_tokens.weight \[512, 256\] bf16 -> bf16", lines[0])
    assert convert.main([str(tmp_path / "nowhere"), str(out)]) == 1
    assert "error:" in capsys.readouterr().err


def test_parse_size():
    assert convert.parse_size("32G") == 32 << 30 and convert.parse_size("500m") == 500 << 20
    assert convert.parse_size("0") is None


# ---- errors ----------------------------------------------------------------------------------

def edited_copy(tiny_path, tmp_path, edit_tensors=None, edit_config=None):
    src = hf_dir_of(tiny_path)
    tensors = read_hf(src)
    config = json.loads((src / "config.json").read_text())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(config)
    return save_hf(src, tmp_path / "edited", tensors, config=config)


def drop(name):
    return lambda t: t.pop(name)


P = "model.language_model."


@pytest.mark.parametrize("edit_tensors, edit_config, message", [
    (None, lambda c: c.update(model_type="llama"),
     r"config.json: unknown architecture \(model_type='llama'"),
    (drop(P + "layers.2.linear_attn.A_log"), None,
     "missing tensor model.language_model.layers.2.linear_attn.A_log"),
    (drop("lm_head.weight"), None, "missing tensor lm_head.weight"),
    (drop("mtp.fc.weight"), None, "missing tensor mtp.fc.weight"),
    (lambda t: t.update({P + "layers.3.self_attn.k_proj.weight":
                         ("BF16", np.zeros((64, 256), np.uint16))}), None,
     r"layers.3.self_attn.k_proj.weight: shape \[64, 256\], expected \[128, 256\]"),
    (lambda t: t.update({P + "layers.0.mlp.gate_proj.weight":
                         ("F8_E4M3", np.zeros((512, 256), np.uint8))}), None,
     "layers.0.mlp.gate_proj.weight: unsupported encoding"),
    (lambda t: t.update({P + "layers.0.mlp.gate_proj.weight": ("U8", np.zeros((512, 128), np.uint8)),
                         P + "layers.0.mlp.gate_proj.weight_scale":
                         ("F32", np.zeros((512, 16), np.float32))}), None,
     "layers.0.mlp.gate_proj.weight: unsupported encoding"),
    (lambda t: t.update({P + "layers.0.mlp.gate_proj.weight": ("F8_E4M3", np.zeros((512, 256), np.uint8)),
                         P + "layers.0.mlp.gate_proj.weight_scale_inv":
                         ("F32", np.zeros((3, 2), np.float32))}), None,
     r"gate_proj.weight_scale_inv: scale shape \[3, 2\], expected \[4, 2\]"),
    (lambda t: t.update({P + "layers.0.extra.weight": ("BF16", np.zeros(4, np.uint16))}), None,
     "1 unexpected tensor.*layers.0.extra.weight"),
    (None, lambda c: c["text_config"].pop("head_dim"), "config has no 'head_dim'"),
    (None, lambda c: c["text_config"].update(mtp_num_hidden_layers=2),
     "mtp_num_hidden_layers=2, but the checkpoint has 1"),
    (None, lambda c: c["text_config"].update(layer_types=["full_attention"] * 3),
     "layer_types must list"),
])
def test_conversion_errors_name_the_problem(tiny_dense_path, tmp_path, edit_tensors, edit_config,
                                            message):
    src = edited_copy(tiny_dense_path, tmp_path, edit_tensors, edit_config)
    with pytest.raises(ConvertError, match=message):
        to_artifact(src, tmp_path / "x.infernix")
    assert not (tmp_path / "x.infernix").exists()


def test_moe_expert_shape_error_names_the_expert(tiny_moe_path, tmp_path):
    def edit(tensors):
        tensors["mtp.layers.0.mlp.experts.5.up_proj.weight"] = ("BF16", np.zeros((64, 128), np.uint16))
    src = edited_copy(tiny_moe_path, tmp_path, edit)
    with pytest.raises(ConvertError, match=r"mtp.layers.0.mlp.experts.5.up_proj.weight: shape"):
        to_artifact(src, tmp_path / "x.infernix")


def test_ignore_and_no_mtp_options(tiny_dense_path, tmp_path):
    src = edited_copy(tiny_dense_path, tmp_path, lambda t: t.update(
        {P + "layers.0.extra.weight": ("BF16", np.zeros(4, np.uint16))}))
    out = convert.convert(src, tmp_path / "x.infernix", ignore=("*.extra.weight",),
                          with_mtp=False, log=None)
    with open_artifact(out) as art:
        assert art.component_names == ("text",)


def test_missing_files_and_corrupt_safetensors(tiny_dense_path, tmp_path):
    with pytest.raises(ConvertError, match="no config.json"):
        to_artifact(tmp_path, tmp_path / "x.infernix")
    src = hf_dir_of(tiny_dense_path)
    sharded = save_hf(src, tmp_path / "sharded", read_hf(src), shards=2)
    broken = sorted(sharded.glob("*.safetensors"))[0]
    broken.write_bytes(broken.read_bytes()[:1000])
    with pytest.raises(ConvertError, match=f"{broken.name}: not a readable safetensors file"):
        to_artifact(sharded, tmp_path / "x.infernix")
    broken.unlink()
    with pytest.raises(ConvertError, match=f"lists {broken.name}, which does not exist"):
        to_artifact(sharded, tmp_path / "x.infernix")


def test_resources_fall_back_and_override(tiny_dense_path, tmp_path):
    src = hf_dir_of(tiny_dense_path)
    copy = save_hf(src, tmp_path / "c", read_hf(src))
    (copy / "chat_template.jinja").unlink()
    (copy / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    out = to_artifact(copy, tmp_path / "a.infernix")
    with open_artifact(out) as art:
        assert art.component("text").resources["chat_template.jinja"] == b"{{ x }}"
    (tmp_path / "t.jinja").write_text("override")
    out = convert.convert(copy, tmp_path / "b.infernix", chat_template=tmp_path / "t.jinja",
                          log=None)
    with open_artifact(out) as art:
        assert art.component("text").resources["chat_template.jinja"] == b"override"
