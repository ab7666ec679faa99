"""The host-side request phases that grow with the prompt, at a given prompt length, without a
model step: what a long conversation's next turn pays on the CPU before and around its prefill.

    python -m bench.host_phases [--history 45000] [--grow 1250] [--repeat 5]

The prompt is `bench.prefix_cache`'s conversation at its second turn (system text, a first user
turn opening with `--history` tokens of earlier session text, an answer, a second user turn of
`--grow` tokens), rendered with the demo model's template and real Qwen tokenizer (`--demo`: no
weights are read for this). Times, best of `--repeat` (the machine is shared; the best is the
least disturbed), through the same calls the server makes:

- render / tokenize: `ModelSession.render` (the template to text; that text to ids);
- snapshot hints: the scan of the prompt for its turn starts that `ModelSession.build_request`
  makes (`turn_starts`);
- prompt id check: the range check `Engine.submit` makes (`min` / `max` over the ids);
- block hashes: `kv_blocks.block_hashes` over the prompt, as a prefix-cache lookup hashes it
  (an admission looks it up twice: when it heads the queue and when it starts).

The phases that do not depend on the prompt's length (parsing the body is orjson; the queue,
resume and prefill are the engine's) are measured per request by the server itself (request
log `phases`; `bench.prefix_cache` prints them per turn).
"""

from __future__ import annotations

import argparse
import sys
import time

from bench.prefix_cache import SYSTEM, user_turn


def best_of(repeat: int, work) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--history", type=int, default=45000,
                    help="earlier session text in turn 1 (45000: about 100K prompt tokens)")
    ap.add_argument("--grow", type=int, default=1250, help="new user tokens per turn")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)

    from runtime.artifact import open_artifact
    from runtime.engine.kv_blocks import block_hashes
    from runtime.session import demo_model_path
    from runtime.session.model_session import turn_starts
    from runtime.text.chat import encode_rendered, load_chat_template
    from runtime.text.tokenizer import Tokenizer

    artifact = open_artifact(demo_model_path())
    text = artifact.component("text")
    tokenizer = Tokenizer.from_artifact_resources(text.resources)
    template = load_chat_template(text.resources, fallback="qwen3_5")
    messages = [{"role": "system", "content": SYSTEM}, user_turn(0, args.grow, args.history),
                {"role": "assistant", "content": "ok"}, user_turn(1, args.grow, args.history)]
    options = {"enable_thinking": False}
    rendered = template.render_marked(tokenizer, messages, **options)
    ids = tuple(encode_rendered(tokenizer, rendered))
    rows = {
        "render": best_of(args.repeat, lambda: template.render_marked(tokenizer, messages,
                                                                       **options)),
        "tokenize": best_of(args.repeat, lambda: encode_rendered(tokenizer, rendered)),
        "snapshot hints": best_of(
            args.repeat, lambda: turn_starts(ids, tokenizer.special.im_start)),
        "prompt id check": best_of(args.repeat, lambda: min(ids) < 0 or max(ids) >= 1 << 31),
        "block hashes (one lookup)": best_of(args.repeat, lambda: block_hashes(list(ids))),
    }
    artifact.close()
    print(f"prompt: {len(ids)} tokens, {len(rendered)} characters; best of {args.repeat}\n")
    print("| phase | ms |\n|---|---:|")
    for name, seconds in rows.items():
        print(f"| {name} | {seconds * 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
