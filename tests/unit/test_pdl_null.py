"""Programmatic dependent launch (PDL) without a GPU: which kernels are built for it, the launch
attribute (runtime/cuda/device.py, the null device), `BoundLaunch.programmatic`, the plan rule of
`runtime/model/gpu/pdl.py`, and the runner's decode / verification plans with it on and off."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from runtime.cuda.errors import LaunchError
from runtime.cuda.kernels import KernelLibrary
from runtime.cuda.null import NullDevice
from runtime.model.runner import DecodeItem, PrefillChunk, StepRow

from null_cuda import REPO, built_or_skip

CUBIN = b"\x7fELF fake cubin"

# The kernels built with `pdl` (cute_kernels/_pdl.py): the decode step's chain. gemv_fp8 and
# gemv_nvfp4 (another owner's files), the GEMMs and the prefill kernels are not.
PDL_FAMILIES = {"gemv", "rmsnorm", "silu_mul", "conv1d", "gdn", "attention", "attention_decode_mma", "moe"}


def _entry(key: str, pdl: bool) -> dict:
    return {"family": "fam", "key": key, "entry": f"infx_fam_{key}_kernel", "cubin": f"fam/{key}.cubin",
            "cubin_sha256": hashlib.sha256(CUBIN).hexdigest(), "fingerprint": "f" * 64, "sources": {},
            "params": [{"kind": "ptr", "name": "x", "size": 8, "align": 8, "buffer": "x"}],
            "block": [128, 1, 1], "grid": [3, 1, 1], "cluster": [1, 1, 1], "dynamic_smem": 0,
            "tensors": {"x": {"dtype": "bf16", "shape": [8]}}, "sizes": [], "config": {"pdl": True} if pdl else {}}


@pytest.fixture
def fake(tmp_path: Path):
    """A null device, its stream and a library of two kernels: `waits` (built with pdl) and `plain`."""
    arch = tmp_path / "kernels" / "sm_90a"
    (arch / "fam").mkdir(parents=True)
    entries = [_entry("waits", True), _entry("plain", False)]
    for e in entries:
        (arch / e["cubin"]).write_bytes(CUBIN)
    (arch / "manifest.json").write_text(json.dumps({"schema": 1, "arch": "sm_90a", "toolchain": {},
                                                    "kernels": entries}))
    dev = NullDevice()
    lib = KernelLibrary.open(dev, build_dir=tmp_path / "kernels", source_root=False)
    return dev, dev.create_stream(), lib, dev.mem_alloc(64)


def test_the_attribute_goes_only_to_kernels_built_with_pdl(fake):
    dev, stream, lib, x = fake
    waits, plain = lib.kernel("fam", "waits"), lib.kernel("fam", "plain")
    assert waits.entry.pdl and not plain.entry.pdl
    bound = waits.bind({"x": x})
    assert not bound.pdl  # binding alone never asks for PDL
    twin = bound.programmatic()
    assert twin.pdl and twin.param_bytes() == bound.param_bytes() and twin.grid == bound.grid
    bound(stream)
    twin(stream)
    assert [r.pdl for r in dev.launches] == [False, True]
    assert dev.launches[0].params == dev.launches[1].params
    with pytest.raises(LaunchError, match="not built with pdl"):
        plain.bind({"x": x}).programmatic()


def test_a_graph_keeps_each_launch_s_attribute(fake):
    from runtime.cuda.device import capture_graph

    dev, stream, lib, x = fake
    launches = [lib.kernel("fam", "waits").bind({"x": x}).programmatic(), lib.kernel("fam", "plain").bind({"x": x})]
    graph = capture_graph(dev, stream, lambda: [b(stream) for b in launches])
    graph.replay(stream)
    assert [(r.function, r.pdl, r.graph_replay) for r in dev.launches] == [
        ("infx_fam_waits_kernel", True, True), ("infx_fam_plain_kernel", False, True)]


def test_chain_skips_the_first_launch_plain_kernels_and_what_follows_a_collective(fake):
    from runtime.model.gpu.pdl import chain

    _, _, lib, x = fake
    waits, plain = lib.kernel("fam", "waits"), lib.kernel("fam", "plain")
    collective = object()  # an AllReduce in a tensor-parallel plan: not one of our kernels
    plan = [waits.bind({"x": x}), waits.bind({"x": x}), plain.bind({"x": x}), waits.bind({"x": x}), collective,
            waits.bind({"x": x})]
    out = chain(plan)
    assert out[4] is collective
    assert [getattr(b, "pdl", None) for b in out] == [False, True, False, True, None, False]


def test_cuda_launch_config_sets_programmatic_stream_serialization():
    drv = pytest.importorskip("cuda.bindings.driver")
    from runtime.cuda.device import CudaDevice

    dev = object.__new__(CudaDevice)  # launch_config builds structs only: no driver needed
    dev._drv = drv
    ids = drv.CUlaunchAttributeID
    cfg = dev.launch_config((5, 1, 1), (256, 1, 1), 1024, (2, 1, 1), pdl=True)
    assert cfg.numAttrs == 2
    assert [a.id for a in cfg.attrs] == [ids.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
                                         ids.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION]
    assert cfg.attrs[1].value.programmaticStreamSerializationAllowed == 1
    assert dev.launch_config((5, 1, 1), (256, 1, 1), 0, (1, 1, 1)).numAttrs == 0


# ------------------------------------------------------------------ the variant tables and the build


def _declared() -> dict[tuple[str, str], dict]:
    """(family, key) -> compile-time config of every declared variant."""
    import importlib

    from build_kernels import family_modules

    return {(v.family, v.key): dict(v.config) for name in family_modules()
            for v in importlib.import_module(name).variants()}


def test_the_variant_tables_declare_pdl_for_the_decode_chain_only():
    from cute_kernels.moe import DECODE_KINDS

    declared = _declared()
    assert {f for (f, _), cfg in declared.items() if cfg.get("pdl")} == PDL_FAMILIES
    for (family, key), cfg in declared.items():
        pdl = cfg.get("pdl", False)
        assert pdl in (True, False), f"{family}/{key}"
        if family in ("gemv", "rmsnorm", "silu_mul", "conv1d", "attention", "attention_decode_mma"):
            assert pdl, f"{family}/{key}"
        elif family == "gdn":
            assert pdl == (cfg["mode"] in ("fused", "verify")), key  # not the prefill `split` mode
        elif family == "moe":
            assert pdl == (cfg["kind"] in DECODE_KINDS), key
        else:
            assert not pdl, f"{family}/{key}"


def test_list_marks_the_pdl_variants(capsys):
    import build_kernels as bk

    assert bk.main(["--list", "--only", "gemv/o_proj_n5120_k6144_m8", "--only", "gemm_sm90/o_proj*"]) == 0
    marked = {line.split()[1]: " pdl  " in line for line in capsys.readouterr().out.splitlines()}
    assert marked == {"gemv/o_proj_n5120_k6144_m8": True, "gemm_sm90/o_proj_n5120_k6144": False}


def test_check_pdl_refuses_a_declaration_the_ptx_contradicts():
    from build_kernels import BuildError, check_pdl
    from cute_kernels.silu_mul import variants

    v = variants()[0]
    assert v.config["pdl"]
    check_pdl(v, "\tgriddepcontrol.wait;\n")
    with pytest.raises(BuildError, match="config pdl is True but the PTX has no griddepcontrol.wait"):
        check_pdl(v, "\tret;\n")


def test_built_kernels_wait_exactly_when_their_manifest_says_pdl():
    """The built PTX of every sm_90a kernel against its manifest entry: the PDL families' kernels
    wait, every other kernel (the families sharing their modules included) does not."""
    from runtime.cuda.manifest import Manifest

    path = REPO / "build" / "kernels" / "sm_90a" / "manifest.json"
    man = built_or_skip(lambda: Manifest.load(path))
    waiting = set()
    for (family, key), e in man.kernels.items():
        ptx = (path.parent / e.cubin).with_suffix(".ptx")
        if not ptx.exists():
            pytest.skip(f"{ptx} not built")
        assert e.pdl == ("griddepcontrol.wait" in ptx.read_text()), e.name
        if e.pdl:
            waiting.add(family)
    assert waiting == PDL_FAMILIES


# ------------------------------------------------------------------ the runner's plans


def _runner(path: Path):
    from runtime.model.gpu.runner import CudaRunner

    return built_or_skip(lambda: CudaRunner.from_artifact(path, num_pages=16, num_slots=12,
                                                          device=NullDevice(total_memory=2 << 30),
                                                          prefill_chunk=64))


def _expected(plan: list, on: bool) -> list[bool]:
    """The PDL word `gpu.pdl.chain` gives each launch: on, not the first, a kernel built for it."""
    return [on and i > 0 and launch.kernel.entry.pdl for i, launch in enumerate(plan)]


def _steps(r) -> None:
    items = [DecodeItem(slot=0, token_id=5, pos=20, page_table=[0]), DecodeItem(slot=1, token_id=7, pos=3,
                                                                               page_table=[1])]
    r.decode(items)  # bound and captured
    n = len(r.device.launches)
    r.decode(items)
    replayed = r.device.launches[n:]
    r.step([StepRow(slot=0, token_ids=[5, 6, 7], start_pos=21, page_table=[0], snapshots=[3, 4, 5]),
            StepRow(slot=1, token_ids=[8, 9, 10], start_pos=4, page_table=[1], snapshots=[6, 7, 8])])
    r.prefill(PrefillChunk(slot=2, token_ids=list(range(1, 40)), start_pos=0, page_table=[2]))
    return replayed


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_decode_and_verification_plans_take_pdl_only_when_on(model, tiny_path, tiny_moe_path):
    r = _runner(tiny_path if model == "dense" else tiny_moe_path)
    try:
        assert r.kernels.pdl is True  # runtime/model/gpu/kernels.py: on since its H200 run
        r.kernels.pdl = False
        off = _steps(r)
        plans_off = dict(r.steps.plans.bound)
        r.steps.destroy_graphs()
        r.kernels.pdl = True
        on = _steps(r)
        plans_on = dict(r.steps.plans.bound)
    finally:
        r.close()
    decode_key, verify_key = ("decode", 2), ("verify", 2, 3)
    for key in (decode_key, verify_key):
        plan_off, plan_on = plans_off[key], plans_on[key]
        assert [b.pdl for b in plan_off] == [False] * len(plan_off)
        assert [b.pdl for b in plan_on] == _expected(plan_on, True)
        # The same launches, parameter for parameter: PDL changes the launch attribute only.
        assert [(b.kernel.name, b.grid, b.param_bytes()) for b in plan_on] == \
            [(b.kernel.name, b.grid, b.param_bytes()) for b in plan_off]
    families = {b.kernel.entry.family for b in plans_on[decode_key] if b.pdl}
    assert {"rmsnorm", "conv1d", "gdn", "attention", "attention_decode_mma"} <= families
    if model == "moe":
        assert "moe" in families
    assert not plans_on[decode_key][0].pdl and any(not b.kernel.entry.pdl for b in plans_on[decode_key])
    # What the device ran: the graph replays carry the plan's words, in order.
    assert [rec.pdl for rec in off] == [False] * len(off)
    assert [rec.pdl for rec in on] == [b.pdl for b in plans_on[decode_key]]
    assert [(rec.function, rec.params) for rec in on] == [(rec.function, rec.params) for rec in off]
    # Prefill plans never take the attribute.
    prefill = [plan for key, plan in plans_on.items() if key[0] == "prefill"]
    assert prefill and not any(b.pdl for plan in prefill for b in plan)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from tools.make_tiny import make_tiny

    path = tmp_path_factory.mktemp("tiny") / "tiny.infernix"
    make_tiny(path, family="dense", seed=0, vocab="small")
    return path


# ------------------------------------------------------------------ the benches' --pdl


def test_decode_bench_compares_pdl_off_and_on_and_refuses_other_words(capsys):
    from bench import decode, step_breakdown

    runs = [{"pdl": pdl, "results": [{"batch": 1, "context": 1024, "graph_ms": ms}]}
            for pdl, ms in ((False, 2.53), (True, 2.30))]
    lines = decode.render_kv_dtypes(runs, lambda r: f"PDL {'on' if r['pdl'] else 'off'}").splitlines()
    assert lines[0] == "| batch | context | PDL off ms | PDL on ms (x vs PDL off) |"
    assert lines[2] == "| 1 | 1024 | 2.53 | 2.30 (1.100x) |"
    for main in (decode.main, step_breakdown.main):
        with pytest.raises(SystemExit):
            main(["--pdl", "maybe", "--out", "/nonexistent/never"])
        assert "--pdl 'maybe': on, off or off,on" in capsys.readouterr().err
