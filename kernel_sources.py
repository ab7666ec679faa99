"""Which source files a kernel family's fingerprint covers: its own module and every
`cute_kernels` module it imports, directly or through another one (STYLE.md 20).

Read statically from the import statements with `ast` (nothing is imported), so it can hash a
copy of the tree as well as the repository. Used by `build_kernels.py`.
"""

from __future__ import annotations

import ast
from pathlib import Path

# The package of kernel families; imports from anywhere else are not followed.
PACKAGE = "cute_kernels"


class SourceError(RuntimeError):
    """A family's imports cannot be followed to files; the message names the importing file."""


def module_sources(root: Path, rel: str) -> list[str]:
    """`rel` and every `cute_kernels` module it imports, directly or through another one.

    A family may take its launch description from another family's file (`gdn_chunked` calls
    `gdn.prefill_interface`, `attention_prefill` reads `attention`'s tensors), so that file
    must be in its fingerprint, or an edit there would leave a stale cubin in use. Read from the
    import statements (anywhere in the file, function bodies included) rather than a list kept
    by hand, so a new family is covered without touching the build."""
    found: set[str] = set()
    pending = [rel]
    while pending:
        current = pending.pop()
        if current in found:
            continue
        found.add(current)
        tree = ast.parse((root / current).read_text(encoding="utf-8"), filename=current)
        for node in ast.walk(tree):
            pending += [_package_file(root, dotted, current) for dotted in _package_imports(node, current)]
    return sorted(found)


def _package_imports(node: ast.AST, rel: str) -> list[str]:
    """What an import statement takes from `cute_kernels`, as dotted names.

    `from .gdn import layout` gives "cute_kernels.gdn.layout" and `from . import gdn` gives
    "cute_kernels.gdn": an imported name may be a module or a name defined in one, which
    `_package_file` sorts out. Imports from outside the package give nothing."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] == PACKAGE]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level == 0:
        base = node.module or ""
        if base.split(".")[0] != PACKAGE:
            return []
    elif node.level == 1:
        base = PACKAGE + (f".{node.module}" if node.module else "")
    else:
        raise SourceError(f"{rel}: relative import beyond the {PACKAGE} package (level {node.level})")
    return [f"{base}.{alias.name}" for alias in node.names]


def _package_file(root: Path, dotted: str, importer: str) -> str:
    """The repository-relative file defining `dotted`: the longest prefix of it that is a module
    (`name.py`) or a package (`name/__init__.py`) under `root`."""
    parts = dotted.split(".")
    while parts:
        for candidate in ("/".join(parts) + ".py", "/".join(parts) + "/__init__.py"):
            if (root / candidate).is_file():
                return candidate
        parts.pop()
    raise SourceError(f"{importer}: no file under {root} defines {dotted}")
