"""The MoE layer's forms timed side by side for `python -m bench.kernels --only moe`.

One 35B-A3B MoE MLP layer (router logits, top-8 routing and the shared gate, the experts' gate/up
+ SwiGLU, down + routing weight + combine) at decode row counts, in every form compiled: the
split form (logits, route, up, down) and each decode form (logits_wide; route_up with F features
a CTA, or route then up_wide; down_wide with R rows a warp; runtime/model/gpu/kernels.py
MOE_DECODE_FORM picks one), each decode form also with programmatic dependent launch between its
kernels (`_pdl` rows: how the runner's decode graph launches them). Then each kernel alone, so the
table shows where a layer's time goes, and the quantised experts' kernels (`up_fp8` / `down_fp8`, `up_nvfp4` / `down_nvfp4`: the split
form's gate/up and down over FP8 and NVFP4 stacks of random codes) alone on the same routing,
their rates counting the stacks' bytes (codes, scales and NVFP4's per-row globals).

Each of 8 graph reps has its own hidden rows and its own routing buffers, so the experts read
change from rep to rep and L2 cannot serve them; the rate counts the distinct experts each rep's
routing touches (computed with torch from the same logits), the shared expert, the router and
the rows. No peer: a torch MoE reads the routing on the host (not capturable).
"""

from __future__ import annotations

from typing import Any

REPS = 8


def forms(h: int, e: int) -> list[tuple[str, list[str]]]:
    """(form name, the `moe` variant keys it launches in order) for hidden size h and e experts: the split form
    first, then every decode form compiled: each (route_up or route + up_wide, down_wide) pair;
    the name is the MOE_DECODE_FORM tuple joined by "_" ("route_up_f8_r1")."""
    from cute_kernels import moe

    keys: dict[str, list[str]] = {}
    for v in moe.variants():
        if (v.config["H"], v.config["E"]) == (h, e) and v.config["kind"] not in ("up_fp8", "down_fp8"):
            keys.setdefault(v.config["kind"], []).append(v.key)
    by_key = {v.key: v for v in moe.variants()}
    logits, route = keys["logits_wide"][0], keys["route"][0]
    out = [("split", [keys["logits"][0], route, keys["up"][0], keys["down"][0]])]
    for gate_up in ("route_up", "up_wide"):
        for gu in keys[gate_up]:
            for dw in keys["down_wide"]:
                name = f"{gate_up}_f{by_key[gu].config['features']}_{by_key[dw].config['form']}"
                out.append((name, [logits, gu, dw] if gate_up == "route_up" else [logits, route, gu, dw]))
    return out


def kind_of(key: str) -> str:
    """The kind of a `moe` variant key ("route_up_h2048_..." -> "route_up", "logits_e256_..." ->
    "logits")."""
    return key.split("_h")[0].split("_e")[0]


QUANTISED = {"fp8": ("up_fp8", "down_fp8"), "nvfp4": ("up_nvfp4", "down_nvfp4")}  # format -> its kinds


def launch_args(key: str, bufs: dict[str, int], weights: dict[str, int]) -> dict[str, int]:
    """The buffers of a moe/<key> launch over one rep's buffers (the kind decides them). The
    quantised kinds read `weights[f"{stack}_{fmt}"]` and its `_scale` (and NVFP4's `_gscale`)."""
    kind = kind_of(key)
    for fmt, (up, down) in QUANTISED.items():
        if kind in (up, down):
            stack = "gate_up" if kind == up else "down"
            plain = launch_args(key.replace(kind, "up" if kind == up else "down", 1), bufs, weights)
            parts = ("", "_scale", "_gscale") if fmt == "nvfp4" else ("", "_scale")
            names = {"": "w", "_scale": "scale", "_gscale": "gscale"}
            return {**plain, **{names[part]: weights[f"{stack}_{fmt}{part}"] for part in parts}}
    return {
        "logits": {"x": bufs["x"], "w": weights["router"], "out": bufs["logits"]},
        "logits_wide": {"x": bufs["x"], "w": weights["router"], "out": bufs["logits"]},
        "route": {"logits": bufs["logits"], "x": bufs["x"], "w_sg": weights["w_sg"], "ids": bufs["ids"],
                  "wts": bufs["wts"]},
        "up": {"x": bufs["x"], "w": weights["gate_up"], "ids": bufs["ids"], "act": bufs["act"]},
        "up_wide": {"x": bufs["x"], "w": weights["gate_up"], "ids": bufs["ids"], "act": bufs["act"]},
        "down": {"act": bufs["act"], "w": weights["down"], "ids": bufs["ids"], "wts": bufs["wts"], "out": bufs["out"]},
        "route_up": {"logits": bufs["logits"], "x": bufs["x"], "w_sg": weights["w_sg"], "w": weights["gate_up"],
                     "ids": bufs["ids"], "wts": bufs["wts"], "act": bufs["act"]},
        "down_wide": {"act": bufs["act"], "w": weights["down"], "ids": bufs["ids"], "wts": bufs["wts"],
                      "out": bufs["out"]},
    }[kind_of(key)]


def _bind(b: Any, key: str, bufs: dict[str, int], weights: dict[str, int], m: int) -> Any:
    return b.lib.kernel("moe", key).bind(launch_args(key, bufs, weights), {"M": m})


