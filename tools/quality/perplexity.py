"""Causal perplexity of a UTF-8 text under a model, with sliding windows.

    python -m tools.quality.perplexity MODEL.infernix TEXT_FILE [--context N] [--stride S]
        [--device cpu|cuda] [--prefill-chunk N] [--synthetic-weights SEED] [--quiet]

The text is tokenized with the model's tokenizer as plain text (a spelled-out special token such
as `<|im_end|>` stays text) and nothing is prepended, so the first token is never scored.
Windows of `--context` tokens start every `--stride` tokens. Each window scores the tokens no
earlier window scored, each one conditioned on the window's tokens before it (at most
context - 1 of them); with stride == context the windows are disjoint and the first token of each
has nothing before it in its window, so it is not scored (the report counts what was). Every
window is a fresh sequence on the runner (slot 0, positions from 0) computed in prefill chunks
of `--prefill-chunk` tokens, so memory stays bounded by one chunk's logits (chunk x vocabulary
x 4 bytes). The negative log-likelihood of each target comes from a float64 log-softmax of the
logits at the position before it, over the whole (padded) vocabulary; the perplexity is
exp(sum of NLL / tokens scored).

Report on stdout; progress on stderr (`--quiet`: none). Exit codes: 0 success; 2 an option or
input mistake (one line `perplexity: error: ...`); 1 the model failed to load or to run.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, TextIO

import numpy as np

from runtime.engine.kv_pages import pages_for
from runtime.log import Progress
from runtime.model.config import ModelConfig
from runtime.model.runner import PAGE_SIZE, PrefillChunk
from runtime.options import OPTIONS_BY_NAME

PROGRAM = "perplexity"
EXIT_USAGE = 2
EXIT_FAILED = 1
# The engine's defaults (runtime/options.py), so the tool computes windows the way a request is.
DEFAULT_CONTEXT = OPTIONS_BY_NAME["max-context"].default
DEFAULT_PREFILL_CHUNK = OPTIONS_BY_NAME["prefill-chunk"].default
# Logit rows per float64 log-softmax: 64 x 248,320 x 8 bytes = 127 MB at the real vocabulary.
SOFTMAX_ROWS = 64
CUDA_NOTE = ("on cuda the BF16 kernels make the value differ slightly from --device cpu "
             "(the float32 NumPy reference)")


class UsageError(Exception):
    """An option or input mistake; the message is one complete line (exit code 2)."""


@dataclass(frozen=True)
class Window:
    """Input positions begin .. end - 1 of the text; targets score_from .. end - 1 are scored,
    target t from the logits at position t - 1."""

    begin: int
    end: int
    score_from: int

    @property
    def num_scored(self) -> int:
        return self.end - self.score_from


@dataclass(frozen=True)
class Score:
    """What `score` measured: the NLL summed over `tokens_scored` targets (nats)."""

    total_nll: float
    tokens_scored: int
    windows: int

    @property
    def mean_nll(self) -> float:
        return self.total_nll / self.tokens_scored

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)


def plan_windows(num_tokens: int, context: int, stride: int) -> list[Window]:
    """The windows over a text of `num_tokens` tokens (module docstring), in order."""
    if num_tokens < 2 or context < 2 or not 1 <= stride <= context:
        raise ValueError(f"need >= 2 tokens, context >= 2 and 1 <= stride <= context; got "
                         f"{num_tokens} tokens, context {context}, stride {stride}")
    windows = []
    scored_to = 1                       # the first token has no context: never a target
    begin = 0
    while True:
        end = min(begin + context, num_tokens)
        score_from = max(scored_to, begin + 1)
        if score_from < end:            # stride == context can leave a last window of one token
            windows.append(Window(begin, end, score_from))
        if end == num_tokens:
            return windows
        scored_to = end
        begin += stride


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits[i])[targets[i]] per row, in float64 (rows in blocks of SOFTMAX_ROWS
    so the float64 copy of a chunk's logits stays small)."""
    out = np.empty(len(targets), dtype=np.float64)
    for lo in range(0, len(targets), SOFTMAX_ROWS):
        x = logits[lo:lo + SOFTMAX_ROWS].astype(np.float64)
        peak = x.max(axis=1, keepdims=True)
        log_sum = peak[:, 0] + np.log(np.exp(x - peak).sum(axis=1))
        out[lo:lo + len(x)] = log_sum - x[np.arange(len(x)), targets[lo:lo + len(x)]]
    return out


