"""Golden data for the NumPy reference, from the real oracle: Hugging Face transformers.

For each family (Qwen3.5 dense, Qwen3.5 MoE, Qwen3-Next) this builds a tiny random model with
transformers in float32 and eager attention (recipe: research note qwen-arch.md section 8),
saves it as a Hugging Face checkpoint directory in the layout of the real releases, and records
what the model computes, so CI can check `NumpyRunner` without torch:

    tests/data/golden/<family>/config.json        HF config (composite for Qwen3.5, flat for Next)
    tests/data/golden/<family>/model.safetensors  bf16 weights, incl. the MTP head (`mtp.*`)
    tests/data/golden/<family>/golden.npz         the oracle's outputs (below)
    tests/data/golden/manifest.json               versions, device, command, settings

golden.npz holds, for a prompt `ids` of PROMPT_LEN tokens:
    ids                   [T] int64
    logits                [T, V]  full-prompt forward
    prefix_conv_<i>       [Kc-1, conv_dim] conv window of linear layer i after ids[:-1]
                          (the last Kc-1 pre-conv inputs, oldest first)
    prefix_recurrent_<i>  [Hv, dk, dv] recurrent state of linear layer i after ids[:-1]
    prefix_key_<i>, prefix_value_<i>  [T-1, Hkv, D] K/V cache of attention layer i (post-norm,
                          post-RoPE) after ids[:-1]
    decode_logits         [V]  one cached decode step of ids[-1] after ids[:-1]
    hidden                [T, H] final-normed hidden states of the full prompt
    mtp_logits            [T-1, V] MTP head over pairs (hidden[t], ids[t+1]) at positions t,
                          assembled from transformers' own RMSNorm / Linear / decoder layer
                          (transformers does not implement MTP; semantics as vLLM, section 2.6)

Weights: every tensor is drawn (linears as transformers initialises them, norms, dt_bias and A_log
perturbed so a `w` vs `1 + w` mix-up cannot hide; Hv/Hk = 2 and Hq/Hkv = 2), then rounded to
bfloat16 and kept in float32, so the bf16 checkpoint holds exactly the weights the oracle ran.
Layouts written (as the real checkpoints): Qwen3.5 dense/MoE under `model.language_model.` with
a composite config (`text_config`), MoE main-layer experts fused (`experts.gate_up_proj`
[E, 2I, H], gate rows first; `experts.down_proj` [E, H, I]) and MTP experts per expert;
Qwen3-Next flat under `model.` with fused `in_proj_qkvz` / `in_proj_ba` and per-expert experts.

How the committed data was made (GPU machine: one NVIDIA H200, Python 3.12, torch 2.11.0+cu130,
transformers 5.17.0, safetensors 0.8.0, TF32 off; about 35 s):

    python3 tools/make_golden.py --out /tmp/golden    # then copied to tests/data/golden/

The prompt has 70 tokens (not ~40) so that it crosses a 64-token KV page and a 64-token GDN chunk.
The same script on CPU (`--device cpu`, torch 2.13.0 CPU, same transformers) gives weights
identical bit for bit and outputs within 5e-7 relative of the GPU ones. Needs torch, transformers
and safetensors; none of them is a project dependency (a tool, never imported by the runtime).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import save_file

PROMPT_LEN = 70            # crosses a 64-token KV page and a 64-token GDN chunk
SEED = 1234
LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention",
               "linear_attention", "full_attention"]


def text_config_kwargs(family: str) -> dict:
    cfg = dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=len(LAYER_TYPES),
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
        max_position_embeddings=4096, tie_word_embeddings=(family == "dense"),
        layer_types=list(LAYER_TYPES),
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    )
    if family != "dense":
        cfg.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=48)
    if family == "next":
        del cfg["rope_parameters"]["mrope_section"], cfg["rope_parameters"]["mrope_interleaved"]
        cfg.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    return cfg


def classes(family: str):
    if family == "dense":
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import (Qwen3_5DecoderLayer,
                                                                  Qwen3_5RMSNorm)
        return Qwen3_5TextConfig, Qwen3_5ForCausalLM, Qwen3_5DecoderLayer, Qwen3_5RMSNorm
    if family == "moe":
        from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
            Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm)
        return Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeDecoderLayer, \
            Qwen3_5MoeRMSNorm
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    from transformers.models.qwen3_next.modeling_qwen3_next import (Qwen3NextDecoderLayer,
                                                                    Qwen3NextRMSNorm)
    return Qwen3NextConfig, Qwen3NextForCausalLM, Qwen3NextDecoderLayer, Qwen3NextRMSNorm


class MtpHead(torch.nn.Module):
    """The MTP head assembled from transformers' parts (section 2.6 / vLLM's qwen3_5_mtp)."""

    def __init__(self, config, layer_cls, norm_cls, layer_index: int):
        super().__init__()
        hidden = config.hidden_size
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = norm_cls(hidden, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = norm_cls(hidden, eps=config.rms_norm_eps)
        self.norm = norm_cls(hidden, eps=config.rms_norm_eps)
        # A decoder layer built at the index of a full-attention layer is a full-attention block
        # with the model's FFN kind.
        self.layers = torch.nn.ModuleList([layer_cls(config, layer_index)])


def perturb_and_round(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Re-draw the weights transformers initialises to constants, then round all to bf16."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator).to(param.device)
            if name.endswith("linear_attn.norm.weight"):          # gated norm: plain weight
                param.copy_(1.0 + 0.3 * noise)
            elif name.endswith("norm.weight"):                     # zero-centred norms
                param.copy_(0.3 * noise)
            elif name.endswith("dt_bias"):
                param.copy_(1.0 + 0.3 * noise)
            elif name.endswith("A_log"):
                param.add_(0.2 * noise)
            param.copy_(param.to(torch.bfloat16).float())


def causal_mask(length: int, device) -> torch.Tensor:
    mask = torch.full((length, length), float("-inf"), device=device).triu(1)
    return mask[None, None]


def rotary(model, family: str, hidden: torch.Tensor, positions: torch.Tensor):
    position_ids = positions[None]
    if family != "next":                  # Qwen3.5 rotary takes (t, h, w) positions
        position_ids = position_ids[None].expand(3, 1, -1)
    return model.model.rotary_emb(hidden, position_ids)


def run_family(family: str, out_dir: Path, device: str) -> dict:
    config_cls, model_cls, layer_cls, norm_cls = classes(family)
    torch.manual_seed(SEED)
    generator = torch.Generator().manual_seed(SEED + 1)
    config = config_cls(**text_config_kwargs(family))
    config._attn_implementation = "eager"
    model = model_cls(config).to(device).float().eval()
    full_layer = LAYER_TYPES.index("full_attention")
    mtp = MtpHead(config, layer_cls, norm_cls, full_layer)
    mtp.apply(model._init_weights)      # not a PreTrainedModel: initialise it the model's way
    mtp = mtp.to(device).float().eval()
    perturb_and_round(model, generator)
    perturb_and_round(mtp, generator)
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    ids = torch.randint(0, config.vocab_size, (1, PROMPT_LEN), generator=generator).to(device)
    golden: dict[str, np.ndarray] = {"ids": ids[0].cpu().numpy().astype(np.int64)}
    with torch.no_grad():
        golden["logits"] = model(ids).logits[0].float().cpu().numpy()

        prefix = model(ids[:, :-1], use_cache=True)
        cache = prefix.past_key_values
        kernel = config.linear_conv_kernel_dim
        for i, kind in enumerate(LAYER_TYPES):
            layer = cache.layers[i]
            if kind == "linear_attention":
                conv = layer.conv_states[0]          # state index 0 (a dict in 5.17)
                rec = layer.recurrent_states[0]
                golden[f"prefix_conv_{i}"] = conv[0, :, -(kernel - 1):].T.float().cpu().numpy()
                golden[f"prefix_recurrent_{i}"] = rec[0].float().cpu().numpy()
            else:
                golden[f"prefix_key_{i}"] = layer.keys[0].transpose(0, 1).float().cpu().numpy()
                golden[f"prefix_value_{i}"] = \
                    layer.values[0].transpose(0, 1).float().cpu().numpy()
        golden = {k: v.copy() for k, v in golden.items()}   # the cache advances in place
        step = model(ids[:, -1:], past_key_values=cache, use_cache=True)
        golden["decode_logits"] = step.logits[0, -1].float().cpu().numpy()

        hidden = model.model(ids).last_hidden_state[0]        # after the final norm
        golden["hidden"] = hidden.float().cpu().numpy()
        embedded = mtp.pre_fc_norm_embedding(model.model.embed_tokens(ids[0, 1:]))
        normed = mtp.pre_fc_norm_hidden(hidden[:-1])
        x = mtp.fc(torch.cat([embedded, normed], dim=-1))[None]
        positions = torch.arange(PROMPT_LEN - 1, device=device)
        x = mtp.layers[0](x, position_embeddings=rotary(model, family, x, positions),
                          attention_mask=causal_mask(PROMPT_LEN - 1, device),
                          position_ids=positions[None], past_key_values=None)
        if isinstance(x, tuple):
            x = x[0]
        golden["mtp_logits"] = model.lm_head(mtp.norm(x))[0].float().cpu().numpy()

    family_dir = out_dir / family
    family_dir.mkdir(parents=True, exist_ok=True)
    save_checkpoint(family, config, model, mtp, family_dir)
    np.savez_compressed(family_dir / "golden.npz", **golden)
    return {"prompt_len": PROMPT_LEN, "layer_types": LAYER_TYPES,
            "max_abs_logit": float(np.abs(golden["logits"]).max())}


def checkpoint_tensors(family: str, config, model, mtp) -> dict[str, torch.Tensor]:
    """HF state dicts renamed into the real releases' tensor layout (see module docstring)."""
    prefix = "model." if family == "next" else "model.language_model."
    tensors: dict[str, torch.Tensor] = {}

    def add(name: str, tensor: torch.Tensor, per_expert: bool) -> None:
        if name.endswith("mlp.experts.gate_up_proj") and per_expert:
            inter = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                tensors[f"{name[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = tensor[e, :inter]
                tensors[f"{name[:-len('gate_up_proj')]}{e}.up_proj.weight"] = tensor[e, inter:]
        elif name.endswith("mlp.experts.down_proj") and per_expert:
            for e in range(tensor.shape[0]):
                tensors[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = tensor[e]
        else:
            tensors[name] = tensor

    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            if not config.tie_word_embeddings:
                add(name, tensor, False)
        else:
            add(prefix + name[len("model."):], tensor, family == "next")
    for name, tensor in mtp.state_dict().items():
        add("mtp." + name, tensor, True)
    return {k: v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in tensors.items()}


def save_checkpoint(family: str, config, model, mtp, family_dir: Path) -> None:
    text = config.to_dict()
    text["mtp_num_hidden_layers"] = 1
    if family == "next":
        text["architectures"] = ["Qwen3NextForCausalLM"]
        document = text
    else:
        composite = {"dense": ("qwen3_5", "Qwen3_5ForConditionalGeneration"),
                     "moe": ("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration")}[family]
        document = {"architectures": [composite[1]], "model_type": composite[0],
                    "tie_word_embeddings": config.tie_word_embeddings, "text_config": text}
    (family_dir / "config.json").write_text(json.dumps(document, indent=2, sort_keys=True))
    tensors = checkpoint_tensors(family, config, model, mtp)
    save_file(tensors, str(family_dir / "model.safetensors"), metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--families", default="dense,moe,next")
    args = parser.parse_args(argv)
    torch.set_float32_matmul_precision("highest")      # true float32 matmuls, no TF32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    args.out.mkdir(parents=True, exist_ok=True)
    manifest = {
        "generator": "tools/make_golden.py",
        "command": " ".join(["python", "tools/make_golden.py", *(argv or sys.argv[1:])]),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "device": args.device,
        "device_name": (torch.cuda.get_device_name() if args.device.startswith("cuda")
                        else platform.processor() or "cpu"),
        "dtype": "float32", "attn_implementation": "eager", "seed": SEED, "families": {},
    }
    for family in args.families.split(","):
        manifest["families"][family] = run_family(family, args.out, args.device)
        print(f"{family}: done", flush=True)
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
