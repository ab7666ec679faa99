"""Compile every CuTe DSL kernel variant ahead of time, on a machine with no GPU.

    python build_kernels.py                      # all sm_90a variants -> build/kernels/sm_90a/
    python build_kernels.py --arch sm_90a --arch sm_100a --jobs 2
    python build_kernels.py --list               # what would be built, no compiling
    python build_kernels.py --check              # manifest and cubins match the sources?

For each variant declared by a family in `cute_kernels/` this compiles the kernel with
`cute.compile(..., options="--gpu-arch <arch> --keep-cubin --keep-ptx")`, then checks what the
compiler produced against what the family declared: exactly one PTX entry, its parameter list
(pointer / int32 / float32 / 128-byte TMA descriptor, in order), the block size (`.reqntid` and the
host launch), static grid entries, and the dynamic shared memory the DSL's own host code launches
with (read from the host IR). Anything it cannot match is an error naming the kernel. It writes
`build/kernels/<arch>/<family>/<key>.cubin` (+ `.ptx`) and one `manifest.json` per arch.

Rebuilds are incremental: a variant is recompiled only when its fingerprint (the sha256 of its
sources, its compile-time config, the arch, the toolchain versions and this script's ABI version)
differs from the manifest's, or its cubin is missing or altered.
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import fnmatch
import hashlib
import importlib
import importlib.metadata
import json
import multiprocessing
import os
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernel_sources import SourceError, module_sources
from runtime.cuda.expr import evaluate
from runtime.cuda.manifest import (
    KernelEntry,
    Manifest,
    ManifestError,
    file_sha256,
    source_hashes,
    variant_fingerprint,
)

REPO = Path(__file__).resolve().parent
DEFAULT_OUT = REPO / "build" / "kernels"
KNOWN_ARCHES = ("sm_90a", "sm_100a", "sm_120a")
# Bump when this script changes how cubins or manifest entries are derived.
ABI_VERSION = 1
# Sources every variant depends on besides its own family module and the package modules it
# imports (`module_sources`).
COMMON_SOURCES = ("cute_kernels/variant.py", "cute_kernels/_dsl.py", "runtime/cuda/expr.py")


class BuildError(RuntimeError):
    """A variant could not be compiled or described; the message names it."""


@dataclass(frozen=True)
class Job:
    module: str  # e.g. "cute_kernels.rmsnorm"
    family: str
    key: str
    arch: str
    sources: Mapping[str, str]
    config: Mapping[str, Any]
    fingerprint: str

    @property
    def name(self) -> str:
        return f"{self.family}/{self.key}"


# --------------------------------------------------------------------------- discovery


def family_modules() -> list[str]:
    import cute_kernels

    return [f"cute_kernels.{name}" for name in cute_kernels.FAMILIES]


def toolchain() -> dict[str, str]:
    """Versions that change generated code. Read from package metadata: no DSL import."""
    out = {}
    for dist in ("nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-cu13"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def plan(arches: Sequence[str], patterns: Sequence[str], tools: Mapping[str, str],
         root: Path = REPO) -> list[Job]:
    """Every (variant, arch) to build, with its fingerprint, filtered by name patterns.

    root: the tree whose files are hashed (the repository; tests pass a copy to see what an
    edit changes). The variants themselves come from the imported `cute_kernels` package."""
    jobs: list[Job] = []
    seen: set[tuple[str, str]] = set()
    for module_name in family_modules():
        module = importlib.import_module(module_name)
        rel = str(Path(module.__file__).resolve().relative_to(REPO))
        family_files = module_sources(root, rel)
        for v in module.variants():
            if v.family != module.FAMILY:
                raise BuildError(f"{v.name}: declared by {module_name} whose FAMILY is {module.FAMILY!r}")
            if (v.family, v.key) in seen:
                raise BuildError(f"{v.name}: declared twice")
            seen.add((v.family, v.key))
            if patterns and not any(fnmatch.fnmatch(v.name, p) or fnmatch.fnmatch(v.family, p) for p in patterns):
                continue
            try:
                json.dumps(dict(v.config), sort_keys=True)
            except TypeError as exc:
                raise BuildError(f"{v.name}: config is not JSON ({exc})") from None
            sources = source_hashes(root, [*family_files, *COMMON_SOURCES, *v.extra_sources])
            for arch in arches:
                if arch not in v.arches:
                    continue
                fp = variant_fingerprint(sources, dict(v.config), arch, tools, ABI_VERSION)
                jobs.append(Job(module_name, v.family, v.key, arch, sources, dict(v.config), fp))
    return jobs


# --------------------------------------------------------------------------- PTX / host IR


_PTX_TYPE_SIZES = {"u8": 1, "s8": 1, "b8": 1, "u16": 2, "s16": 2, "b16": 2, "f16": 2, "u32": 4, "s32": 4,
                   "b32": 4, "f32": 4, "u64": 8, "s64": 8, "b64": 8, "f64": 8}


def parse_ptx_entries(ptx: str) -> list[dict[str, Any]]:
    """Each `.entry`: its name, parameters (type, size, align) and `.reqntid`."""
    entries = []
    for m in re.finditer(r"\.entry\s+(\w+)\s*\((.*?)\)\s*((?:\.\w+[^\n{]*\n\s*)*)\{", ptx, re.S):
        name, plist, directives = m.group(1), m.group(2), m.group(3)
        params = []
        for decl in (d.strip() for d in plist.split(",")):
            if not decl:
                continue
            pm = re.match(r"\.param\s+(?:\.align\s+(\d+)\s+)?\.(\w+)\s+(?:\.ptr\s+(?:\.\w+\s+)*?(?:\.align\s+\d+\s+)?)?(\w+)(?:\[(\d+)\])?$", decl)
            if not pm:
                raise BuildError(f"cannot parse PTX parameter {decl!r} of {name}")
            align, ptype, _, count = pm.groups()
            size = _PTX_TYPE_SIZES[ptype] * (int(count) if count else 1)
            params.append({"type": ptype, "size": size, "align": int(align) if align else _PTX_TYPE_SIZES[ptype],
                           "array": count is not None})
        reqntid = re.search(r"\.reqntid\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?", directives)
        block = tuple(int(x) if x else 1 for x in reqntid.groups()) if reqntid else None
        entries.append({"name": name, "params": params, "reqntid": block})
    return entries


_LAUNCH_STRUCT = "!llvm.struct<(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32)>"


def parse_host_launch(ir_text: str) -> dict[str, Any]:
    """Grid, block and dynamic smem of the one kernel launch in the DSL's host code.

    The DSL's host function fills a launch-config struct {grid[3], block[3], i64 smem, stream,
    attrs, nattrs} before calling the driver. Constant fields are read back here; a field written
    from a runtime value (a dynamic grid dimension) comes back as None.
    """
    allocs = re.findall(r"(%\d+) = llvm\.alloca %\d+ x " + re.escape(_LAUNCH_STRUCT), ir_text)
    if len(allocs) != 1:
        raise BuildError(f"expected one kernel launch in the host code, found {len(allocs)}")
    cfg = allocs[0]
    consts = {m.group(1): int(m.group(2)) for m in re.finditer(r"(%\d+) = llvm\.mlir\.constant\((-?\d+) : i\d+\)", ir_text)}
    geps = {}
    for m in re.finditer(r"(%\d+) = llvm\.getelementptr " + re.escape(cfg) + r"\[0, (\d+)(?:, (\d+))?\]", ir_text):
        geps[m.group(1)] = (int(m.group(2)), int(m.group(3)) if m.group(3) is not None else None)
    fields: dict[tuple[int, int | None], int | None] = {}
    for m in re.finditer(r"llvm\.store (%[\w]+), (%\d+) :", ir_text):
        if m.group(2) in geps:
            fields[geps[m.group(2)]] = consts.get(m.group(1))
    try:
        grid = tuple(fields[(0, i)] for i in range(3))
        block = tuple(fields[(1, i)] for i in range(3))
        smem = fields[(2, None)]
    except KeyError as exc:
        raise BuildError(f"launch-config field {exc} is never written in the host code") from None
    if smem is None or any(b is None for b in block):
        raise BuildError("block or dynamic shared memory of the launch is not a compile-time constant")
    return {"grid": grid, "block": block, "dynamic_smem": smem}


def check_params(variant: Any, ptx_params: Sequence[Mapping[str, Any]]) -> None:
    declared = list(variant.params)
    if len(declared) != len(ptx_params):
        raise BuildError(
            f"{variant.name}: the PTX entry takes {len(ptx_params)} parameters "
            f"({[p['type'] + ('[%d]' % p['size'] if p['array'] else '') for p in ptx_params]}) "
            f"but the family declares {len(declared)} ({[p.kind + ':' + p.name for p in declared]})"
        )
    for i, (want, got) in enumerate(zip(declared, ptx_params)):
        ok = {
            "ptr": got["size"] == 8 and not got["array"] and got["type"] in ("u64", "b64", "s64"),
            # A bare int32, or a 4-byte struct holding one (a TMA coordinate tensor's dynamic dim).
            "i32": got["size"] == 4 and (got["type"] in ("u32", "s32", "b32") or (got["array"] and got["type"] == "b8")),
            "f32": got["type"] == "f32" and not got["array"],
            "tma": got["array"] and got["size"] == 128 and got["align"] == 64,
            "const": got["size"] == want.size,
        }[want.kind]
        if not ok:
            raise BuildError(f"{variant.name}: parameter {i} ({want.kind} {want.name}) compiled as {got}")


def check_pdl(variant: Any, ptx: str) -> None:
    """A variant declares `pdl: True` exactly when its kernel waits on its predecessor
    (`griddepcontrol.wait`): the runtime launches it with the PDL attribute on that word alone,
    and a kernel launched so without the wait could read its predecessor's output too early."""
    declared = bool(variant.config.get("pdl", False))
    waits = "griddepcontrol.wait" in ptx
    if declared != waits:
        raise BuildError(f"{variant.name}: config pdl is {declared} but the PTX "
                         f"{'has' if waits else 'has no'} griddepcontrol.wait")


