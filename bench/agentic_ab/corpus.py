"""The observation corpus: text generated before a run from a real source tree, so every arm of
an A/B receives byte-identical tool results, user messages and logs.

`load_tree(path, rev)` reads a git repository at one revision (`git ls-tree` + `git cat-file`,
plus the patches of recent commits for diff observations) or, for a plain directory, its files.
`Observer` turns the tree into observations of a planned size: each generator returns an
`Observation` (the tool kind, its arguments, the text, and the simulated execution seconds that
the client waits before delivering it, identical in every arm).

Sizes are planned in estimated tokens at `CHARS_PER_TOKEN` (code and logs run close to 3.1
characters per token with Qwen's tokenizer); reports always use the server's counts.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from random import Random

CHARS_PER_TOKEN = 3.1
MAX_FILE_BYTES = 400_000  # larger files are data, not something an agent reads whole
AREAS = 3  # one area per main session, as three engineers would split a repository
IDENTIFIER = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]{5,}\b")
TEST_NAME = re.compile(r"^\s*(?:async\s+)?def\s+(test_\w+)", re.MULTILINE)
DOC_SUFFIXES = (".md", ".rst", ".txt")


def chars_for(tokens: int) -> int:
    return int(tokens * CHARS_PER_TOKEN)


def estimate_tokens(text: str) -> int:
    return int(len(text) / CHARS_PER_TOKEN) + 1


@dataclass
class SourceTree:
    """files: path -> text (text files only); patches: `git show --stat --patch` outputs of
    recent commits with the paths each touches; origin: what was read (for the plan header)."""
    files: dict[str, str]
    patches: list[tuple[list[str], str]] = field(default_factory=list)
    origin: dict = field(default_factory=dict)

    def areas(self) -> list[list[str]]:
        """Top-level directories dealt to AREAS groups, largest first into the smallest group,
        so each main session works in its own part of the tree; root files go with the last
        group. A group left empty (a tiny tree) borrows every file."""
        by_dir: dict[str, list[str]] = {}
        for path in sorted(self.files):
            top = path.split("/", 1)[0] if "/" in path else ""
            by_dir.setdefault(top, []).append(path)
        groups: list[list[str]] = [[] for _ in range(AREAS)]
        root = by_dir.pop("", [])
        for _, paths in sorted(by_dir.items(), key=lambda item: (-len(item[1]), item[0])):
            min(groups, key=len).extend(paths)
        groups[-1].extend(root)
        every = sorted(self.files)
        return [sorted(group) if group else every for group in groups]


def _git(path: Path, *args: str, data: bytes | None = None) -> bytes:
    return subprocess.run(["git", "-C", str(path), *args], input=data, capture_output=True,
                          check=True).stdout


def _as_text(raw: bytes) -> str | None:
    if b"\0" in raw or len(raw) > MAX_FILE_BYTES or not raw.strip():
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def load_tree(path: str | Path, rev: str = "HEAD", max_commits: int = 40) -> SourceTree:
    root = Path(path).resolve()
    try:
        sha = _git(root, "rev-parse", "--verify", f"{rev}^{{commit}}").decode().strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        sha = None
    if sha is None:
        return _load_directory(root)
    names = [n for n in _git(root, "ls-tree", "-r", "-z", "--name-only", sha).decode()
             .split("\0") if n]
    # One `git cat-file --batch` for all blobs: the output is "<sha> blob <size>\n<bytes>\n".
    batch = _git(root, "cat-file", "--batch", data="".join(f"{sha}:{n}\n" for n in names)
                 .encode())
    files: dict[str, str] = {}
    offset = 0
    for name in names:
        header_end = batch.index(b"\n", offset)
        header = batch[offset:header_end].split()
        offset = header_end + 1
        if len(header) < 3 or header[1] != b"blob":
            continue  # submodules and the like
        size = int(header[2])
        text = _as_text(batch[offset:offset + size])
        offset += size + 1
        if text is not None:
            files[name] = text
    patches = []
    for commit in _git(root, "log", f"-n{max_commits}", "--format=%H", sha).decode().split():
        touched = [p for p in _git(root, "show", "--name-only", "--format=", commit).decode()
                   .splitlines() if p]
        patch = _git(root, "show", "--stat", "--patch", commit).decode("utf-8", "replace")
        patches.append((touched, patch))
    return SourceTree(files, patches, {"path": str(root), "rev": sha, "files": len(files),
                                       "commits": len(patches)})


def _load_directory(root: Path) -> SourceTree:
    files: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            full = Path(dirpath) / name
            text = _as_text(full.read_bytes())
            if text is not None:
                files[full.relative_to(root).as_posix()] = text
    if not files:
        raise ValueError(f"no text files under {root}")
    return SourceTree(files, [], {"path": str(root), "rev": None, "files": len(files),
                                  "commits": 0})


@dataclass
class Observation:
    """kind: read / grep / glob / diff / edit / test / log; tool: the generic tool the agent
    called (personas name their tools after these); arguments: that call's arguments."""
    kind: str
    tool: str
    arguments: dict
    text: str
    exec_s: float


