"""Per-token cost of output constraints (llguidance) on the real Qwen3.5/3.6 vocabulary
(248,077 tokens padded to 248,320).

    python -m bench.constraints [--repeat R] [--batch B] [--device-step-ms MS] [--compare-copies]

For each mode, a realistic valid answer is encoded with the real tokenizer and replayed token by
token through a fresh `RequestConstraint` (as one request sees it): fill the packed mask into a
preallocated row, then commit the token. Reported per mode: `compile()` the first time
(translation, validation, matcher) and again (a cache hit still builds the request's own
matcher), mask time per token (mean / p50 / p99 / max, microseconds) for the first replay and
the mean / max over later replays, commit time, and the extra cost of the bool form
(`allowed_mask`) the NumPy runner uses. Single-matcher timings are thread CPU time, so load from
other processes on a shared machine does not inflate them.

Overlap: the engine starts step t's masks on its mask worker thread, runs the model step
meanwhile, then masks the logits. Masks stay hidden while a step's fill takes less than the
device step. The engine section measures exactly that: the real `Engine` drives a stand-in
runner whose steps wait --device-step-ms with the GIL released (as a GPU step's synchronisation
does), once unconstrained and once per constraint mode, and reports how much of the mask time
the step hid. The batch section fills B masks per step with `ConstraintCompiler.fill_bitmasks`
(llguidance's thread pool, GIL released) and reports wall time per step against
--device-step-ms, plus how much of a GIL-holding Python loop on the main thread still ran
during the fill (100% = the fill never blocked the interpreter).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import threading
import time

import llguidance
import numpy as np

from runtime.engine.api import EngineRequest, SamplingParams
from runtime.engine.engine_loop import Engine, EngineConfig
from runtime.model.runner import DecodeItem, PrefillChunk
from runtime.text.constraints import ConstraintSpec, llguidance_grammar
from runtime.text.constraints_compiler import ConstraintCompiler
from runtime.text.constraints_tools import json_or_tool_calls_spec, tool_call_spec
from tools.tokenizer_json import build_qwen_tokenizer_json

VOCAB = 248320
IM_END = 248046

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "format": "uuid"},
        "name": {"type": "string", "minLength": 1, "maxLength": 80},
        "email": {"type": "string", "format": "email"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "score": {"type": "number"},
        "created": {"type": "string", "format": "date-time"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city"]},
        "manager": {"anyOf": [{"type": "null"}, {"type": "string"}]},
        "active": {"type": "boolean"},
    },
    "required": ["id", "name", "role"],
    "additionalProperties": False,
}
SCHEMA_ANSWER = json.dumps({
    "id": "4f9c2b1e-8d3a-4c7b-9e2f-1a2b3c4d5e6f", "name": "Ada Lovelace",
    "email": "ada@example.org", "age": 36, "role": "admin", "score": 97.5,
    "created": "2024-03-15T09:30:00Z", "tags": ["math", "engines", "poetry"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "12345"},
    "manager": None, "active": True}, separators=(",", ":"))

ANY_OBJECT = json.dumps({
    "project": "infernix", "version": [0, 1, 0], "owners": [
        {"name": "Grace", "langs": ["python", "cuda"], "active": True, "stats": {
            "commits": 1234, "reviews": {"approved": 87, "changes": 12, "detail": {
                "median_hours": 3.5, "p90_hours": 20.25, "tags": ["fast", "careful"]}}}},
        {"name": "Linus", "langs": ["c", "rust"], "active": False, "stats": {
            "commits": 98, "reviews": {"approved": 5, "changes": 1, "detail": None}}}],
    "notes": "Constraints are compiled once per request and cached per spec; "
             "masks are filled while the GPU runs the step.",
    "limits": {"max_new": 4096, "temperature": 0.6, "top_p": 0.95, "stop": ["</answer>"]},
}, separators=(",", ":"))

GBNF = r"""
root    ::= list
list    ::= "[" ws ( item ( "," ws item )* )? ws "]"
item    ::= list | number | word
number  ::= "-"? [0-9]+ ( "." [0-9]+ )?
word    ::= [a-zA-Zα-ω]+
ws      ::= [ \t\n]*
"""
GBNF_ANSWER = "[alpha, [1, 2.5, -3], [beta, [gamma, δελτα, [42]]], 7, [x, y, z], [[[]]]]"

TOOLS = [
    {"type": "function", "function": {"name": "write_file", "strict": True, "parameters": {
        "type": "object", "properties": {
            "path": {"type": "string"}, "content": {"type": "string"},
            "overwrite": {"type": "boolean"}}, "required": ["path", "content"]}}},
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}}}}},
]
FILE = ("import re\nfrom datetime import datetime, timezone\n\n\ndef parse_date(text: str) -> "
        "datetime:\n    \"\"\"Parse ISO dates; '<b>' & </parameter> inside a line are fine.\"\"\"\n"
        "    value = datetime.fromisoformat(text.strip())\n    return value.astimezone("
        "timezone.utc)\n")
TOOL_ANSWER = ("<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/dates.py\n</parameter>\n"
               f"<parameter=content>\n{FILE}\n</parameter>\n<parameter=overwrite>\ntrue\n"
               "</parameter>\n</function>\n</tool_call>")


def workloads() -> dict[str, tuple[ConstraintSpec, str]]:
    return {
        "json_object (nested, depth 5)": (ConstraintSpec.json_object(), ANY_OBJECT),
        "json_schema (11 props, formats)": (ConstraintSpec.json_schema(SCHEMA), SCHEMA_ANSWER),
        "regex (date-time)": (ConstraintSpec.regex(
            r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}(:[0-9]{2}(\.[0-9]{1,6})?)?"
            r"(Z|[+-][0-9]{2}:[0-9]{2})"), "2024-03-15T09:30:00.125+05:30"),
        "choice (3 texts)": (ConstraintSpec.choice(["positive", "neutral", "negative"]),
                             "negative"),
        "grammar (GBNF, recursive)": (ConstraintSpec.grammar(GBNF), GBNF_ANSWER),
        "tool call (required, code value)": (tool_call_spec(TOOLS, required=True), TOOL_ANSWER),
        "json or tool calls": (json_or_tool_calls_spec(ConstraintSpec.json_schema(SCHEMA), TOOLS),
                               TOOL_ANSWER),
    }


def _stats(values_s: list[float]) -> str:
    us = np.array(values_s) * 1e6
    return (f"{us.mean():7.1f} {np.percentile(us, 50):7.1f} {np.percentile(us, 99):8.1f} "
            f"{us.max():8.1f}")


def replay(compiler: ConstraintCompiler, spec: ConstraintSpec, ids: list[int]):
    """One request's replay: per-token mask and commit thread-CPU times."""
    constraint = compiler.compile(spec)
    row = np.empty((VOCAB + 31) // 32, dtype=np.uint32)
    clock = time.thread_time
    masks, commits = [], []
    for token in ids:
        start = clock()
        constraint.fill_bitmask(row)
        masks.append(clock() - start)
        assert (int(row[token // 32]) >> (token % 32)) & 1, "answer token not allowed"
        start = clock()
        constraint.commit(token)
        commits.append(clock() - start)
    assert constraint.is_accepting()
    return masks, commits


def bool_overhead(compiler: ConstraintCompiler, spec: ConstraintSpec, ids: list[int]) -> float:
    """Extra time per token of the bool [vocab] form over the packed one (same state)."""
    constraint = compiler.compile(spec)
    extra = []
    for token in ids:
        constraint.allowed_bitmask_u32(VOCAB)
        start = time.thread_time()
        constraint.allowed_mask(VOCAB)
        extra.append(time.thread_time() - start)
        constraint.commit(token)
    return float(np.mean(extra))


def busy_python(seconds: float) -> int:
    """A GIL-holding loop; returns iterations done."""
    end = time.perf_counter() + seconds
    count = 0
    while time.perf_counter() < end:
        count += 1
    return count


def copies_section(compiler, specs_ids, batch: int) -> None:
    """Why every request builds its own matcher: deep copies of one matcher share llguidance's
    lexer state behind a lock, so their batched fill runs one matcher at a time."""
    print(f"\nbatched fill of {batch}: own matchers vs deep copies of one (wall ms per step)")
    words = (VOCAB + 31) // 32
    out = np.empty((batch, words), dtype=np.int32)
    executor = llguidance.LLExecutor()
    for name, (spec, ids) in specs_ids.items():
        grammar = llguidance_grammar(spec, compiler.special_token_id)
        template = llguidance.LLMatcher(compiler.tokenizer, grammar, log_level=0)
        results = []
        for matchers in ([llguidance.LLMatcher(compiler.tokenizer, grammar, log_level=0)
                          for _ in range(batch)], [template.deep_copy() for _ in range(batch)]):
            steps = []
            for token in ids:
                start = time.perf_counter()
                executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)],
                                                 out.ctypes.data, words * 4, batch)
                steps.append(time.perf_counter() - start)
                for matcher in matchers:
                    matcher.consume_token(token)
            results.append(f"mean {np.mean(steps) * 1e3:6.2f} max {np.max(steps) * 1e3:7.2f}")
        print(f"{name:34s} own: {results[0]} | copies: {results[1]}")


def batch_section(compiler, specs_ids, batch: int, device_step_ms: float) -> None:
    print(f"\nbatched fill: {batch} requests per step (LLExecutor), wall time per step")
    print(f"{'mode':34s} {'mean ms':>8s} {'p99 ms':>8s} {'max ms':>8s} {'> step':>7s} "
          f"{'py loop ran':>11s}")
    words = (VOCAB + 31) // 32
    out = np.empty((batch, words), dtype=np.uint32)
    loop_s = 2e-3
    baseline = busy_python(loop_s)
    for name, (spec, ids) in specs_ids.items():
        constraints = [compiler.compile(spec) for _ in range(batch)]
        rows = [(constraint, index) for index, constraint in enumerate(constraints)]
        steps, ratios = [], []
        for position, token in enumerate(ids):
            done = threading.Event()
            elapsed = []

            def fill():
                start = time.perf_counter()
                compiler.fill_bitmasks(rows, out)
                elapsed.append(time.perf_counter() - start)
                done.set()

            worker = threading.Thread(target=fill)
            worker.start()
            probe = position % 4 == 3  # every 4th step: does the fill let Python run?
            if probe:
                ratios.append(busy_python(min(loop_s, 1e-3)) / max(1, baseline / 2))
            done.wait()
            worker.join()
            if not probe:  # probed steps compete for the GIL; time the others
                steps.append(elapsed[0])
            for constraint in constraints:
                constraint.commit(token)
        ms = np.array(steps) * 1e3
        over = (ms > device_step_ms).mean() * 100
        print(f"{name:34s} {ms.mean():8.2f} {np.percentile(ms, 99):8.2f} {ms.max():8.2f} "
              f"{over:6.1f}% " + (f"{min(1.0, float(np.median(ratios))) * 100:10.0f}%"
                                   if ratios else f"{'n/a':>11s}"))


class WaitingRunner:
    """A ModelRunner stand-in: every call takes `step_s` of wall time without holding the GIL
    (like waiting on a GPU step) and returns flat logits, so greedy picks the lowest allowed id."""

    samples_on_device = False

    def __init__(self, step_s: float):
        self.vocab_size, self.num_pages, self.num_slots = VOCAB, 64, 1
        self.step_s = step_s
        self.logits = np.zeros((1, VOCAB), dtype=np.float32)

    def reset_slot(self, slot: int) -> None:
        pass

    def copy_slot(self, src: int, dst: int) -> None:
        pass

    def prefill(self, chunk: PrefillChunk) -> np.ndarray:
        time.sleep(self.step_s)
        return self.logits

    def decode(self, items: list[DecodeItem]) -> np.ndarray:
        time.sleep(self.step_s)
        return self.logits


def engine_step_ms(runner: WaitingRunner, constraint, tokens: int) -> float:
    """Mean wall time per decode step of one greedy request through the real engine."""
    with Engine(runner, EngineConfig(max_context=4096, prefill_chunk=64)) as engine:
        stream = engine.submit(EngineRequest(
            request_id="bench", prompt_ids=(1, 2, 3), sampling=SamplingParams(greedy=True),
            max_new_tokens=tokens, constraint=constraint))
        final = list(stream)[-1]
    return final.stats.decode_s / max(1, final.stats.output_tokens - 1) * 1e3


def engine_section(compiler, specs_ids, device_step_ms: float, tokens: int = 48) -> None:
    print(f"\nengine overlap: one request, stand-in device step {device_step_ms:.1f} ms, "
          f"{tokens} tokens (wall ms per decode step)")
    runner = WaitingRunner(device_step_ms / 1e3)
    plain = engine_step_ms(runner, None, tokens)
    print(f"{'unconstrained':34s} {plain:7.2f}")
    for name, (spec, ids) in specs_ids.items():
        masks, _ = replay(compiler, spec, ids)
        # The engine asks for the bool form: the packed fill plus its unpacking.
        mask_ms = (float(np.mean(masks)) + bool_overhead(compiler, spec, ids)) * 1e3
        step = engine_step_ms(runner, compiler.compile(spec), tokens)
        added = step - plain
        hidden = 1.0 - added / mask_ms if mask_ms > 0 else 1.0
        print(f"{name:34s} {step:7.2f}  (+{added:5.2f} ms; mask alone {mask_ms:5.2f} ms; "
              f"hidden {max(0.0, min(1.0, hidden)) * 100:3.0f}%)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3,
                        help="replays per mode, each a new request")
    parser.add_argument("--batch", type=int, default=16, help="requests per batched fill")
    parser.add_argument("--device-step-ms", type=float, default=10.0,
                        help="device step time the batched fill is compared against")
    parser.add_argument("--compare-copies", action="store_true",
                        help="also time batched fills of deep copies of one matcher")
    args = parser.parse_args(argv)

    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"python {platform.python_version()}")
    tokenizer_json = build_qwen_tokenizer_json()
    start = time.perf_counter()
    compiler = ConstraintCompiler(tokenizer_json, vocab_size=VOCAB, eos_ids=[IM_END])
    print(f"tokenizer index (LLTokenizer over 248k tokens): {time.perf_counter() - start:.2f} s")
    tokenizer = compiler.tokenizer

    print(f"\n{'mode':34s} {'tok':>4s} {'first':>9s} {'again':>7s} | mask us: "
          f"{'mean':>7s} {'p50':>7s} {'p99':>8s} {'max':>8s} | {'later mean':>10s} {'max':>8s} "
          f"| {'commit':>6s} {'bool+':>6s}")
    specs_ids = {}
    for name, (spec, answer) in workloads().items():
        ids = tokenizer.tokenize_str(answer, parse_special=True)
        specs_ids[name] = (spec, ids)
        start = time.perf_counter()
        compiler.compile(spec)
        compile_ms = (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
        compiler.compile(spec)
        again_ms = (time.perf_counter() - start) * 1e3
        runs = [replay(compiler, spec, ids) for _ in range(max(1, args.repeat))]
        cold_masks, _ = runs[0]
        warm = [m for masks, _ in runs[1:] for m in masks] or cold_masks
        commits = [c for _, commit_times in runs for c in commit_times]
        extra = bool_overhead(compiler, spec, ids)
        print(f"{name:34s} {len(ids):4d} {compile_ms:7.1f}ms {again_ms:5.1f}ms | "
              f"{'':9s}{_stats(cold_masks)} | {np.mean(warm) * 1e6:10.1f} "
              f"{np.max(warm) * 1e6:8.1f} | {np.mean(commits) * 1e6:6.1f} {extra * 1e6:6.1f}")
    batch_section(compiler, specs_ids, args.batch, args.device_step_ms)
    engine_section(compiler, specs_ids, args.device_step_ms)
    if args.compare_copies:
        copies_section(compiler, specs_ids, args.batch)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