# --------------------------------------------------------------------------- compiling (worker)


def compile_job(job: Job, out_root: str) -> dict[str, Any]:
    """Compile one variant; write its cubin and PTX; return its manifest entry as JSON."""
    t0 = time.perf_counter()
    os.environ.setdefault("CUTE_DSL_ARCH", job.arch)  # belt and braces; the option below wins
    import cutlass.cute as cute  # imported here so import time is reported apart from compiling

    t_import = time.perf_counter() - t0
    module = importlib.import_module(job.module)
    variant = next(v for v in module.variants() if v.key == job.key)
    with tempfile.TemporaryDirectory(prefix="infx_dsl_") as dump:
        fn, args = module.build(variant)
        t1 = time.perf_counter()
        options = f"--gpu-arch {job.arch} --keep-cubin --keep-ptx --dump-dir {dump}"
        compiled = cute.compile(fn, *args, options=options)
        t_compile = time.perf_counter() - t1
        ptx = _artifact_text(compiled.__ptx__, "PTX", job)
        cubin = _artifact_bytes(compiled.__cubin__, "cubin", job)
        host_ir = str(compiled.ir_module)
    if cubin[:4] != b"\x7fELF":
        raise BuildError(f"{job.name}: the compiler's cubin is not an ELF file")
    entries = parse_ptx_entries(ptx)
    if len(entries) != 1:
        raise BuildError(f"{job.name}: expected one kernel entry in the PTX, found {[e['name'] for e in entries]}")
    ent = entries[0]
    if ent["reqntid"] is not None and tuple(ent["reqntid"]) != tuple(variant.block):
        raise BuildError(f"{job.name}: PTX .reqntid {ent['reqntid']} differs from the declared block {variant.block}")
    check_params(variant, ent["params"])
    check_pdl(variant, ptx)
    launch = parse_host_launch(host_ir)
    if tuple(launch["block"]) != tuple(variant.block):
        raise BuildError(f"{job.name}: host launch block {launch['block']} differs from the declared {variant.block}")
    for axis, (got, rule) in enumerate(zip(launch["grid"], variant.grid)):
        names = {n for n in re.findall(r"[A-Za-z_]\w*", str(rule))} - {"cdiv", "roundup", "min", "max"}
        if not names and got != evaluate(rule, {}):
            raise BuildError(f"{job.name}: host launch grid[{axis}] = {got} but the rule says {rule}")
    rel_cubin = f"{job.family}/{job.key}.cubin"
    out_dir = Path(out_root) / job.family
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{job.key}.cubin").write_bytes(cubin)
    (out_dir / f"{job.key}.ptx").write_text(ptx)
    entry = KernelEntry(
        family=job.family,
        key=job.key,
        entry=ent["name"],
        cubin=rel_cubin,
        cubin_sha256=hashlib.sha256(cubin).hexdigest(),
        fingerprint=job.fingerprint,
        sources=dict(job.sources),
        params=tuple(variant.params),
        block=tuple(variant.block),
        grid=tuple(variant.grid),
        cluster=tuple(variant.cluster),
        dynamic_smem=int(launch["dynamic_smem"]),
        tensors=dict(variant.tensors),
        sizes=tuple(variant.sizes),
        requires=tuple(variant.requires),
        config=dict(variant.config),
        build={"compile_s": round(t_compile, 3), "import_s": round(t_import, 3), "cubin_bytes": len(cubin),
               "note": variant.note, "example_sizes": dict(variant.example_sizes)},
    )
    entry.validate(job.name)
    return entry.to_json()


