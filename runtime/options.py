"""Every command-line option of `infernix` and `infernix-serve`, declared once.

Each `Option` carries its name, type, default, allowed values, help and the commands that take
it. `runtime.config` generates the argparse parsers, the TOML `--config` rules and the frozen
settings dataclasses from this table, so an option never exists in two places. An option whose
feature is not built yet is absent here, never accepted and ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

CLI = "cli"
SERVE = "serve"
BOTH = frozenset({CLI, SERVE})
CLI_ONLY = frozenset({CLI})
SERVE_ONLY = frozenset({SERVE})


@dataclass(frozen=True)
class Option:
    """One option.

    name: long name without the leading dashes (also its TOML key), e.g. "max-context".
    kind: int, float, str or bool (bool options are flags: present = True).
    default: value when neither the command line nor the config file gives it; None = unset.
    serve_default: default for `infernix-serve` when it differs from the CLI's.
    choices: allowed strings (for str options).
    minimum / maximum: inclusive numeric range (for int and float options).
    repeatable: the flag may be given several times; the value is a tuple.
    auto: the option also accepts the word "auto" (kept as the string "auto").
    """

    name: str
    kind: type
    default: object
    help: str
    commands: frozenset = BOTH
    group: str = "general"
    choices: tuple[str, ...] = ()
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    repeatable: bool = False
    auto: bool = False
    metavar: Optional[str] = None
    serve_default: object = None

    @property
    def attr(self) -> str:
        """Python attribute name in the settings dataclass."""
        return self.name.replace("-", "_")

    def default_for(self, command: str) -> object:
        if command == SERVE and self.serve_default is not None:
            return self.serve_default
        if self.repeatable and self.default is None:
            return ()
        return self.default

    def allowed(self) -> str:
        """Human description of the allowed values, used in error messages."""
        if self.kind is bool:
            return "true or false"
        if self.choices:
            return " | ".join(self.choices)
        parts = []
        if self.kind is int:
            parts.append("an integer")
        elif self.kind is float:
            parts.append("a finite number")
        else:
            parts.append("a string")
        if self.minimum is not None and self.maximum is not None:
            parts.append(f"in [{_fmt(self.minimum)}, {_fmt(self.maximum)}]")
        elif self.minimum is not None:
            parts.append(f">= {_fmt(self.minimum)}")
        elif self.maximum is not None:
            parts.append(f"<= {_fmt(self.maximum)}")
        if self.auto:
            parts.append('or "auto"')
        if self.repeatable:
            parts.append("(an array in a config file)")
        return " ".join(parts)


def _fmt(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")

OPTIONS: tuple[Option, ...] = (
    # --- model and device -------------------------------------------------------------------
    Option("config", str, None, "read options, and the model path, from a TOML file; the command "
           "line overrides it", group="general", metavar="FILE"),
    Option("demo", bool, False, "run on a generated tiny random-weight model (real Qwen "
           "vocabulary, CPU) when no model path is given", group="general"),
    Option("device", str, "auto", "cpu (NumPy reference backend), cuda, a CUDA device index, or "
           "auto (cuda when a GPU is present, else cpu)", group="general", metavar="DEV"),
    Option("synthetic-weights", int, None, "fill the weights with seeded random values on the "
           "GPU instead of reading them from the model (speed runs of real model sizes: the "
           "output is noise); needs --device cuda", group="general", minimum=0,
           maximum=(1 << 63) - 1, metavar="SEED"),
    Option("synthetic-shape", str, None, "with --synthetic-weights: run this model shape instead of "
           "MODEL's (qwen3.6-27b, or a JSON file of a text config); the tokenizer and template still "
           "come from MODEL, whose vocabulary size must match", group="general", metavar="SHAPE"),
    Option("chat-template", str, None, "use a local Jinja chat template instead of the "
           "artifact's", group="general", metavar="FILE"),
    Option("log-level", str, "info", "stderr log verbosity", group="general",
           choices=("debug", "info", "warning", "error")),
    Option("log-colours", str, None, "colour the statistics output on stderr "
           "(default: on when stderr is a terminal)", group="general", choices=("on", "off")),
    # --- capacity ---------------------------------------------------------------------------
    Option("max-context", int, 2048, "per-sequence context ceiling in tokens", group="capacity",
           minimum=64, maximum=262144, serve_default=8192),
    Option("kv-capacity", int, None, "shared KV pool size in tokens (rounded up to 64-token "
           "pages) (default: --max-context, times --max-concurrency for the server)",
           group="capacity", minimum=64, maximum=1 << 24, auto=True),
    Option("kv-dtype", str, "bf16", "KV-cache storage format: bf16, or fp8 (e4m3) / int8 codes with "
           "an fp32 scale per token and KV head (about half the bytes; CUDA backend only)",
           group="capacity", choices=("bf16", "fp8", "int8")),
    Option("prefill-chunk", int, 2048, "prompt tokens computed per prefill step, a multiple of "
           "64", group="capacity", minimum=64, maximum=65536),
    Option("max-new", int, 128, "output-token limit per request (CLI) / default when a request "
           "gives none (server)", group="capacity", minimum=1, maximum=262144, serve_default=4096),
    Option("no-cuda-graph", bool, False, "disable CUDA-graph decode", group="capacity"),
    # --- media --------------------------------------------------------------------------------
    Option("vision", bool, False, "load the model's vision tower and accept image and video "
           "input", group="media"),
    Option("vision-max-merged", int, None, "most merged vision tokens per image; larger images "
           "are downscaled in preprocessing", group="media", minimum=64, maximum=32768,
           metavar="N"),
    Option("allow-remote-media", bool, False, "fetch HTTP(S) image URLs (32 MiB, 10 s per "
           "connect/read); off: only paths and data URIs", group="media"),
    # --- speculative decoding ---------------------------------------------------------------
    Option("spec", str, "off", "speculative decoding: mtp drafts with the model's MTP head "
           "(its weights load only then); every round is verified, so the output equals plain "
           "decoding", group="speculative", choices=("off", "mtp")),
    Option("draft-tokens", int, None, "MTP drafts per round (default 3), or auto: each round "
           "the count, up to 5, that the request's measured acceptance makes fastest; needs "
           "--spec mtp", group="speculative", minimum=1, maximum=5, auto=True),
    Option("mtp-draft-vocab", int, None, "MTP drafts over the first N token ids only (the "
           "lm_head's first N rows: a draft costs less; 32768 recommended for Qwen's 248K "
           "vocabulary, see docs/serving.md); the output is unchanged, only acceptance can fall; "
           "default: the whole vocabulary; needs --spec mtp", group="speculative", minimum=1,
           maximum=1 << 20, metavar="N"),
    Option("ngram-draft-tokens", int, 0, "most n-gram copy drafts per round, from the "
           "request's own prompt and output (0: off); beside --spec mtp the longer proposal "
           "is verified", group="speculative", minimum=0, maximum=63),
    Option("ngram-min-match", int, 12, "tokens that must match before an n-gram copy is "
           "proposed", group="speculative", minimum=4, maximum=64),
    # --- input (CLI) ------------------------------------------------------------------------
    Option("prompt", str, None, "the user message (exactly one of --prompt and --messages)",
           commands=CLI_ONLY, group="input", metavar="TEXT"),
    Option("messages", str, None, "a JSON file: a message array, or an object with messages "
           "and tools", commands=CLI_ONLY, group="input", metavar="FILE"),
    Option("raw-output", bool, False, "print the raw generated text (special markers "
           "included) instead of the parsed answer", commands=CLI_ONLY, group="output"),
    Option("print-token-ids", bool, False, "print the generated token ids in the report",
           commands=CLI_ONLY, group="output"),
    # --- thinking ---------------------------------------------------------------------------
    Option("no-thinking", bool, False, "disable thinking", group="thinking"),
    Option("reasoning-effort", str, None, "effort value passed to the chat template "
           "(none = no thinking)", group="thinking", choices=EFFORTS),
    Option("thinking-budget", int, None, "most model-origin thinking tokens; then the canonical "
           "close span is inserted", group="thinking", minimum=1, maximum=1 << 20),
    Option("reasoning-loop", str, "off", "end the reply (stop) or close the thinking "
           "(conclude) when the thinking keeps repeating whole passages", group="thinking",
           choices=("off", "stop", "conclude")),
    Option("preserve-thinking", bool, False, "keep the reasoning of earlier assistant turns in "
           "the prompt", commands=SERVE_ONLY, group="thinking"),
    Option("tolerant-tool-calls", bool, False, "recover malformed tool calls instead of "
           "returning them as text", group="thinking"),
    # --- sampling ---------------------------------------------------------------------------
    Option("greedy", bool, False, "exact argmax decoding", group="sampling"),
    Option("temperature", float, None, "sampling temperature (default: model/mode preset)",
           group="sampling", minimum=0.0, maximum=2.0),
    Option("top-p", float, None, "nucleus threshold (default: preset)", group="sampling",
           minimum=0.0, maximum=1.0),
    Option("top-k", int, None, "top-k threshold; 0 selects the top-20 cap (default: preset)",
           group="sampling", minimum=0, maximum=20),
    Option("min-p", float, None, "min-p threshold (default: preset)", group="sampling",
           minimum=0.0, maximum=1.0),
    Option("presence-penalty", float, None, "presence penalty (default: preset; 0 with an "
           "output constraint)", group="sampling", minimum=-2.0, maximum=2.0),
    Option("frequency-penalty", float, None, "frequency penalty (default: preset, 0)",
           group="sampling", minimum=-2.0, maximum=2.0),
    Option("seed", int, 0, "sampling seed (server: default seed of requests that give none)",
           group="sampling", minimum=0, maximum=(1 << 63) - 1),
    # --- stops ------------------------------------------------------------------------------
    Option("stop", str, None, "stop string (repeatable)", group="stops", repeatable=True,
           metavar="TEXT"),
    Option("stop-token-id", int, None, "stop token id (repeatable)", group="stops",
           repeatable=True, minimum=0, metavar="ID"),
    Option("reasoning-stop", str, None, "stop string applied only inside reasoning "
           "(repeatable)", group="stops", repeatable=True, metavar="TEXT"),
    # --- output constraints (CLI) -----------------------------------------------------------
    Option("json-object", bool, False, "constrain the answer to a JSON object",
           commands=CLI_ONLY, group="constraints"),
    Option("json-schema-file", str, None, "constrain the answer to a JSON Schema",
           commands=CLI_ONLY, group="constraints", metavar="FILE"),
    Option("grammar-file", str, None, "constrain the answer to a GBNF grammar (entry rule "
           "root)", commands=CLI_ONLY, group="constraints", metavar="FILE"),
    Option("regex", str, None, "constrain the whole answer to a regular expression",
           commands=CLI_ONLY, group="constraints", metavar="PATTERN"),
    Option("choice", str, None, "constrain the answer to one of these exact texts "
           "(repeatable)", commands=CLI_ONLY, group="constraints", repeatable=True,
           metavar="TEXT"),
    # --- server -----------------------------------------------------------------------------
    Option("host", str, "127.0.0.1", "address to listen on", commands=SERVE_ONLY,
           group="network"),
    Option("port", int, 8080, "TCP port", commands=SERVE_ONLY, group="network", minimum=0,
           maximum=65535),
    Option("api-key", str, None, "require this key (Authorization: Bearer or x-api-key); "
           "/health stays open", commands=SERVE_ONLY, group="network", metavar="KEY"),
    Option("model-id", str, None, "model name reported by /v1/models (default: the "
           "artifact's file name)", commands=SERVE_ONLY, group="network"),
    Option("max-concurrency", int, 1, "sequences decoded together (lanes)",
           commands=SERVE_ONLY, group="capacity", minimum=1, maximum=8),
    Option("max-pending-requests", int, 16, "requests waiting for a lane before 503",
           commands=SERVE_ONLY, group="capacity", minimum=0, maximum=4096),
    Option("max-http-clients", int, 64, "open client connections", commands=SERVE_ONLY,
           group="network", minimum=1, maximum=65536),
    Option("max-request-mib", int, 64, "request body size limit in MiB", commands=SERVE_ONLY,
           group="network", minimum=1, maximum=1024),
    # --- prefix cache (server) --------------------------------------------------------------
    Option("no-prefix-cache", bool, False, "do not reuse cached prompt prefixes (a paused "
           "request still keeps its state in the host tier)", commands=SERVE_ONLY,
           group="prefix cache"),
    Option("device-snapshot-slots", int, 8, "recurrent-state snapshots the prefix cache keeps "
           "on the device (one slot each, beyond the lanes)", commands=SERVE_ONLY,
           group="prefix cache", minimum=0, maximum=1024),
    Option("host-context-mib", int, 8192, "host memory for snapshots and KV blocks demoted "
           "from the device and for paused requests", commands=SERVE_ONLY,
           group="prefix cache", minimum=0, maximum=1 << 22),
    Option("snapshot-interval", int, 8192, "snapshot long prompts every N tokens (prefill "
           "chunks end there), a multiple of 64; 0 = only at the turn starts the server hints",
           commands=SERVE_ONLY, group="prefix cache", minimum=0, maximum=1 << 20),
    Option("prefix-cache-file", str, None, "keep the prefix cache in FILE across restarts "
           "(read at start, written at shutdown)", commands=SERVE_ONLY, group="prefix cache",
           metavar="FILE"),
    Option("prefix-cache-save-mins", int, 0, "also write --prefix-cache-file every N minutes "
           "(0 = only at shutdown)", commands=SERVE_ONLY, group="prefix cache", minimum=0,
           maximum=10080),
    Option("ssd-context-gib", int, 0, "disk tier: keep up to N GiB of the snapshots and KV "
           "blocks the host tier gives up in --ssd-context-dir (0 = off)", commands=SERVE_ONLY,
           group="prefix cache", minimum=0, maximum=1 << 16),
    Option("ssd-context-dir", str, None, "directory of the disk tier's files (needed with "
           "--ssd-context-gib; the *.ixc files in it are removed at start)",
           commands=SERVE_ONLY, group="prefix cache", metavar="DIR"),
    Option("ssd-context-gib-per-hour", int, 8, "disk tier write budget: at most N GiB written "
           "in any hour (SSD wear); a write beyond it is dropped", commands=SERVE_ONLY,
           group="prefix cache", minimum=1, maximum=1 << 12),
    Option("request-log", str, None, "append one JSON line per finished request to FILE",
           commands=SERVE_ONLY, group="logging", metavar="FILE"),
)

OPTIONS_BY_NAME: dict[str, Option] = {option.name: option for option in OPTIONS}
