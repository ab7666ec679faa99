"""Per-token cost of the text layer on the real Qwen3.5/3.6 vocabulary: incremental
detokenization and the streaming output parser (reasoning, answer, XML tool calls, stop strings).

    python -m bench.text [--tokens N] [--repeat R]

Each workload is a realistic model output (encoded with the real tokenizer), fed one token per
`feed()` call as the engine delivers plain decode steps; the figure is wall time divided by
tokens, best of R runs, in process CPU time (so other load on a shared machine does not
inflate it). Target: < 20 us/token for parser + detokenizer.
"""

from __future__ import annotations

import argparse
import platform
import time

from runtime.text.detokenizer import Detokenizer, DetokenizerOffsets, detokenize_incremental
from runtime.text.parser import QwenOutputParser
from runtime.text.stops import StopConditions
from runtime.text.tokenizer import Tokenizer
from tools.tokenizer_json import build_qwen_tokenizer_json

REASONING = (
    "The user wants a function that parses dates. Let me think about the edge cases: leap "
    "years, time zones (UTC offsets like +05:30), and ISO 8601 week dates. 我们还需要处理中文日期"
    "格式，例如2024年3月15日。 Also emoji in logs 😀 should not break anything.\n"
    "```python\nfor year in range(1900, 2100):\n    assert is_leap(year) == calendar.isleap(year)\n"
    "```\n")
ANSWER = (
    "Here is the plan:\n\n1. Parse the input with `datetime.fromisoformat`.\n2. Fall back to "
    "a regex for the Chinese format.\n3. Normalise to UTC.\n\n")
FILE = (
    "import re\nfrom datetime import datetime, timezone\n\n_CN = re.compile(r\"(\\d{4})年(\\d{1,2})"
    "月(\\d{1,2})日\")\n\n\ndef parse_date(text: str) -> datetime:\n    \"\"\"Parse ISO or "
    "Chinese dates.\"\"\"\n    match = _CN.fullmatch(text.strip())\n    if match:\n        y, m, d "
    "= map(int, match.groups())\n        return datetime(y, m, d, tzinfo=timezone.utc)\n    "
    "value = datetime.fromisoformat(text)\n    return value.astimezone(timezone.utc)\n")
TOOLS = [{"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"},
                                     "overwrite": {"type": "boolean"}}}}}]


def _workloads(tokenizer: Tokenizer, tokens: int) -> dict[str, tuple[list[int], dict]]:
    def repeat(text: str) -> str:
        ids_per_copy = max(1, len(tokenizer.encode(text)))
        return text * max(1, tokens // ids_per_copy)

    call = ("<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/dates.py\n</parameter>\n"
            f"<parameter=content>\n{repeat(FILE)}\n</parameter>\n<parameter=overwrite>\ntrue\n"
            "</parameter>\n</function>\n</tool_call><|im_end|>")
    return {
        "reasoning": (tokenizer.encode(repeat(REASONING)), {"starts_in_reasoning": True}),
        "answer": (tokenizer.encode(repeat(ANSWER)), {"starts_in_reasoning": False}),
        "tool call (string streaming)": (tokenizer.encode(call),
                                         {"starts_in_reasoning": False, "tools": TOOLS}),
        "answer + 3 stop strings": (
            tokenizer.encode(repeat(ANSWER)),
            {"starts_in_reasoning": False,
             "stop": StopConditions.build(["</answer>", "\n\n\n\n", "Observation:"])}),
    }


def _best(run, repeat: int) -> float:
    """Best CPU time of `repeat` runs (process time: other load on the machine does not count)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        run()
        best = min(best, time.process_time() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20000, help="tokens per workload")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)

    tokenizer = Tokenizer.from_json(build_qwen_tokenizer_json())
    print(f"# bench.text on {platform.processor() or platform.machine()}, "
          f"Python {platform.python_version()}; CPU time, best of {args.repeat}; "
          "one token per call")
    print(f"{'workload':<34}{'tokens':>8}{'detok us/tok':>14}{'parser+detok us/tok':>21}")
    for name, (ids, options) in _workloads(tokenizer, args.tokens).items():
        def detok_only():
            detok = Detokenizer(tokenizer.token_bytes)
            for token_id in ids:
                detok.push(token_id)
            detok.flush()

        def parse_all():
            output_parser = QwenOutputParser(tokenizer, **options)
            for token_id in ids:
                output_parser.feed((token_id,))
            output_parser.finish(False)

        detok_us = _best(detok_only, args.repeat) / len(ids) * 1e6
        parse_us = _best(parse_all, args.repeat) / len(ids) * 1e6
        print(f"{name:<34}{len(ids):>8}{detok_us:>14.2f}{parse_us:>21.2f}")

    ids = _workloads(tokenizer, args.tokens)["answer"][0]

    def pure():
        offsets = DetokenizerOffsets()
        so_far: list[int] = []
        for token_id in ids:
            so_far.append(token_id)
            _, offsets = detokenize_incremental(tokenizer.token_bytes, so_far, offsets)

    pure_us = _best(pure, args.repeat) / len(ids) * 1e6
    print(f"{'pure detokenize_incremental':<34}{len(ids):>8}{pure_us:>14.2f}{'':>21}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