def _artifact_text(value: Any, what: str, job: Job) -> str:
    if isinstance(value, str) and "\n" not in value and os.path.exists(value):
        return Path(value).read_text()
    if isinstance(value, str) and value:
        return value
    raise BuildError(f"{job.name}: the compiler returned no {what}")


def _artifact_bytes(value: Any, what: str, job: Job) -> bytes:
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str) and os.path.exists(value):
        return Path(value).read_bytes()
    raise BuildError(f"{job.name}: the compiler returned no {what}")


def _worker(job: Job, out_root: str) -> tuple[Job, dict[str, Any] | None, str | None, float]:
    t = time.perf_counter()
    try:
        return job, compile_job(job, out_root), None, time.perf_counter() - t
    except Exception as exc:  # reported, with the kernel's name, by the parent
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        if not isinstance(exc, BuildError):
            detail += "\n" + "".join(traceback.format_tb(exc.__traceback__)[-3:])
        return job, None, detail, time.perf_counter() - t


# --------------------------------------------------------------------------- driver


def _load_existing(path: Path) -> Manifest | None:
    try:
        return Manifest.load(path)
    except ManifestError:
        return None


def _up_to_date(job: Job, old: Manifest | None, arch_dir: Path) -> KernelEntry | None:
    if old is None:
        return None
    e = old.kernels.get((job.family, job.key))
    if e is None or e.fingerprint != job.fingerprint:
        return None
    cubin = arch_dir / e.cubin
    if not cubin.exists() or file_sha256(cubin) != e.cubin_sha256:
        return None
    return e


