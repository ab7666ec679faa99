"""python -m bench.agentic_ab {plan, run, replay, analyze}: see the help text below."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.agentic_ab.analyze import aggregate, analyze
from bench.agentic_ab.client import Replay, ReplayConfig
from bench.agentic_ab.corpus import load_tree
from bench.agentic_ab.runner import RunConfig, Runner, parse_arm
from bench.agentic_ab.wire import APIS
from bench.agentic_ab.workload import build_plan, plan_bytes

DESCRIPTION = """\
A/B replay of agentic coding traffic against two (or more) servers on one machine.

The flow:
  1. plan     a deterministic workload from a seed and a scale, its observations generated
              from a real source tree (default: this repository at HEAD), written as plan.json;
  2. run      for each seed: each arm's server started from its own command line, readiness
              (/health), one excluded warm-up, the plan replayed closed-loop over streaming
              Chat Completions (or Responses / Anthropic Messages), the server stopped, the
              machine left to go idle; arms interleaved across seeds; then analyze (and
              --aggregate over the seeds);
  3. analyze  client rows joined with each server's request log: TTFT by cause, cache share,
              prefilled tokens, full re-prefills, cold prefill and output speed, wall time, per
              arm and as change against the control with 95 % block-bootstrap intervals;
              report.md + summary.json. Any failed request marks the run invalid.
  replay      the client alone against a server that is already running (no lifecycle).

Example (the CPU demo model, a CI-sized run):
  python -m bench.agentic_ab run --out /tmp/ab --scale 0.004 --max-answer 48 \\
      --scripted-lengths --seeds 1 \\
      --arm 'cache=infernix-serve --demo --device cpu --max-concurrency 8 --port {port} \\
             --request-log {request_log}' \\
      --arm 'nocache=infernix-serve --demo --device cpu --max-concurrency 8 --port {port} \\
             --request-log {request_log} --no-prefix-cache' --control nocache
"""


def _plan_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scale", type=float, default=1.0,
                        help="shrinks prompt sizes, loop lengths, tool lists, delays and "
                             "answer lengths; 1.0 = prompts starting at 25K-85K tokens, ~130 "
                             "requests; ~0.004 fits the CPU demo model (default: 1.0)")
    parser.add_argument("--source", default=".",
                        help="source tree for the observations: a git repository (read at "
                             "--rev) or a plain directory (default: .)")
    parser.add_argument("--rev", default="HEAD", help="revision of --source (default: HEAD)")
    parser.add_argument("--max-answer", type=int, default=None,
                        help="cap on planned answer lengths (CPU-sized runs; default: none)")


def _client_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api", choices=APIS, default="chat",
                        help="streaming API to replay over (default: chat)")
    parser.add_argument("--scripted-lengths", action="store_true",
                        help="send each turn's planned answer length as max_tokens: random "
                             "weights never stop on their own, so this gives a synthetic-weight "
                             "run the real output shape (median ~380, p90 ~4,000 at scale 1)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.agentic_ab", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    plan = commands.add_parser("plan", help="write plan.json for a seed and a scale")
    plan.add_argument("--seed", type=int, default=1)
    plan.add_argument("--out", default="plan.json", help="output file (default: plan.json)")
    _plan_args(plan)

    run = commands.add_parser("run", help="run every arm for every seed, then analyze",
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              description=DESCRIPTION)
    run.add_argument("--arm", action="append", required=True, metavar="NAME=COMMAND",
                     help="an arm's server command line; {port} is replaced by a free port, "
                          "{request_log} by the arm's request-log path (leave it out for a "
                          "server without one); repeat for each arm")
    run.add_argument("--control", help="the arm the others are compared with (default: the "
                                       "first --arm)")
    run.add_argument("--seeds", default="1", help="comma-separated workload seeds (default: 1)")
    run.add_argument("--out", required=True, help="output directory")
    run.add_argument("--ready-timeout", type=float, default=900.0,
                     help="seconds to wait for /health (default: 900)")
    run.add_argument("--idle-gpu-mib", type=int, default=6144,
                     help="after an arm, wait until every GPU uses less memory than this "
                          "(where nvidia-smi exists; default: 6144)")
    _plan_args(run)
    _client_args(run)

    replay = commands.add_parser("replay", help="replay a plan.json against a running server")
    replay.add_argument("--plan", required=True)
    replay.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8080")
    replay.add_argument("--out", default="client.jsonl", help="client rows (default: client.jsonl)")
    _client_args(replay)

    analyze_cmd = commands.add_parser("analyze", help="(re)write report.md and summary.json")
    analyze_cmd.add_argument("dir", help="a seed-N directory, or with --aggregate the run's "
                                         "output directory")
    analyze_cmd.add_argument("--aggregate", action="store_true",
                             help="analyze every seed-N under DIR and combine them")

    args = parser.parse_args(argv)
    if args.command == "plan":
        built = build_plan(load_tree(args.source, args.rev), args.seed, args.scale,
                           args.max_answer)
        Path(args.out).write_bytes(plan_bytes(built))
        print(f"{args.out}: {built['requests']} requests, seed {args.seed}, scale {args.scale}")
        return 0
    if args.command == "run":
        arms = [parse_arm(text) for text in args.arm]
        names = [a.name for a in arms]
        if len(set(names)) != len(names):
            parser.error("arm names must differ")
        control = args.control or names[0]
        if control not in names:
            parser.error(f"--control {control!r} is not an arm")
        config = RunConfig(arms, control, [int(s) for s in args.seeds.split(",")], args.scale,
                           args.out, source=args.source, rev=args.rev, api=args.api,
                           scripted_lengths=args.scripted_lengths, max_answer=args.max_answer,
                           ready_timeout_s=args.ready_timeout, idle_gpu_mib=args.idle_gpu_mib)
        summaries = Runner(config).run()
        return 0 if all(s["valid"] for s in summaries) else 1
    if args.command == "replay":
        loaded = json.loads(Path(args.plan).read_text())
        result = Replay(loaded, ReplayConfig(args.url.rstrip("/"), api=args.api,
                                             scripted_lengths=args.scripted_lengths),
                        args.out).run()
        print(json.dumps(result, indent=1))
        return 0 if not result["errors"] else 1
    if args.aggregate:
        for seed_dir in sorted(Path(args.dir).glob("seed-*")):
            analyze(seed_dir)
        summary = aggregate(Path(args.dir))
    else:
        summary = analyze(Path(args.dir))
    print(f"valid: {summary['valid']}; report: {Path(args.dir) / 'report.md'}")
    return 0 if summary["valid"] else 1


if __name__ == "__main__":
    sys.exit(main())
