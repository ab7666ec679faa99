"""Personas: the system prompts and tool schemas of the clients the workload imitates.

Two main-session styles (cc, like Claude Code: many tools, long instructions; qc, like Qwen
Code: a different instruction style and tool set), two subagent kinds (explore: read-only, one
system+tools prefix shared by every explore subagent; review) and two tool-less side personas
(compact: the summariser of a compaction call; check: a loop detector answering one JSON object).
The texts are ours; the sizes follow the traffic they imitate (scaled by the plan's scale), and
each system prompt ends with documentation from the source tree, as agents paste their
repository's instructions and architecture notes into the system prompt.
"""

from __future__ import annotations

from bench.agentic_ab.corpus import Observer, chars_for

# (name, description, {param: (json type, description)}, required params)
ToolSpec = tuple[str, str, dict[str, tuple[str, str]], tuple[str, ...]]

PATH = ("string", "Path of the file, relative to the repository root.")
CORE_TOOLS: list[ToolSpec] = [
    ("read_file", "Read a text file. Returns numbered lines; use offset and limit for large "
     "files instead of reading them whole.",
     {"path": PATH, "offset": ("integer", "First line to show, from 1."),
      "limit": ("integer", "How many lines to show.")}, ("path",)),
    ("grep", "Search file contents with a regular expression; returns path:line:text rows.",
     {"pattern": ("string", "Regular expression."),
      "path": ("string", "Directory to search, default the repository root.")}, ("pattern",)),
    ("shell", "Run a shell command in the repository root and return its output. Long-running "
     "commands should use a timeout.",
     {"command": ("string", "The command line."),
      "timeout_s": ("integer", "Seconds before the command is stopped.")}, ("command",)),
    ("edit_file", "Replace one exact occurrence of old_string with new_string in a file. The "
     "old string must match the file byte for byte, indentation included.",
     {"path": PATH, "old_string": ("string", "Text to replace."),
      "new_string": ("string", "Replacement text.")}, ("path", "old_string", "new_string")),
    ("glob", "List files whose path matches a glob pattern, newest first.",
     {"pattern": ("string", "A glob such as src/**/*.py.")}, ("pattern",)),
    ("write_file", "Create or overwrite a file with the given content. Read the file first if "
     "it exists; prefer edit_file for small changes.",
     {"path": PATH, "content": ("string", "The complete new content.")}, ("path", "content")),
    ("list_directory", "List the entries of one directory.", {"path": PATH}, ("path",)),
    ("web_fetch", "Fetch a URL and return its text content.",
     {"url": ("string", "The address to fetch.")}, ("url",)),
]
EXTRA_TOOLS: list[ToolSpec] = [
    ("multi_edit", "Apply several edit_file replacements to one file atomically.",
     {"path": PATH, "edits": ("array", "List of {old_string, new_string} objects.")},
     ("path", "edits")),
    ("shell_background", "Start a command in the background and return a handle to poll.",
     {"command": ("string", "The command line.")}, ("command",)),
    ("web_search", "Search the web and return result titles, addresses and snippets.",
     {"query": ("string", "Search terms.")}, ("query",)),
    ("todo_write", "Replace the task list shown to the user.",
     {"items": ("array", "Tasks, each {text, status}.")}, ("items",)),
    ("task", "Start a subagent with its own context for a self-contained research task; it "
     "returns one report.",
     {"description": ("string", "Short title."), "prompt": ("string", "The full task.")},
     ("description", "prompt")),
    ("notebook_edit", "Edit one cell of a Jupyter notebook.",
     {"path": PATH, "cell": ("integer", "Cell index."), "source": ("string", "New source.")},
     ("path", "cell", "source")),
    ("ask_user", "Ask the user a question and wait for the answer.",
     {"question": ("string", "The question.")}, ("question",)),
    ("memory", "Save a fact to remember across sessions.",
     {"fact": ("string", "One sentence.")}, ("fact",)),
    ("exit_plan_mode", "Present the plan and leave planning mode.",
     {"plan": ("string", "The plan, in Markdown.")}, ("plan",)),
    ("git_status", "Show the working tree status and the current branch.", {}, ()),
    ("diagnostics", "Return compiler and linter diagnostics for a file.", {"path": PATH},
     ("path",)),
    ("save_checkpoint", "Record the current state so the session can be resumed.",
     {"note": ("string", "What was done.")}, ("note",)),
]
REPORT_FINDING: ToolSpec = (
    "report_finding", "Record one review finding with its location and severity.",
    {"path": PATH, "line": ("integer", "Line number."),
     "severity": ("string", "blocker, major or minor."),
     "message": ("string", "What is wrong and why.")}, ("path", "line", "severity", "message"))