def score(runner: Any, tokens: Sequence[int], *, context: int, stride: int, prefill_chunk: int,
          progress: Optional[Progress] = None) -> Score:
    """Sum the NLL of the text's tokens under `runner` (a ModelRunner with at least one slot and
    pages_for(context) pages), window by window and chunk by chunk."""
    tokens = np.asarray(tokens, dtype=np.int64)
    windows = plan_windows(len(tokens), context, stride)
    page_table = list(range(pages_for(context)))
    total_nll = 0.0
    for window in windows:
        runner.reset_slot(0)            # every window is a sequence of its own
        for lo in range(window.begin, window.end, prefill_chunk):
            hi = min(lo + prefill_chunk, window.end)
            # Positions lo .. hi - 1 predict targets lo + 1 .. hi; keep those the window scores.
            first, stop = max(lo + 1, window.score_from), min(hi + 1, window.end)
            wanted = stop > first
            logits = runner.prefill(PrefillChunk(slot=0, token_ids=tokens[lo:hi],
                                                 start_pos=lo - window.begin,
                                                 page_table=page_table, all_logits=wanted))
            if not wanted:
                continue
            nll = token_nll(logits[first - 1 - lo:stop - 1 - lo], tokens[first:stop])
            total_nll += float(nll.sum())
            if progress is not None:
                progress.advance(stop - first)
    return Score(total_nll=total_nll, tokens_scored=sum(w.num_scored for w in windows),
                 windows=len(windows))


# --- command line -----------------------------------------------------------------------------