def build(arches: Sequence[str], out: Path, jobs_n: int, patterns: Sequence[str], force: bool) -> int:
    t_start = time.perf_counter()
    tools = toolchain()
    if "nvidia-cutlass-dsl" not in tools:
        print("error: nvidia-cutlass-dsl is not installed (pip install -e '.[build]')", file=sys.stderr)
        return 2
    all_jobs = plan(arches, patterns, tools)
    failures: list[str] = []
    for arch in arches:
        arch_jobs = [j for j in all_jobs if j.arch == arch]
        arch_dir = out / arch
        arch_dir.mkdir(parents=True, exist_ok=True)
        old = _load_existing(arch_dir / "manifest.json")
        kept: dict[tuple[str, str], KernelEntry] = {}
        if old is not None and old.arch == arch:
            kept = dict(old.kernels)
        todo = []
        for j in arch_jobs:
            e = None if force else _up_to_date(j, old, arch_dir)
            if e is not None:
                kept[(j.family, j.key)] = e
            else:
                kept.pop((j.family, j.key), None)
                todo.append(j)
        total = len(arch_jobs)
        done = total - len(todo)
        print(f"[{arch}] {total} variants: {done} up to date, {len(todo)} to compile with {jobs_n} job(s)", file=sys.stderr)
        for job, entry, err, secs in _run(todo, str(arch_dir), jobs_n):
            done += 1
            if err is not None:
                failures.append(f"{job.name} ({arch}): {err}")
                print(f"[{done}/{total}] FAILED {job.name} ({arch}) after {secs:.1f} s:\n  {err}", file=sys.stderr)
                continue
            assert entry is not None
            kernel = KernelEntry.from_json(entry, job.name)
            kept[(job.family, job.key)] = kernel
            print(f"[{done}/{total}] {job.name} ({arch}) compiled in {secs:.1f} s "
                  f"(smem {kernel.dynamic_smem} B, {kernel.build.get('cubin_bytes')} B cubin)", file=sys.stderr)
        if not patterns:
            # Variants no family declares any more leave the manifest, and their files go.
            declared = {(j.family, j.key) for j in arch_jobs}
            for stale in sorted(set(kept) - declared):
                e = kept.pop(stale)
                for suffix in (".cubin", ".ptx"):
                    (arch_dir / e.cubin).with_suffix(suffix).unlink(missing_ok=True)
                print(f"  removed {e.name} ({arch}): no family declares it", file=sys.stderr)
        Manifest(arch=arch, toolchain={**tools, "abi": str(ABI_VERSION)}, kernels=kept).write(arch_dir / "manifest.json")
    took = time.perf_counter() - t_start
    if failures:
        print(f"build FAILED for {len(failures)} kernel(s) in {took:.1f} s:", file=sys.stderr)
        for f in failures:
            print("  " + f.splitlines()[0], file=sys.stderr)
        return 1
    print(f"build finished in {took:.1f} s", file=sys.stderr)
    return 0


