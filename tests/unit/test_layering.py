"""The package layering of DESIGN.md section 2: no torch in the product, arrows only point down.

Checked statically (every import statement of every module, including imports inside functions)
and dynamically (importing every runtime and protocols module leaves torch out of sys.modules).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT_PACKAGES = ("runtime", "protocols", "cute_kernels")

# Module prefix -> imported-module prefixes it must never use.
FORBIDDEN = {
    "runtime.cuda": ("runtime.artifact", "runtime.model", "runtime.engine", "runtime.text",
                     "runtime.cli", "runtime.session", "protocols", "cute_kernels"),
    "runtime.artifact": ("cuda", "runtime.cuda", "runtime.model", "runtime.engine",
                         "runtime.text", "runtime.cli", "runtime.session", "protocols",
                         "cute_kernels"),
    "runtime.model": ("cuda", "runtime.engine", "runtime.text", "runtime.cli",
                      "runtime.session", "protocols", "cute_kernels"),
    "runtime.engine": ("cuda", "runtime.cuda", "runtime.artifact", "runtime.text",
                       "runtime.cli", "runtime.session", "protocols", "cute_kernels"),
    "runtime.text": ("cuda", "runtime.cuda", "runtime.model", "runtime.engine", "runtime.cli",
                     "runtime.session", "protocols", "cute_kernels"),
    "runtime.media": ("cuda", "runtime.cuda", "runtime.artifact", "runtime.model",
                      "runtime.engine", "runtime.text", "runtime.cli", "runtime.session",
                      "protocols", "cute_kernels"),
    "runtime.cli": ("cuda", "runtime.cuda", "protocols", "cute_kernels"),
    "runtime.session": ("cuda", "runtime.cuda", "protocols", "cute_kernels"),
    "protocols": ("cuda", "runtime.cuda", "runtime.model", "runtime.artifact", "runtime.cli",
                  "cute_kernels"),
    "cute_kernels": ("runtime", "protocols"),
}
# Exceptions to the table above, each a pure-data contract module:
# the engine reaches the model only through the ModelRunner protocol module and the sampling
# contract (the draws and per-row inputs the host sampler shares with the device sampler), kernel families
# describe their launches with the manifest schema the runtime reads (one definition, not two).
# `--demo` generates its tiny model on first use with the same tool the tests use.
# The sampling kernels share the host sampler's pure-data contract (draw hash, row settings).
# The attention kernels share the KV page formats' contract (`runtime.model.kv_format`: page
# layout, rounding rules) with the runner's storage.
ALLOWED = {
    "runtime.engine": ("runtime.model.runner", "runtime.model.sampling"),
    "runtime.session": ("tools.make_tiny",),
    "runtime.media": ("runtime.model.runner",),
    "cute_kernels": ("runtime.cuda.manifest", "runtime.cuda.expr", "runtime.model.sampling",
                     "runtime.model.kv_format"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
            found.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _product_modules() -> list[Path]:
    return sorted(p for package in PRODUCT_PACKAGES for p in (ROOT / package).rglob("*.py"))


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_no_product_module_imports_torch():
    offenders = [f"{_module_name(p)} imports {name}" for p in _product_modules()
                 for name in _imports(p) if _matches(name, "torch")]
    assert offenders == []


def test_arrows_point_down():
    offenders = []
    for path in _product_modules():
        module = _module_name(path)
        for owner, forbidden in FORBIDDEN.items():
            if not _matches(module, owner):
                continue
            forbidden = forbidden + ("tools", "bench", "tests")
            for name in _imports(path):
                allowed = any(_matches(name, ok) for ok in ALLOWED.get(owner, ()))
                if not allowed and any(_matches(name, bad) for bad in forbidden):
                    offenders.append(f"{module} imports {name}")
                if (owner == "runtime.engine" and _matches(name, "runtime.model")
                        and not allowed):
                    offenders.append(f"{module} imports {name} (engine: protocol module only)")
    assert offenders == []


def test_the_checker_catches_a_bad_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    import torch\n    from cuda.bindings import driver\n")
    assert _imports(bad) == ["torch", "cuda.bindings", "cuda.bindings.driver"]


def test_importing_runtime_and_protocols_loads_no_torch():
    modules = [_module_name(p) for p in _product_modules()
               if _module_name(p).split(".")[0] in ("runtime", "protocols")]
    script = ("import importlib, sys\n"
              f"for name in {modules!r}:\n"
              "    importlib.import_module(name)\n"
              "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("package", ["runtime", "protocols", "cute_kernels", "tools", "bench"])
def test_every_package_says_what_it_owns(package):
    for init in (ROOT / package).rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        assert doc and len(doc.split()) >= 12, f"{init} needs a docstring saying what it owns"
