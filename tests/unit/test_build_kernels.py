"""build_kernels.py without a GPU: variant planning, fingerprints, PTX and host-IR parsing,
`--list`, `--check`, and (where the CuTe DSL is installed) one real compile of a tiny kernel."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
from pathlib import Path

import pytest

import build_kernels as bk
from runtime.cuda.manifest import KernelEntry, Manifest, variant_fingerprint

PTX = """
.visible .entry infx_gemm_test_kernel(
	.param .align 64 .b8 infx_gemm_test_kernel_param_0[128],
	.param .align 4 .b8 infx_gemm_test_kernel_param_1[4],
	.param .u64 .ptr .global .align 16 infx_gemm_test_kernel_param_2,
	.param .u32 infx_gemm_test_kernel_param_3,
	.param .f32 infx_gemm_test_kernel_param_4
)
.reqntid 384, 1, 1
{
	ret;
}
"""

HOST_IR = """
    %6 = llvm.mlir.constant(1 : i32) : i32
    %7 = llvm.mlir.constant(384 : i32) : i32
    %8 = llvm.mlir.constant(197632 : i64) : i64
    %9 = llvm.alloca %6 x !llvm.struct<(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32)> : (i32) -> !llvm.ptr
    %12 = llvm.getelementptr %9[0, 1, 0] : (!llvm.ptr) -> !llvm.ptr, !llvm.struct<...>
    llvm.store %7, %12 : i32, !llvm.ptr
    %13 = llvm.getelementptr %9[0, 1, 1] : (!llvm.ptr) -> !llvm.ptr, !llvm.struct<...>
    llvm.store %6, %13 : i32, !llvm.ptr
    %14 = llvm.getelementptr %9[0, 1, 2] : (!llvm.ptr) -> !llvm.ptr, !llvm.struct<...>
    llvm.store %6, %14 : i32, !llvm.ptr
    %15 = llvm.getelementptr %9[0, 2] : (!llvm.ptr) -> !llvm.ptr, !llvm.struct<...>
    llvm.store %8, %15 : i64, !llvm.ptr
    %16 = llvm.getelementptr %9[0, 0, 0] : (!llvm.ptr) -> !llvm.ptr, !llvm.struct<...>
    llvm.store %arg3, %16 : i32, !llvm.ptr
    %17 = llvm.getelementptr %9[0, 0, 1] : (!llvm.ptr) -> !llvm.ptr, !llvm.struct<...>
    llvm.store %6, %17 : i32, !llvm.ptr
    %18 = llvm.getelementptr %9[0, 0, 2] : (!llvm.ptr) -> !llvm.ptr, !llvm.struct<...>
    llvm.store %6, %18 : i32, !llvm.ptr