def read_text(path: Path) -> str:
    """The file's text, or a UsageError naming the file and what is wrong with it."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if not data:
        raise UsageError(f"{path}: the file is empty")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                         f"{exc.start})") from None


def check_options(args: argparse.Namespace) -> None:
    """Option mistakes that need no model (the model's own limit is checked once it is open)."""
    if args.context is not None and args.context < 2:
        raise UsageError(f"--context {args.context}: a window needs at least 2 tokens")
    if args.stride is not None and args.stride < 1:
        raise UsageError(f"--stride {args.stride}: must be at least 1")
    if args.prefill_chunk < PAGE_SIZE or args.prefill_chunk % PAGE_SIZE:
        raise UsageError(f"--prefill-chunk {args.prefill_chunk}: must be a positive multiple "
                         f"of {PAGE_SIZE}")
    if args.synthetic_weights is not None and args.device != "cuda":
        raise UsageError("--synthetic-weights fills weights on the GPU; needs --device cuda")


def window_sizes(args: argparse.Namespace, model_max: int) -> tuple[int, int]:
    """(context, stride): the given ones, checked against the model, or the defaults
    (the engine's --max-context default or the model's maximum if smaller; half a window)."""
    context = args.context if args.context is not None else min(DEFAULT_CONTEXT, model_max)
    if context > model_max:
        raise UsageError(f"--context {context} exceeds the model's maximum context of "
                         f"{model_max} tokens")
    stride = args.stride if args.stride is not None else context // 2
    if stride > context:
        raise UsageError(f"--stride {stride} exceeds --context {context}: the tokens between "
                         "windows would never be scored")
    return context, stride


def make_runner(device: str, artifact: Any, *, context: int, prefill_chunk: int,
                synthetic_seed: Optional[int]) -> Any:
    """A one-slot runner whose page pool holds one window."""
    num_pages = pages_for(context)
    if device == "cpu":
        from runtime.model.numpy_runner import NumpyRunner

        # float32, like the engine's CPU backend (runtime/session/backend.py).
        return NumpyRunner.from_artifact(artifact, num_pages=num_pages, num_slots=1,
                                         dtype=np.float32)
    # The CUDA runner is built as runtime/session/backend.py builds it (same module, same shape
    # arguments); imported here so the CPU path never loads cuda-python.
    from runtime.config import ConfigError
    from runtime.session import CUDA_RUNNER_MODULE, choose_device

    try:
        choose_device("cuda")
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    try:
        module = importlib.import_module(CUDA_RUNNER_MODULE)
    except ImportError as exc:
        raise UsageError(f"--device cuda: the CUDA runner cannot be imported ({exc})") from None
    # One sequence and no decode: batch 1 and no CUDA graphs (graphs only serve decode steps).
    shape = {"num_pages": num_pages, "num_slots": 1, "max_batch": 1,
             "prefill_chunk": prefill_chunk, "max_context": context, "cuda_graphs": False}
    try:
        if synthetic_seed is not None:
            config = ModelConfig.from_dict(artifact.component("text").config)
            return module.CudaRunner.synthetic(config, synthetic_seed, **shape)
        return module.CudaRunner.from_artifact(artifact, **shape)
    except NotImplementedError as exc:      # a model the CUDA runner cannot run yet
        raise UsageError(f"--device cuda: {exc}; --device cpu runs it on the NumPy "
                         "reference") from None


def report(out: TextIO, *, model: Path, text_file: Path, device: str, num_tokens: int,
           context: int, stride: int, result: Score, seconds: float, load_seconds: float) -> None:
    rate = result.tokens_scored / seconds if seconds > 0 else float("inf")
    lines = [
        f"model          {model} ({device})",
        f"text           {text_file} ({num_tokens} tokens)",
        f"windows        {result.windows} (context {context}, stride {stride})",
        f"tokens scored  {result.tokens_scored}",
        f"mean NLL       {result.mean_nll:.9f} nats/token",
        f"perplexity     {result.perplexity:.6f}",
        f"wall time      {seconds:.2f} s scoring ({rate:.1f} tokens/s), "
        f"{load_seconds:.2f} s loading",
    ]
    if device == "cuda":
        lines.append(f"note           {CUDA_NOTE}")
    out.write("\n".join(lines) + "\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tools.quality.perplexity",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="a .infernix model")
    parser.add_argument("text_file", type=Path, help="the UTF-8 text to score")
    parser.add_argument("--context", type=int, metavar="N",
                        help=f"window length in tokens (default {DEFAULT_CONTEXT}, or the "
                             "model's maximum if smaller)")
    parser.add_argument("--stride", type=int, metavar="S",
                        help="tokens between window starts, at most --context (default half "
                             "the window)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: the NumPy reference (default); cuda: the CUDA runner")
    parser.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, metavar="N",
                        help=f"tokens computed per runner call, a multiple of {PAGE_SIZE} "
                             f"(default {DEFAULT_PREFILL_CHUNK}, the engine's)")
    parser.add_argument("--synthetic-weights", type=int, metavar="SEED",
                        help="seeded random weights filled on the GPU (--device cuda; times a "
                             "model shape, the value is noise)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return parser


def main(argv: Optional[Sequence[str]] = None, *, stdout: Optional[TextIO] = None,
         stderr: Optional[TextIO] = None) -> int:
    stdout = stdout if stdout is not None else sys.stdout
    stderr = stderr if stderr is not None else sys.stderr
    args = build_parser().parse_args(argv)   # argparse itself exits with 2 on a malformed option
    try:
        check_options(args)
        text = read_text(args.text_file)     # before loading: a bad file fails in milliseconds
        if not args.model.is_file():
            raise UsageError(f"{args.model}: no such model file")
    except UsageError as exc:
        print(f"{PROGRAM}: error: {exc}", file=stderr)
        return EXIT_USAGE

    from runtime.artifact import open_artifact
    from runtime.text.tokenizer import Tokenizer

    started = time.perf_counter()
    try:
        artifact = open_artifact(args.model)
    except Exception as exc:  # noqa: BLE001 - any artifact error ends the run with its message
        print(f"{PROGRAM}: error: cannot load the model: {exc}", file=stderr)
        return EXIT_FAILED
    runner = None
    try:
        component = artifact.component("text")
        tokenizer = Tokenizer.from_artifact_resources(component.resources)
        tokens = tokenizer.encode(text, parse_special=False)
        if len(tokens) < 2:
            plural = "" if len(tokens) == 1 else "s"
            raise UsageError(f"{args.text_file}: {len(tokens)} token{plural} after tokenizing; "
                             "perplexity needs at least 2")
        model_max = ModelConfig.from_dict(component.config).max_position_embeddings
        context, stride = window_sizes(args, model_max)
        runner = make_runner(args.device, artifact, context=context,
                             prefill_chunk=args.prefill_chunk,
                             synthetic_seed=args.synthetic_weights)
        load_seconds = time.perf_counter() - started
        progress = None if args.quiet else Progress(
            "scoring", sum(w.num_scored for w in plan_windows(len(tokens), context, stride)),
            unit="tokens", stream=stderr)
        started = time.perf_counter()
        result = score(runner, tokens, context=context, stride=stride,
                       prefill_chunk=args.prefill_chunk, progress=progress)
        seconds = time.perf_counter() - started
        if progress is not None:
            progress.close()
    except UsageError as exc:
        print(f"{PROGRAM}: error: {exc}", file=stderr)
        return EXIT_USAGE
    except Exception as exc:  # noqa: BLE001 - model, tokenizer and runner errors: one line
        print(f"{PROGRAM}: error: {type(exc).__name__}: {exc}", file=stderr)
        return EXIT_FAILED
    finally:
        if runner is not None and args.device == "cuda":
            runner.close()                   # device memory goes back before the report
        artifact.close()
    report(stdout, model=args.model, text_file=args.text_file, device=args.device,
           num_tokens=len(tokens), context=context, stride=stride, result=result,
           seconds=seconds, load_seconds=load_seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
