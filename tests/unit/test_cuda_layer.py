"""The CUDA layer on the null device: formulas, sync policy, arenas, kernel loading, launches, graphs."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from runtime.cuda.device import arch_for, capture_graph, sync_policy_from_env
from runtime.cuda.errors import DeviceOutOfMemory, KernelMissing, KernelStale, LaunchError, SyncPolicyError
from runtime.cuda.expr import FormulaError, evaluate, names_in
from runtime.cuda.kernels import KernelLibrary
from runtime.cuda.manifest import Manifest, ManifestError, TmaEncode
from runtime.cuda.memory import DeviceArenas
from runtime.cuda.null import NullDevice

GIB = 1 << 30


# ----------------------------------------------------------------------------- formulas


def test_formulas_evaluate_and_name_their_sizes():
    assert evaluate("cdiv(M, 128) * 20", {"M": 129}) == 40
    assert evaluate("roundup(M, 8)", {"M": 9}) == 16
    assert evaluate("min(M, 4) + max(K, 2)", {"M": 9, "K": 1}) == 6
    assert evaluate("M <= 16", {"M": 16}) is True
    assert evaluate(7) == 7
    assert names_in("cdiv(M * 12, 128) + K") == {"M", "K"}


@pytest.mark.parametrize("text", ["__import__('os')", "M.real", "[M]", "M if M else 1", "lambda: 1", "M ** 2", "a < b < c"])
def test_formulas_reject_anything_but_arithmetic(text):
    with pytest.raises(FormulaError):
        evaluate(text, {"M": 1, "a": 1, "b": 2, "c": 3})


def test_formula_missing_size_is_named():
    with pytest.raises(FormulaError, match="needs size 'N'"):
        evaluate("N + 1", {"M": 1})


# ----------------------------------------------------------------------------- device basics


def test_sync_policy_from_env():
    assert sync_policy_from_env({}) == "auto"
    for value in ("spin", "yield", "blocking", "auto", " Spin "):
        assert sync_policy_from_env({"INFERNIX_CUDA_SYNC": value}) == value.strip().lower()
    for bad in ("", "fast", "busy"):
        with pytest.raises(SyncPolicyError, match="INFERNIX_CUDA_SYNC"):
            sync_policy_from_env({"INFERNIX_CUDA_SYNC": bad})
    with pytest.raises(SyncPolicyError):
        NullDevice(sync="sometimes")


def test_arch_names():
    assert arch_for(9, 0) == "sm_90a"
    assert arch_for(10, 0) == "sm_100a"
    assert arch_for(12, 0) == "sm_120a"
    assert arch_for(8, 6) == "sm_86"


def test_null_device_memory_round_trip():
    dev = NullDevice()
    stream = dev.create_stream()
    ptr = dev.mem_alloc(1024)
    data = np.arange(256, dtype=np.float32)
    dev.memcpy_htod(ptr, data, stream)
    back = dev.memcpy_dtoh(np.empty(256, np.float32), ptr, stream)
    np.testing.assert_array_equal(back, data)
    dev.memset_d16(ptr, 0xFFFF, 4, stream)
    assert (dev.memcpy_dtoh(np.empty(4, np.uint16), ptr) == 0xFFFF).all()
    pinned = dev.pinned(64)
    pinned.array(np.int32)[:] = 7
    assert pinned.array(np.int32).sum() == 7 * 16
    pinned.free()


# ----------------------------------------------------------------------------- arenas


def test_arenas_reserve_take_and_report_gib():
    dev = NullDevice(total_memory=10 * GIB)
    arenas = DeviceArenas.reserve(dev, weights=6 * GIB, kv_pages=3 * GIB, workspace=GIB // 2)
    w = arenas["weights"].take_array("embed", (1000, 64), np.uint16)
    assert w.ptr % 256 == 0 and w.nbytes == 128000
    second = arenas["weights"].take(100, "x")
    assert second.ptr % 256 == 0 and second.ptr >= w.ptr + w.nbytes
    with pytest.raises(DeviceOutOfMemory, match=r"workspace arena is full: big needs 1\.00 GiB, 0\.50 GiB"):
        arenas["workspace"].take(GIB, "big")
    arenas["workspace"].reset()
    assert arenas["workspace"].used == 0
    with pytest.raises(KeyError, match="no state_slots arena"):
        arenas["state_slots"]
    arenas.release()
    assert dev.free_memory() == 10 * GIB


def test_arena_reservation_failure_names_arena_and_frees_the_rest():
    dev = NullDevice(total_memory=8 * GIB)
    with pytest.raises(DeviceOutOfMemory) as info:
        DeviceArenas.reserve(dev, weights=6 * GIB, kv_pages=4 * GIB)
    msg = str(info.value)
    assert "kv_pages arena: 4.00 GiB requested but only 2.00 GiB free of 8.00 GiB" in msg
    assert "already reserved: weights 6.00 GiB" in msg
    assert dev.free_memory() == 8 * GIB  # the weights arena was given back
    with pytest.raises(ValueError, match="unknown arena"):
        DeviceArenas.reserve(dev, scratch=1)


# ----------------------------------------------------------------------------- manifests and kernels

FAKE_CUBIN = b"\x7fELF" + bytes(60)


def _entry(family="fam", key="k1", cubin="fam/k1.cubin", sha=None, **over):
    entry = {
        "family": family,
        "key": key,
        "entry": f"infx_{family}_{key}_kernel",
        "cubin": cubin,
        "cubin_sha256": sha or hashlib.sha256(FAKE_CUBIN).hexdigest(),
        "fingerprint": "f" * 64,
        "sources": {},
        "params": [
            {"kind": "tma", "name": "x_desc", "size": 128, "align": 64, "buffer": "x",
             "encode": TmaEncode("BFLOAT16", (64, "M"), (128,), (64, 128), (1, 1)).to_json()},
            {"kind": "i32", "name": "x_rows", "size": 4, "align": 4, "value": "M"},
            {"kind": "ptr", "name": "out", "size": 8, "align": 8, "buffer": "out"},
            {"kind": "i32", "name": "tiles", "size": 4, "align": 4, "value": "cdiv(M, 128)"},
            {"kind": "f32", "name": "scale", "size": 4, "align": 4, "value": 0.5},
            {"kind": "const", "name": "placeholder", "size": 1, "align": 1, "hex": "00"},
        ],
        "block": [384, 1, 1],
        "grid": ["cdiv(M, 128) * 2", 1, 1],
        "cluster": [1, 1, 1],
        "dynamic_smem": 197632,
        "tensors": {"x": {"dtype": "bf16", "shape": ["M", 64]}, "out": {"dtype": "bf16", "shape": ["M", 256], "role": "out"}},
        "sizes": ["M"],
        "requires": ["M >= 1"],
    }
    entry.update(over)
    return entry


def _write_build(tmp_path: Path, entries, source_root: Path | None = None, arch: str = "sm_90a",
                 manifest_arch: str | None = None) -> Path:
    """A build tree with the manifest under `arch`/ (claiming `manifest_arch`, default the same)."""
    arch_dir = tmp_path / "kernels" / arch
    (arch_dir / "fam").mkdir(parents=True)
    for e in entries:
        (arch_dir / e["cubin"]).parent.mkdir(parents=True, exist_ok=True)
        (arch_dir / e["cubin"]).write_bytes(FAKE_CUBIN)
    doc = {"schema": 1, "arch": manifest_arch or arch, "toolchain": {}, "kernels": entries}
    (arch_dir / "manifest.json").write_text(json.dumps(doc))
    return tmp_path / "kernels"


def test_manifest_round_trip(tmp_path):
    build = _write_build(tmp_path, [_entry()])
    man = Manifest.load(build / "sm_90a" / "manifest.json")
    e = man.kernels[("fam", "k1")]
    assert [p.kind for p in e.params] == ["tma", "i32", "ptr", "i32", "f32", "const"]
    assert e.params[0].encode.box == (64, 128)
    again = Manifest.from_json(json.loads(json.dumps(man.to_json())))
    assert again.kernels[("fam", "k1")].to_json() == e.to_json()


@pytest.mark.parametrize(
    "change,message",
    [
        ({"grid": ["cdiv(T, 128)", 1, 1]}, "reads sizes \\['T'\\]"),
        ({"block": [2048, 1, 1]}, "exceeds 1024 threads"),
        ({"dynamic_smem": 300000}, "exceeds 227 KiB"),
        ({"params": [{"kind": "blob", "name": "b", "size": 1, "align": 1}]}, "unknown parameter kind"),
        ({"params": [{"kind": "ptr", "name": "y", "size": 8, "align": 8, "buffer": "y"}]}, "unknown buffer 'y'"),
        ({"params": [{"kind": "ptr", "name": "out", "size": 4, "align": 4, "buffer": "out"}]}, "8 bytes aligned 8"),
        ({"requires": ["__import__('os')"]}, "not allowed"),
    ],
)
def test_manifest_rejects_what_it_cannot_launch(change, message):
    doc = {"schema": 1, "arch": "sm_90a", "kernels": [_entry(**change)]}
    with pytest.raises(ManifestError, match=message):
        Manifest.from_json(doc)


def test_manifest_errors_are_clear(tmp_path):
    with pytest.raises(ManifestError, match="run `python build_kernels.py"):
        Manifest.load(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.load(tmp_path / "bad.json")
    with pytest.raises(ManifestError, match="schema 0"):
        Manifest.from_json({"schema": 0, "arch": "sm_90a", "kernels": []})


def test_library_loads_binds_and_launches(tmp_path):
    build = _write_build(tmp_path, [_entry()])
    dev = NullDevice()
    lib = KernelLibrary.open(dev, build_dir=build, source_root=False)
    k = lib.kernel("fam", "k1")
    stream = dev.create_stream()
    x, out = dev.mem_alloc(300 * 128), dev.mem_alloc(300 * 512)
    bound = k.bind({"x": x, "out": out}, {"M": 300})
    assert bound.grid == (6, 1, 1)
    blobs = bound.param_bytes()
    assert [len(b) for b in blobs] == [128, 4, 8, 4, 4, 1]
    assert struct.unpack("<Q", blobs[0][:8])[0] == x  # the descriptor starts with the address
    assert struct.unpack("<i", blobs[1])[0] == 300
    assert struct.unpack("<Q", blobs[2])[0] == out
    assert struct.unpack("<i", blobs[3])[0] == 3
    assert struct.unpack("<f", blobs[4])[0] == 0.5
    bound(stream)
    rec = dev.launches[-1]
    assert rec.function == "infx_fam_k1_kernel" and rec.grid == (6, 1, 1) and rec.block == (384, 1, 1)
    assert rec.smem == 197632 and rec.params == blobs
    # The descriptor is encoded once per (buffer, shape): a second bind reuses it.
    assert len(lib._tma_cache) == 1
    k.bind({"x": x, "out": out}, {"M": 300})
    assert len(lib._tma_cache) == 1


def test_library_launch_checks(tmp_path):
    build = _write_build(tmp_path, [_entry()])
    dev = NullDevice()
    k = KernelLibrary.open(dev, build_dir=build, source_root=False).kernel("fam", "k1")
    x, out = dev.mem_alloc(4096), dev.mem_alloc(4096)
    with pytest.raises(LaunchError, match="fam/k1: launch needs M >= 1"):
        k.bind({"x": x, "out": out}, {"M": 0})
    with pytest.raises(LaunchError, match="sizes \\['M'\\] not given"):
        k.bind({"x": x, "out": out}, {})
    with pytest.raises(LaunchError, match="buffer 'out' not given"):
        k.bind({"x": x}, {"M": 1})
    with pytest.raises(LaunchError, match="not 16-byte aligned"):
        k.bind({"x": x + 2, "out": out}, {"M": 1})

    class Buf:
        def __init__(self, ptr, nbytes):
            self.ptr, self.nbytes = ptr, nbytes

    with pytest.raises(LaunchError, match="buffer 'out' has 100 bytes, needs 512"):
        k.bind({"x": x, "out": Buf(out, 100)}, {"M": 1})


def test_missing_kernel_names_family_and_key(tmp_path):
    build = _write_build(tmp_path, [_entry()])
    dev = NullDevice()
    with pytest.raises(KernelMissing, match=r"kernel fam/k2 is not in .*built keys of fam: k1"):
        KernelLibrary.open(dev, build_dir=build, required=["fam/k2"], source_root=False)
    with pytest.raises(KernelMissing, match="no other kernels were built"):
        KernelLibrary.open(dev, build_dir=build, required=[("other", "k")], source_root=False)


def test_stale_kernel_is_a_startup_error(tmp_path):
    src = tmp_path / "repo"
    (src / "cute_kernels").mkdir(parents=True)
    module = src / "cute_kernels" / "fam.py"
    module.write_text("# version 1\n")
    digest = hashlib.sha256(module.read_bytes()).hexdigest()
    build = _write_build(tmp_path, [_entry(sources={"cute_kernels/fam.py": digest})])
    dev = NullDevice()
    KernelLibrary.open(dev, build_dir=build, source_root=src)  # fresh: fine
    module.write_text("# version 2\n")
    with pytest.raises(KernelStale, match="kernel fam/k1 is stale: cute_kernels/fam.py changed"):
        KernelLibrary.open(dev, build_dir=build, source_root=src)


def test_kernels_built_for_another_arch_are_refused(tmp_path):
    # A Blackwell (sm_100a) build, e.g. gemm_bs_sm100's, opened on a Hopper device.
    build = _write_build(tmp_path, [_entry()], arch="sm_100a")
    with pytest.raises(KernelStale, match=r"built for sm_100a; this device is sm_90a: .*--arch sm_90a"):
        KernelLibrary.open(NullDevice(arch="sm_90a"), build_dir=build, arch="sm_100a", source_root=False)
    # By default a device looks in its own arch's directory, which this tree lacks.
    with pytest.raises(ManifestError, match=r"no kernel manifest at .*sm_90a"):
        KernelLibrary.open(NullDevice(arch="sm_90a"), build_dir=build, source_root=False)
    # The device it was built for loads it.
    lib = KernelLibrary.open(NullDevice(arch="sm_100a"), build_dir=build, source_root=False)
    assert lib.manifest.arch == "sm_100a" and lib.kernel("fam", "k1").entry.key == "k1"


def test_manifest_in_the_wrong_arch_directory_is_refused(tmp_path):
    build = _write_build(tmp_path, [_entry()], arch="sm_90a", manifest_arch="sm_100a")
    with pytest.raises(KernelStale, match=r"is for sm_100a, not sm_90a"):
        KernelLibrary.open(NullDevice(arch="sm_90a"), build_dir=build, source_root=False)


def test_altered_cubin_is_refused(tmp_path):
    build = _write_build(tmp_path, [_entry(sha="0" * 64)])
    with pytest.raises(KernelStale, match="does not match the manifest"):
        KernelLibrary.open(NullDevice(), build_dir=build, source_root=False)


def test_graph_capture_and_replay_on_the_null_device(tmp_path):
    build = _write_build(tmp_path, [_entry()])
    dev = NullDevice()
    k = KernelLibrary.open(dev, build_dir=build, source_root=False).kernel("fam", "k1")
    stream = dev.create_stream()
    x, out = dev.mem_alloc(4096), dev.mem_alloc(8192)
    launches = [k.bind({"x": x, "out": out}, {"M": m}) for m in (1, 16)]
    graph = capture_graph(dev, stream, lambda: [b(stream) for b in launches])
    assert graph.nodes == 2 and dev.launches == []  # captured, not run
    graph.replay(stream)
    graph.replay(stream)
    assert [r.graph_replay for r in dev.launches] == [True] * 4
    assert [struct.unpack("<i", r.params[1])[0] for r in dev.launches] == [1, 16, 1, 16]

    def broken():
        launches[0](stream)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        capture_graph(dev, stream, broken)
    capture_graph(dev, stream, lambda: None)  # the stream is usable again


def test_real_device_is_refused_cleanly_without_a_driver():
    import ctypes.util

    if ctypes.util.find_library("cuda"):
        pytest.skip("a CUDA driver is present here")
    from runtime.cuda.device import CudaDevice
    from runtime.cuda.errors import CudaUnavailable

    with pytest.raises(CudaUnavailable, match="cuInit"):
        CudaDevice(0)