READ_ONLY = ("read_file", "grep", "shell", "glob", "list_directory", "web_fetch")

INSTRUCTIONS = {
    "cc": """You are an interactive coding agent working in the user's repository. You help with
software engineering tasks: fixing bugs, adding features, refactoring, explaining code.
Rules: read before you edit; keep changes minimal and in the style of the surrounding code;
run the relevant tests after each change and report failures honestly; never invent file
contents; use the task tool for broad searches so that your own context stays small; keep the
todo list current; answer in short paragraphs, with file paths and line numbers when you
refer to code. When a command fails, read its output before retrying. Do not commit unless the
user asks. Below are the repository's own instructions and architecture notes.""",
    "qc": """# Role
You are a CLI agent specialised in software engineering.
# Core mandates
- Conventions: follow the project's existing conventions; analyse surrounding code first.
- Libraries: never assume a library is available; check the project's manifests.
- Verification: after changes, run the project's build, linters and tests.
- Explanations: be concise; no preamble, no summaries unless asked.
# Workflow
1. Understand: search and read until you know the relevant files.
2. Plan: share a short plan.
3. Implement with the tools, 4. Verify, 5. Report.
# Project context follows.""",
    "explore": """You are a read-only research subagent. You may search and read files and run
commands that change nothing. You must not edit, write or delete anything. Answer the parent
agent's question with a report: the relevant files and symbols, how they connect, and open
questions. Quote short code excerpts with paths and line numbers. Reference material:""",
    "review": """You are a code-review subagent. Read the change and the code it touches; report
each real problem with report_finding (path, line, severity, message): correctness first, then
contracts between modules, then tests that do not test. No style nits. Reference material:""",
    "compact": """You summarise a coding-agent conversation so that work can continue in a fresh
context. Keep: the user's goal, decisions and their reasons, files touched with what changed,
commands that failed and why, the current state and the next steps. Drop tool output that is
no longer needed.""",
    "check": """You watch a coding agent for loops. Read the conversation and answer with exactly
one JSON object: {"reasoning": "...", "is_loop": true|false, "next_speaker": "user"|"model"}.""",
}

# Persona -> (extra tools taken in order, system text tokens at scale 1, doc offset).
SHAPES = {
    "cc": (12, 9500, 0),
    "qc": (9, 8500, 1),
    "explore": (0, 11000, 2),
    "review": (0, 6000, 3),
    "compact": (None, 0, 0),
    "check": (None, 0, 0),
}


def tool_schema(spec: ToolSpec) -> dict:
    name, description, params, required = spec
    properties = {key: {"type": kind, "description": text} for key, (kind, text) in
                  params.items()}
    for key, (kind, _) in params.items():
        if kind == "array":
            properties[key]["items"] = {"type": "object"}
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties,
                       "required": list(required)}}}


def scaled_count(n: int, scale: float, low: int) -> int:
    return max(low, min(n, round(n * scale)))


def tools_for(persona: str, scale: float) -> list[dict]:
    """Full tool lists at scale 1; a small scale keeps fewer (the schemas are a fixed cost
    that would otherwise dominate a tiny model's context), but always the read/grep core."""
    extras = SHAPES[persona][0]
    if extras is None:
        return []
    if persona == "explore":
        specs = [t for t in CORE_TOOLS if t[0] in READ_ONLY]
    elif persona == "review":
        specs = [t for t in CORE_TOOLS if t[0] in READ_ONLY[:5]] + [REPORT_FINDING]
    else:
        specs = CORE_TOOLS + EXTRA_TOOLS[:extras]
    keep = scaled_count(len(specs), scale, 1)
    # CORE_TOOLS starts with the tools the generated observations call (read_file, grep,
    # shell, edit_file, glob), so from scale ~0.6 on the list holds every call of the history;
    # below that some calls name tools no longer listed, which a server does not check.
    chosen = specs[:keep] if persona != "review" else specs[:max(0, keep - 1)] + [REPORT_FINDING]
    return [tool_schema(spec) for spec in chosen]


def system_prompt(persona: str, observer: Observer, scale: float) -> str:
    """Instructions then documentation, cut to the persona's size at this scale (a tiny scale
    cuts into the instructions too: the prompt's size matters more than its wording)."""
    _, tokens, offset = SHAPES[persona]
    text = INSTRUCTIONS[persona]
    if not tokens:
        return text
    target = max(48, int(tokens * scale))
    return (text + "\n\n" + observer.doc_text(target, offset))[:chars_for(target)]


def personas(observer: Observer, scale: float) -> dict[str, dict]:
    return {name: {"system": system_prompt(name, observer, scale),
                   "tools": tools_for(name, scale)} for name in SHAPES}