"""

TOOLS = {"nvidia-cutlass-dsl": "4.8.1"}


def test_parse_ptx_entry_params_and_block():
    (entry,) = bk.parse_ptx_entries(PTX)
    assert entry["name"] == "infx_gemm_test_kernel"
    assert entry["reqntid"] == (384, 1, 1)
    got = [(p["type"], p["size"], p["align"], p["array"]) for p in entry["params"]]
    assert got == [("b8", 128, 64, True), ("b8", 4, 4, True), ("u64", 8, 8, False), ("u32", 4, 4, False),
                   ("f32", 4, 4, False)]


def test_parse_host_launch_reads_constant_fields_and_marks_dynamic_ones():
    launch = bk.parse_host_launch(HOST_IR)
    assert launch == {"grid": (None, 1, 1), "block": (384, 1, 1), "dynamic_smem": 197632}
    with pytest.raises(bk.BuildError, match="expected one kernel launch"):
        bk.parse_host_launch(HOST_IR + HOST_IR.replace("%9", "%99"))


def test_check_params_names_the_kernel_on_mismatch():
    from cute_kernels import gemm_sm90

    v = next(v for v in gemm_sm90.variants() if v.key.startswith("test_"))
    (entry,) = bk.parse_ptx_entries(PTX)
    with pytest.raises(bk.BuildError, match=f"{v.name}: the PTX entry takes 4 parameters"):
        bk.check_params(v, entry["params"][:4])
    good = entry["params"][:2] + [{"type": "b8", "size": 128, "align": 64, "array": True}] + entry["params"][2:4]
    bk.check_params(v, good)  # tma, i32-in-struct, tma, ptr, i32
    bad = list(good)
    bad[3] = {"type": "u32", "size": 4, "align": 4, "array": False}
    with pytest.raises(bk.BuildError, match="parameter 3 \\(ptr out\\)"):
        bk.check_params(v, bad)


def test_plan_covers_every_family_with_unique_fingerprints():
    jobs = bk.plan(["sm_90a"], [], TOOLS)
    names = [j.name for j in jobs]
    assert len(names) == len(set(names))
    families = {j.family for j in jobs}
    assert families == {"rmsnorm", "embedding", "rope", "silu_mul", "gemv", "gemv_fp8", "gemv_nvfp4", "gemm_sm90",
                        "quantize_act", "gemm_fp8_sm90", "dequant_nvfp4", "conv1d", "gdn", "gdn_chunked", "attention", "attention_decode_mma", "attention_prefill", "attention_wgmma", "sampling", "moe",
                        "moe_grouped", "dequant_weights",
                        "vision_bias", "vision_norm", "vision_rope", "vision_attention", "vision_pos"}
    assert len({j.fingerprint for j in jobs}) == len(jobs)
    # Blackwell targets only get the families that declare them (no Hopper-only GEMMs).
    bw = bk.plan(["sm_100a"], [], TOOLS)
    assert bw and not {j.family for j in bw} & {"gemv", "gemv_fp8", "gemv_nvfp4", "gemm_sm90", "gemm_fp8_sm90",
                                                "dequant_nvfp4"}
    # The SIMT FP8 activation quantiser builds for Blackwell too (gemm_bs_sm120's FP8 GEMMs take its scales).
    assert {"quantize_act", "gemm_bs_sm100"} <= {j.family for j in bw}
    assert [j.name for j in bk.plan(["sm_90a"], ["rope"], TOOLS)] == [j.name for j in jobs if j.family == "rope"]


def test_fingerprint_moves_with_sources_config_arch_and_toolchain():
    base = dict(sources={"a.py": "1"}, config={"H": 5120}, arch="sm_90a", toolchain=TOOLS, abi_version=1)
    fp = variant_fingerprint(**base)
    assert fp == variant_fingerprint(**base)
    for change in ({"sources": {"a.py": "2"}}, {"config": {"H": 2048}}, {"arch": "sm_100a"},
                   {"toolchain": {"nvidia-cutlass-dsl": "4.9.0"}}, {"abi_version": 2}):
        assert variant_fingerprint(**{**base, **change}) != fp, change



def _fingerprints(root: Path) -> dict[str, str]:
    return {j.name: j.fingerprint for j in bk.plan(["sm_90a"], [], TOOLS, root=root)}


def _copy_of_the_sources(tmp_path: Path) -> Path:
    """Every file the plan hashes, copied under tmp_path (the real files are never edited). Every
    arch's: the plan reads each family module's imports even where none of its variants is for
    the arch planned (the gemm_bs_sm100 / gemm_bs_sm120 families are Blackwell only)."""
    for rel in {rel for j in bk.plan(list(bk.KNOWN_ARCHES), [], TOOLS) for rel in j.sources}:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes((bk.REPO / rel).read_bytes())
    return tmp_path


@pytest.mark.parametrize("touched, affected", [
    # gdn_chunked takes its launch interface from gdn, rmsnorm's gated_x variants their layout.
    ("gdn.py", {"gdn", "gdn_chunked", "rmsnorm"}),
    ("attention.py", {"attention", "attention_decode_mma", "attention_prefill", "attention_wgmma"}),
    # A reference helper most families import.
    ("bf16.py", {"rmsnorm", "rope", "silu_mul", "gemv", "gemv_fp8", "gemv_nvfp4", "gemm_sm90", "gemm_fp8_sm90", "dequant_nvfp4",
                 "quantize_act", "conv1d", "gdn", "gdn_chunked", "attention", "attention_decode_mma", "attention_prefill", "attention_wgmma", "moe", "moe_grouped",
                 "dequant_weights", "vision_bias", "vision_norm", "vision_rope", "vision_attention", "vision_pos"}),
    # gemv_nvfp4, dequant_nvfp4, quantize_act, gemm_fp8_sm90 and dequant_weights reuse gemv_fp8's e4m3 table.
    ("gemv_fp8.py", {"gemv_fp8", "gemv_nvfp4", "dequant_nvfp4", "quantize_act", "gemm_fp8_sm90", "dequant_weights"}),
    # moe's fp8 expert kernels live in their own file.
    ("moe_fp8_kernels.py", {"moe"}),
    # The kernels of a family split over two files (moe's DSL code in moe_kernels.py).
    ("moe_kernels.py", {"moe"}),
    # moe_grouped's GEMM and the FP8 GEMM are built from gemm_sm90's constants (the FP8 GEMM also
    # its raster); moe_grouped's SIMT kernels live in their own file.
    ("gemm_sm90.py", {"gemm_sm90", "moe_grouped", "gemm_fp8_sm90"}),
    ("moe_grouped_kernels.py", {"moe_grouped"}),
])
def test_fingerprint_covers_the_package_modules_a_family_imports(tmp_path, touched, affected):
    root = _copy_of_the_sources(tmp_path)
    before = _fingerprints(root)
    assert before == _fingerprints(bk.REPO)          # the copy hashes like the repository
    path = root / "cute_kernels" / touched
    path.write_text(path.read_text() + "\n# touched\n")
    after = _fingerprints(root)
    changed = {name for name in before if after[name] != before[name]}
    # Every variant of an affected family moves, and nothing else does.
    assert changed == {name for name in before if name.split("/")[0] in affected}


def test_module_sources_follows_every_import_form(tmp_path):
    package = tmp_path / "cute_kernels"
    package.mkdir()
    files = {
        "__init__.py": "FAMILIES = ()\n",
        "fam.py": ("import numpy as np\nfrom typing import Any\nfrom . import helper\n"
                   "import cute_kernels.other\n\ndef build():\n    from .nested.deep import f\n"
                   "    from cute_kernels import FAMILIES\n"),
        "helper.py": "from .shared import CONSTANT\n",     # reached through helper only
        "shared.py": "CONSTANT = 1\n",
        "other.py": "",
        "nested/__init__.py": "",
        "nested/deep.py": "def f():\n    pass\n",
        "unused.py": "",
        "bad.py": "from .. import runtime\n",
    }
    for rel, text in files.items():
        (package / rel).parent.mkdir(parents=True, exist_ok=True)
        (package / rel).write_text(text)
    assert bk.module_sources(tmp_path, "cute_kernels/fam.py") == [
        "cute_kernels/__init__.py", "cute_kernels/fam.py", "cute_kernels/helper.py",
        "cute_kernels/nested/deep.py", "cute_kernels/other.py", "cute_kernels/shared.py"]
    with pytest.raises(bk.SourceError, match="cute_kernels/bad.py: relative import beyond"):
        bk.module_sources(tmp_path, "cute_kernels/bad.py")


def _fake_build(out: Path, jobs) -> None:
    """A manifest that matches the planned jobs, with fake cubins (what --check verifies)."""
    arch_dir = out / "sm_90a"
    kernels = {}
    for j in jobs:
        module = importlib.import_module(j.module)
        v = next(v for v in module.variants() if v.key == j.key)
        cubin = b"\x7fELF" + j.name.encode()
        path = arch_dir / j.family / f"{j.key}.cubin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(cubin)
        kernels[(j.family, j.key)] = KernelEntry(
            family=j.family, key=j.key, entry="e", cubin=f"{j.family}/{j.key}.cubin",
            cubin_sha256=hashlib.sha256(cubin).hexdigest(), fingerprint=j.fingerprint, sources=dict(j.sources),
            params=tuple(v.params), block=v.block, grid=v.grid, cluster=v.cluster, dynamic_smem=0,
            tensors=dict(v.tensors), sizes=tuple(v.sizes), requires=tuple(v.requires), config=dict(v.config))
    Manifest(arch="sm_90a", toolchain=TOOLS, kernels=kernels).write(arch_dir / "manifest.json")


def test_check_accepts_a_matching_build_and_reports_stale_or_missing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bk, "toolchain", lambda: dict(TOOLS))
    jobs = bk.plan(["sm_90a"], ["rmsnorm", "silu_mul"], TOOLS)
    _fake_build(tmp_path, jobs)
    assert bk.check(["sm_90a"], tmp_path, ["rmsnorm", "silu_mul"]) == 0
    # A changed fingerprint (as after editing a source) and a tampered cubin are both reported.
    man_path = tmp_path / "sm_90a" / "manifest.json"
    doc = json.loads(man_path.read_text())
    doc["kernels"][0]["fingerprint"] = "0" * 64
    man_path.write_text(json.dumps(doc))
    (tmp_path / "sm_90a" / "silu_mul" / "i512.cubin").write_bytes(b"\x7fELFtampered")
    assert bk.check(["sm_90a"], tmp_path, ["rmsnorm", "silu_mul"]) == 1
    err = capsys.readouterr().err
    assert f"{doc['kernels'][0]['family']}/{doc['kernels'][0]['key']} (sm_90a): stale" in err
    assert "silu_mul/i512 (sm_90a): cubin" in err and "does not match" in err
    # Without the manifest: a clear message, non-zero.
    assert bk.check(["sm_90a"], tmp_path / "empty", []) == 1


def test_list_needs_no_dsl(capsys):
    assert bk.main(["--list", "--only", "gemv*"]) == 0
    out = capsys.readouterr().out
    assert "gemv/o_proj_n5120_k6144_m8" in out and "block  256" in out


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed")
def test_real_compile_of_one_small_kernel_is_incremental(tmp_path, capsys):
    """One tiny kernel through the whole pipeline (about 2 s, most of it importing the DSL)."""
    assert bk.main(["--out", str(tmp_path), "--only", "silu_mul/i512"]) == 0
    man = Manifest.load(tmp_path / "sm_90a" / "manifest.json")
    e = man.kernels[("silu_mul", "i512")]
    assert e.entry.startswith("infx_silu_mul_i512")
    assert (tmp_path / "sm_90a" / e.cubin).read_bytes()[:4] == b"\x7fELF"
    assert [p.kind for p in e.params] == ["ptr", "ptr", "i32"] and e.block == (256, 1, 1)
    capsys.readouterr()
    assert bk.main(["--out", str(tmp_path), "--only", "silu_mul/i512"]) == 0
    assert "1 up to date, 0 to compile" in capsys.readouterr().err
    assert bk.check(["sm_90a"], tmp_path, ["silu_mul/i512"]) == 0