def _run(todo: Sequence[Job], arch_dir: str, jobs_n: int) -> Iterable[tuple[Job, dict | None, str | None, float]]:
    if not todo:
        return
    if jobs_n <= 1 or len(todo) == 1:
        for j in todo:
            yield _worker(j, arch_dir)
        return
    # spawn: each worker imports the DSL once; forking a process that holds MLIR state is unsafe.
    ctx = multiprocessing.get_context("spawn")
    # Longest first (GEMMs), so the pool does not end on one slow straggler.
    order = sorted(todo, key=lambda j: 0 if "gemm" in j.family else 1)
    with futures.ProcessPoolExecutor(max_workers=jobs_n, mp_context=ctx) as pool:
        pending = [pool.submit(_worker, j, arch_dir) for j in order]
        for fut in futures.as_completed(pending):
            yield fut.result()


def check(arches: Sequence[str], out: Path, patterns: Sequence[str]) -> int:
    """Verify each arch's manifest and cubins against the current sources, without compiling."""
    tools = toolchain()
    problems: list[str] = []
    for arch in arches:
        path = out / arch / "manifest.json"
        try:
            man = Manifest.load(path)
        except ManifestError as exc:
            problems.append(str(exc))
            continue
        if "nvidia-cutlass-dsl" not in tools:
            # Without the DSL the toolchain cannot be compared; trust the manifest's record.
            tools = {k: v for k, v in man.toolchain.items() if k != "abi"}
        jobs = [j for j in plan([arch], patterns, tools)]
        declared = set()
        for j in jobs:
            declared.add((j.family, j.key))
            e = man.kernels.get((j.family, j.key))
            if e is None:
                problems.append(f"{j.name} ({arch}): missing from {path}")
            elif e.fingerprint != j.fingerprint:
                changed = [s for s in j.sources if e.sources.get(s) != j.sources[s]]
                why = f"sources changed: {', '.join(changed)}" if changed else "config or toolchain changed"
                problems.append(f"{j.name} ({arch}): stale ({why})")
            else:
                cubin = out / arch / e.cubin
                if not cubin.exists():
                    problems.append(f"{j.name} ({arch}): cubin {cubin} is missing")
                elif file_sha256(cubin) != e.cubin_sha256:
                    problems.append(f"{j.name} ({arch}): cubin {cubin} does not match the manifest")
        if not patterns:
            for extra in sorted(set(man.kernels) - declared):
                problems.append(f"{extra[0]}/{extra[1]} ({arch}): in the manifest but no family declares it")
    for p in problems:
        print(p, file=sys.stderr)
    print(f"check: {'OK' if not problems else f'{len(problems)} problem(s)'}", file=sys.stderr)
    return 0 if not problems else 1


def list_variants(arches: Sequence[str], patterns: Sequence[str]) -> int:
    for j in plan(arches, patterns, toolchain()):
        module = importlib.import_module(j.module)
        v = next(v for v in module.variants() if v.key == j.key)
        grid = ", ".join(str(g) for g in v.grid)
        pdl = "pdl  " if v.config.get("pdl") else ""  # launched with PDL in decode plans (cute_kernels/_pdl.py)
        print(f"{j.arch}  {j.name:34s} block {v.block[0]:4d}  grid ({grid})  {pdl}{v.note}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", action="append", choices=KNOWN_ARCHES,
                    help="target architecture, repeatable (default sm_90a)")
    ap.add_argument("--jobs", "-j", type=int, default=1, help="compile N variants in parallel (default 1)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output root (default {DEFAULT_OUT.relative_to(REPO)})")
    ap.add_argument("--only", action="append", default=[], metavar="PATTERN",
                    help="only variants whose family/key or family matches this glob (repeatable)")
    ap.add_argument("--force", action="store_true", help="recompile even up-to-date variants")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--list", action="store_true", help="list the variants and exit")
    mode.add_argument("--check", action="store_true", help="verify manifest and cubins against sources, no compiling")
    args = ap.parse_args(argv)
    arches = args.arch or ["sm_90a"]
    if args.jobs < 1:
        ap.error("--jobs must be at least 1")
    try:
        if args.list:
            return list_variants(arches, args.only)
        if args.check:
            return check(arches, args.out, args.only)
        return build(arches, args.out, args.jobs, args.only, args.force)
    except (BuildError, SourceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