def bench_moe(b: Any, rows: tuple[int, ...] = (1, 2, 4, 8)) -> None:
    from cute_kernels import moe
    from runtime.model.gpu.pdl import chain

    from .kernels import _bf16

    torch = b.torch
    _, h, e, k, inter, _, _ = next(shape for shape in moe.SHAPES if shape[0] == "a3b")
    p = k + 1
    router = _bf16(torch, e, h, scale=h ** -0.5)
    w_sg = _bf16(torch, h, scale=h ** -0.5)
    gate_up = _bf16(torch, (e + 1) * 2 * inter, h, scale=h ** -0.5)
    down = _bf16(torch, (e + 1) * h, inter, scale=inter ** -0.5)
    weights = {"router": router.data_ptr(), "w_sg": w_sg.data_ptr(), "gate_up": gate_up.data_ptr(),
               "down": down.data_ptr()}
    expert_bytes = 3 * inter * h * 2
    stacks, quantised = quantised_stacks(torch, h, e, inter)
    weights.update({name: t.data_ptr() for name, t in stacks.items()})
    layer_forms = forms(h, e)
    for m in rows:
        tensors = [{"x": _bf16(torch, m, h),
                    "logits": torch.empty(m, e, device="cuda", dtype=torch.float32),
                    "ids": torch.empty(m, p, device="cuda", dtype=torch.int32),
                    "wts": torch.empty(m, p, device="cuda", dtype=torch.float32),
                    "act": torch.empty(m, p, inter, device="cuda", dtype=torch.bfloat16),
                    "out": torch.empty(m, h, device="cuda", dtype=torch.bfloat16)} for _ in range(REPS)]
        reps = [{name: t.data_ptr() for name, t in rep.items()} for rep in tensors]
        touched = [len(torch.topk(rep["x"].float() @ router.float().T, k, dim=-1).indices.unique())
                   for rep in tensors]
        experts = sum(touched) / REPS
        case = f"M={m}, {experts:.1f} experts + shared"
        nbytes = {"layer": (experts + 1) * expert_bytes + (e + 1) * h * 2 + m * h * 4,
                  "logits": e * h * 2 + m * h * 2, "up": (experts + 1) * expert_bytes * 2 / 3,
                  "down": (experts + 1) * expert_bytes / 3}
        for name, keys in layer_forms:
            bound = [_bind(b, key, rep, weights, m) for rep in reps for key in keys]
            us, _ = b.compare(b.ours(bound), None)
            b.record("moe", f"layer_a3b_{name}", case, us * len(keys), None, "", nbytes["layer"])
            if name != "split":  # the decode forms as the runner's decode graph launches them: with PDL
                us, _ = b.compare(b.ours(chain(bound)), None)
                b.record("moe", f"layer_a3b_{name}_pdl", case, us * len(keys), None, "", nbytes["layer"])
        # Each kernel alone, over routing the split form wrote for each rep (every form computes
        # the same ids, weights and act, so each kernel reads what it reads in a layer).
        split_keys = layer_forms[0][1]
        for rep in reps:
            for key in split_keys:
                _bind(b, key, rep, weights, m)(b.stream)
        b.stream.synchronize()
        kernels = dict.fromkeys(key for _, keys in layer_forms for key in keys)
        for key in kernels:
            share = {"logits": "logits", "logits_wide": "logits", "up": "up", "route_up": "up", "up_wide": "up",
                     "down": "down", "down_wide": "down"}.get(kind_of(key))
            us, _ = b.compare(b.ours([_bind(b, key, rep, weights, m) for rep in reps]), None)
            b.record("moe", key, case, us, None, "", nbytes[share] if share else 0.0)
        for key, nbytes_q in quantised.items():
            us, _ = b.compare(b.ours([_bind(b, key, rep, weights, m) for rep in reps]), None)
            b.record("moe", key, case, us, None, "", (experts + 1) * nbytes_q)
        del tensors


def quantised_stacks(torch: Any, h: int, e: int, inter: int) -> tuple[dict[str, Any], dict[str, float]]:
    """Random FP8 and NVFP4 expert stacks of the shape (tensors named as `launch_args` reads them:
    `gate_up_fp8`, `gate_up_fp8_scale`, ..., `down_nvfp4_gscale`) and, per quantised kernel key of
    the shape, the bytes one expert's part of its stack holds. Codes are random bytes (FP8 ones
    without the NaN codes), block scales e4m3 codes near 1, globals and FP8 scales small."""
    from cute_kernels import moe

    keys = {v.config["kind"]: v for v in moe.variants()
            if v.config["kind"] in sum(QUANTISED.values(), ())
            and (v.config["H"], v.config["E"], v.config["I"]) == (h, e, inter)}
    stacks: dict[str, Any] = {}
    per_expert: dict[str, float] = {}
    for fmt, (up, down) in QUANTISED.items():
        for kind, stack in ((up, "gate_up"), (down, "down")):
            v = keys[kind]
            total = 0
            for part, name in (("", "w"), ("_scale", "scale"), ("_gscale", "gscale")):
                if name not in v.tensors:
                    continue
                spec = v.tensors[name]
                shape = tuple(int(d) for d in spec.shape)
                if spec.dtype == "f32":
                    t = torch.full(shape, 2.0 ** -8, device="cuda", dtype=torch.float32)
                elif spec.dtype == "e4m3" and name == "w":
                    t = torch.randint(0, 0x7F, shape, device="cuda", dtype=torch.uint8)
                elif spec.dtype == "e4m3":
                    t = torch.randint(0x30, 0x40, shape, device="cuda", dtype=torch.uint8)
                else:
                    t = torch.randint(0, 256, shape, device="cuda", dtype=torch.uint8)
                stacks[f"{stack}_{fmt}{part}"] = t
                total += t.numel() * t.element_size()
            per_expert[v.key] = total / (e + 1)
    return stacks, per_expert
