"""The tiny test models in torch BF16: the same-precision baseline the GPU runner tests hold
`CudaRunner`'s error to (its error against the fp32 `NumpyRunner` within 2x of this forward's).

Written from qwen-arch.md section 2, rounding where Hugging Face rounds (section 2.7), for the
dense and the MoE MLP: the router's logits in bf16, softmax in fp32 over all experts, top k,
renormalised, cast to bf16; each expert's output weighted in bf16 and accumulated in bf16; the
shared expert times sigmoid(x . w_sg) in bf16.
"""

from __future__ import annotations

import pytest


def _swiglu(h, gate, up, down):
    import torch.nn.functional as F

    return (F.silu(h @ gate.T) * (h @ up.T)) @ down.T


def _moe(h, m, W, c):
    """The MoE MLP of the rows of h (bf16), weights under the prefix m."""
    import torch

    probs = torch.softmax((h @ W(m + "gate.weight").T).float(), dim=-1)
    weights, experts = torch.topk(probs, c.num_experts_per_tok, dim=-1)
    if c.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    weights = weights.to(h.dtype)
    gate_up, down = W(m + "experts.gate_up_proj"), W(m + "experts.down_proj")
    inter = c.moe_intermediate_size
    out = torch.zeros_like(h)
    for e in experts.unique().tolist():
        rows, picks = (experts == e).nonzero(as_tuple=True)
        y = _swiglu(h[rows], gate_up[e, :inter], gate_up[e, inter:], down[e])
        out.index_add_(0, rows, y * weights[rows, picks, None])
    shared = _swiglu(h, W(m + "shared_expert.gate_proj.weight"), W(m + "shared_expert.up_proj.weight"),
                     W(m + "shared_expert.down_proj.weight"))
    return out + torch.sigmoid(h @ W(m + "shared_expert_gate.weight").T) * shared


def torch_bf16_logits(tiny_path, ids):
    """The same model in torch BF16 (the same-precision baseline), whole prompt, no cache."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    from runtime.artifact import open_artifact
    from runtime.model.config import LINEAR_ATTENTION, MOE_MLP, ModelConfig

    art = open_artifact(tiny_path)
    comp = art.component("text")
    c = ModelConfig.from_dict(comp.config)
    dev, bf = "cuda", torch.bfloat16

    def W(name):
        return torch.tensor(comp.f32(name), device=dev).to(bf)

    def rms(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * (1.0 + w.float())).to(bf)

    t = len(ids)
    x = W("embed_tokens.weight")[torch.tensor(ids, device=dev)]
    rd = c.rotary_dim
    inv = c.rope_theta ** (-torch.arange(0, rd, 2, device=dev, dtype=torch.float32) / rd)
    ang = torch.arange(t, device=dev, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = torch.cos(ang).to(bf), torch.sin(ang).to(bf)
    for i, kind in enumerate(c.layer_types):
        p = f"layers.{i}."
        h = rms(x, W(p + "input_layernorm.weight"))
        if kind == LINEAR_ATTENTION:
            q_ = p + "linear_attn."
            hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, \
                c.linear_value_head_dim
            mixed = h @ W(q_ + "in_proj_qkv.weight").T
            z = (h @ W(q_ + "in_proj_z.weight").T).view(t, hv, dv)
            b = h @ W(q_ + "in_proj_b.weight").T
            a = h @ W(q_ + "in_proj_a.weight").T
            cw = W(q_ + "conv1d.weight").float()
            kc = cw.shape[1]
            ext = torch.cat([torch.zeros(kc - 1, mixed.shape[1], device=dev), mixed.float()])
            acc = sum(ext[j:j + t] * cw[:, j] for j in range(kc))
            conv = F.silu(acc).to(bf)
            kd = hk * dk
            q = conv[:, :kd].float().view(t, hk, dk)
            k = conv[:, kd:2 * kd].float().view(t, hk, dk)
            v = conv[:, 2 * kd:].float().view(t, hv, dv)
            q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * dk ** -0.5
            k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
            q, k = q.repeat_interleave(hv // hk, 1), k.repeat_interleave(hv // hk, 1)
            g = -torch.exp(W(q_ + "A_log").float()) * F.softplus(a.float() + W(q_ + "dt_bias").float())
            beta = torch.sigmoid(b.float())
            s = torch.zeros(hv, dk, dv, device=dev)
            outs = []
            for step in range(t):
                s = s * torch.exp(g[step])[:, None, None]
                pred = torch.einsum("hkv,hk->hv", s, k[step])
                s = s + k[step][:, :, None] * (beta[step][:, None] * (v[step] - pred))[:, None, :]
                outs.append(torch.einsum("hkv,hk->hv", s, q[step]))
            o = torch.stack(outs).to(bf).float()
            xn = (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)).to(bf)
            y = ((W(q_ + "norm.weight") * xn).float() * F.silu(z.float())).to(bf)
            out = y.reshape(t, hv * dv) @ W(q_ + "out_proj.weight").T
        else:
            q_ = p + "self_attn."
            hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
            qg = (h @ W(q_ + "q_proj.weight").T).view(t, hq, 2 * d)
            q, gate = qg[..., :d], qg[..., d:]
            k = (h @ W(q_ + "k_proj.weight").T).view(t, hkv, d)
            v = (h @ W(q_ + "v_proj.weight").T).view(t, hkv, d)
            q, k = rms(q, W(q_ + "q_norm.weight")), rms(k, W(q_ + "k_norm.weight"))

            def rope(u):
                half = rd // 2
                c_, s_ = cos[:, None, :], sin[:, None, :]
                u1, u2 = u[..., :half], u[..., half:rd]
                return torch.cat([u1 * c_ - u2 * s_, u2 * c_ + u1 * s_, u[..., rd:]], -1)

            q, k = rope(q), rope(k)
            kk, vv = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
            att = F.scaled_dot_product_attention(q.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1),
                                                 is_causal=True).transpose(0, 1)
            out = (att.reshape(t, hq * d) * torch.sigmoid(gate.reshape(t, hq * d))) @ W(q_ + "o_proj.weight").T
        x = x + out
        h = rms(x, W(p + "post_attention_layernorm.weight"))
        m = p + "mlp."
        if c.mlp_types[i] == MOE_MLP:
            x = x + _moe(h, m, W, c)
        else:
            x = x + _swiglu(h, W(m + "gate_proj.weight"), W(m + "up_proj.weight"), W(m + "down_proj.weight"))
    h = rms(x, W("norm.weight"))
    head = W("lm_head.weight") if "lm_head.weight" in comp else W("embed_tokens.weight")
    logits = (h @ head.T).float().cpu().numpy()
    art.close()
    return logits