# Per kind: (generic tool, (lowest, highest) tokens at scale 1, (lowest, highest) exec seconds).
KINDS = {
    "read": ("read_file", (700, 5200), (0.15, 0.5)),
    "grep": ("grep", (150, 1800), (0.2, 0.8)),
    "glob": ("glob", (60, 500), (0.1, 0.3)),
    "diff": ("shell", (600, 4000), (0.3, 0.9)),
    "edit": ("edit_file", (150, 400), (0.1, 0.3)),
    "test": ("shell", (300, 2200), (2.0, 6.0)),
}


class Observer:
    """Observations from one area of the tree. `rng` is the caller's: the plan owns the order
    of draws, so the same seed gives the same observations."""

    def __init__(self, tree: SourceTree, area: list[str], scale: float):
        self.tree = tree
        self.scale = scale
        self.area = area
        self.code = [p for p in area if not p.endswith(DOC_SUFFIXES)] or area
        self.patches = [patch for touched, patch in tree.patches
                        if any(p in area for p in touched)] or \
            [patch for _, patch in tree.patches]

    def target(self, rng: Random, low: int, high: int) -> int:
        """A log-uniform size in [low, high] x scale: many small results, a few large."""
        value = low * (high / low) ** rng.random()
        return max(24, int(value * self.scale))

    def observe(self, rng: Random, kind: str, tokens: int | None = None) -> Observation:
        tool, (low, high), (fast, slow) = KINDS[kind]
        if kind == "diff" and not self.patches:
            kind, tool = "read", "read_file"  # a plain directory has no history
        size = tokens if tokens is not None else self.target(rng, low, high)
        text, arguments = getattr(self, "_" + kind)(rng, chars_for(size))
        # Fixed shapes (a 30-line failure excerpt, a 22-line edit snippet) can overrun a small
        # target; the cut keeps every observation at its planned size.
        text = text[:chars_for(size)]
        exec_s = round((fast + (slow - fast) * rng.random()) * self.scale, 3)
        return Observation(kind, tool, arguments, text, exec_s)

    def _pick_file(self, rng: Random, chars: int) -> str:
        """A random code file big enough for the target, else the biggest one."""
        big = [p for p in self.code if len(self.tree.files[p]) >= chars]
        return rng.choice(big) if big else max(self.code, key=lambda p: len(self.tree.files[p]))

    def _numbered(self, path: str, start: int, chars: int) -> tuple[str, int, int]:
        lines = self.tree.files[path].splitlines()
        out, end, used = [], start, 0
        while end < len(lines) and used < chars:
            row = f"{end + 1:6d}\t{lines[end]}"
            out.append(row)
            used += len(row) + 1
            end += 1
        return "\n".join(out), start + 1, end

    def _read(self, rng: Random, chars: int) -> tuple[str, dict]:
        path = self._pick_file(rng, chars)
        lines = self.tree.files[path].splitlines()
        # Start where enough text remains after the start line for the target.
        budget, start = 0, len(lines)
        while start > 0 and budget < chars:
            start -= 1
            budget += len(lines[start]) + 8
        start = rng.randrange(start + 1)
        body, first, last = self._numbered(path, start, chars)
        header = f"Showing lines {first}-{last} of {len(lines)} of {path}\n"
        return header + body, {"path": path, "offset": first, "limit": last - first + 1}

    def _grep(self, rng: Random, chars: int) -> tuple[str, dict]:
        source = self.tree.files[rng.choice(self.code)]
        words = sorted(set(IDENTIFIER.findall(source))) or ["import"]
        patterns = [rng.choice(words) for _ in range(1 + rng.randrange(3))]
        rows, used = [], 0
        for path in self.area:
            for number, line in enumerate(self.tree.files[path].splitlines(), 1):
                if any(p in line for p in patterns):
                    row = f"{path}:{number}:{line.strip()[:200]}"
                    rows.append(row)
                    used += len(row) + 1
                    if used >= chars:
                        break
            if used >= chars:
                break
        pattern = "|".join(patterns)
        return "\n".join(rows) or "No matches found", {"pattern": pattern, "path": "."}

    def _glob(self, rng: Random, chars: int) -> tuple[str, dict]:
        start = rng.randrange(len(self.area))
        rows, used = [], 0
        for path in self.area[start:] + self.area[:start]:
            rows.append(path)
            used += len(path) + 1
            if used >= chars:
                break
        top = self.area[start].split("/", 1)[0]
        return "\n".join(rows), {"pattern": f"{top}/**/*"}

    def _diff(self, rng: Random, chars: int) -> tuple[str, dict]:
        patch = rng.choice(self.patches)
        commit = patch.split(None, 2)[1] if patch.startswith("commit ") else "HEAD"
        return patch[:chars], {"command": f"git show --stat --patch {commit[:12]}"}

    def _edit(self, rng: Random, chars: int) -> tuple[str, dict]:
        path = self._pick_file(rng, 0)
        lines = self.tree.files[path].splitlines()
        start = rng.randrange(max(1, len(lines) - 22))
        body, _, _ = self._numbered(path, start, max(chars, 1))
        old = lines[start] if lines else ""
        text = (f"The file {path} has been updated. Here's the result of running `cat -n` on a "
                f"snippet of the edited file:\n{body}")
        return text, {"path": path, "old_string": old, "new_string": old + "  # checked"}

    def _test(self, rng: Random, chars: int) -> tuple[str, dict]:
        """A pytest transcript of real test names; 35 % fail with a real 30-line excerpt."""
        names = [(p, n) for p in self.area for n in TEST_NAME.findall(self.tree.files[p])]
        if not names:
            names = [(p, "test_" + Path(p).stem) for p in self.code]
        failing = rng.random() < 0.35
        rows, used = [], 0
        for _ in range(len(names)):
            path, name = rng.choice(names)
            rows.append(f"{path}::{name} PASSED")
            used += len(rows[-1]) + 1
            if used >= chars * (0.4 if failing else 1.0):
                break
        tail = f"{len(rows)} passed in {1 + rng.random() * 40:.2f}s"
        if failing:
            path, name = rng.choice(names)
            rows.append(f"{path}::{name} FAILED")
            code = self._pick_file(rng, 0)
            lines = self.tree.files[code].splitlines()
            start = rng.randrange(max(1, len(lines) - 30))
            excerpt = "\n".join(f"    {line}" for line in lines[start:start + 30])
            rows.append(f"\n=================== FAILURES ===================\n___ {name} ___\n"
                        f"{code}:{start + 1}: in {name}\n{excerpt}\nE   AssertionError: "
                        f"values differ at index {rng.randrange(64)}")
            tail = f"1 failed, {len(rows) - 2} passed in {1 + rng.random() * 40:.2f}s"
        command = f"python -m pytest -q {Path(names[0][0]).parent.as_posix()}"
        return f"$ {command}\n" + "\n".join(rows) + f"\n{tail}", {"command": command}

    def pasted_log(self, rng: Random, tokens: int) -> str:
        """Several build/test transcripts concatenated to a size: a user pasting a CI log."""
        parts, used = [], 0
        while used < chars_for(tokens):
            text, _ = self._test(rng, chars_for(tokens) // 3 + 1)
            parts.append(text)
            used += len(text) + 1
        return "\n".join(parts)[:chars_for(tokens)]

    def doc_text(self, tokens: int, offset: int = 0) -> str:
        """Documentation text (the tree's docs, largest first, then code) to a size; `offset`
        picks where in that order to start so personas get different documents."""
        docs = sorted((p for p in self.tree.files if p.endswith(DOC_SUFFIXES)),
                      key=lambda p: (-len(self.tree.files[p]), p))
        order = docs + sorted(self.tree.files)
        order = order[offset % len(order):] + order[:offset % len(order)]
        parts, used = [], 0
        for path in order:
            if used >= chars_for(tokens):
                break
            parts.append(f"# {path}\n{self.tree.files[path]}")
            used += len(parts[-1]) + 1
        return "\n".join(parts)[:chars_for(tokens)]
