"""bench.agentic_ab end to end: the plan is deterministic, a CI-sized two-arm run against the
CPU demo server reports what the servers' request logs say, and an arm whose requests fail
makes the run invalid (tests/e2e/agentic_ab_fake_server.py stands in for the servers there,
one of them failing, neither with a request log)."""

from __future__ import annotations

import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from bench.agentic_ab.corpus import load_tree
from bench.agentic_ab.workload import build_plan

REPO = Path(__file__).resolve().parents[2]
SCALE, MAX_ANSWER = "0.004", "48"  # the smallest plan: ~45 requests of ~300-700 tokens
DEMO_CONTEXT = 8192
SERVE = (f"{shlex.quote(sys.executable)} -c 'import sys; from protocols.serve import main; "
         "sys.exit(main())' --demo --device cpu --max-concurrency 8 --port {port} "
         "--request-log {request_log}")
FAKE = (f"{shlex.quote(sys.executable)} {REPO / 'tests/e2e/agentic_ab_fake_server.py'} "
        "--port {port}")


def cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.agentic_ab", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def planned_requests(plan: dict) -> list[dict]:
    return [s for a in plan["actors"].values() for s in a["steps"] if "seed" in s]


def test_plan_is_deterministic_and_has_the_workload_shape(tmp_path):
    for name, seed in (("one.json", "1"), ("again.json", "1"), ("two.json", "2")):
        done = cli("plan", "--seed", seed, "--scale", SCALE, "--max-answer", MAX_ANSWER,
                   "--out", str(tmp_path / name), timeout=60)
        assert done.returncode == 0, done.stderr
    one = (tmp_path / "one.json").read_bytes()
    assert one == (tmp_path / "again.json").read_bytes()
    assert one != (tmp_path / "two.json").read_bytes()

    plan = json.loads(one)
    steps = planned_requests(plan)
    assert plan["requests"] == len(steps) == 46
    assert len({s["seed"] for s in steps} | {plan["warmup_seed"]}) == len(steps) + 1
    assert len({s["tag"] for s in steps}) == len(steps)
    assert {s["class"] for s in steps} == {
        "cold_resume", "loop", "retry", "check", "report", "subagent_first", "subagent_loop",
        "compaction", "restart", "after_idle", "after_edit", "aborted", "abort_retry", "final"}
    ops = [s["op"] for a in plan["actors"].values() for s in a["steps"]]
    assert {"spawn", "edit", "idle", "join", "wait", "signal"} <= set(ops)
    # The small scale fits the demo model's context, answers included.
    assert max(s["est_prompt_tokens"] for s in steps) + int(MAX_ANSWER) < DEMO_CONTEXT // 4
    assert max(s["answer_tokens"] for s in steps) <= int(MAX_ANSWER)
    # Every subagent of one kind shares the system+tools prefix: one persona entry each.
    explore = [a for a in plan["actors"].values() if a["persona"] == "explore"]
    assert len(explore) >= 4 and plan["personas"]["explore"]["tools"]

    # Full scale: resumes at 25K-85K tokens, growing per turn; production answer lengths.
    full = build_plan(load_tree(REPO), 1, 1.0)
    steps = planned_requests(full)
    resumes = sorted(s["est_prompt_tokens"] for s in steps if s["class"] == "cold_resume")
    assert 25000 <= resumes[0] < 30000 and 60000 <= resumes[1] < 65000 and \
        85000 <= resumes[2] < 90000
    loops = [s for s in full["actors"]["A"]["steps"] if s.get("class") == "loop"]
    growth = [b["est_prompt_tokens"] - a["est_prompt_tokens"] for a, b in zip(loops, loops[1:])]
    assert 100 <= statistics.median(growth) <= 6000
    answers = sorted(s["answer_tokens"] for s in steps if s["class"] not in
                     ("compaction", "check", "final"))
    assert 330 <= statistics.median(answers) <= 430
    assert 3500 <= answers[int(0.9 * len(answers))] <= 4600
    assert full["requests"] == 130


def test_two_arms_against_the_demo_server_agree_with_the_request_logs(tmp_path):
    out = tmp_path / "ab"
    done = cli("run", "--out", str(out), "--scale", SCALE, "--max-answer", MAX_ANSWER,
               "--scripted-lengths", "--seeds", "1", "--arm", "first=" + SERVE,
               "--arm", "second=" + SERVE, "--control", "first", timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    seed_dir = out / "seed-1"
    summary = json.loads((seed_dir / "summary.json").read_text())
    report = (seed_dir / "report.md").read_text()
    plan = json.loads((seed_dir / "plan.json").read_text())
    assert summary["valid"] and summary["errors"] == [] and "**Run valid: yes**" in report
    assert summary["ttft_clock"] == "server"
    plan_seeds = {s["seed"] for s in planned_requests(plan)}
    aborted = {s["seed"] for s in planned_requests(plan) if "abort_after_s" in s}
    for arm in ("first", "second"):
        rows = read_jsonl(seed_dir / arm / "client.jsonl")
        log = [r for r in read_jsonl(seed_dir / arm / "request_log.jsonl")
               if r["event"] == "request_done"]
        # Every planned attempt and the warm-up reached the server, once each.
        assert sorted(r["seed"] for r in log) == sorted(plan_seeds | {plan["warmup_seed"]})
        measured = [r for r in log if r["seed"] not in aborted and r["tag"] != "warmup"]
        metrics = summary["arms"][arm]["metrics"]
        assert summary["arms"][arm]["requests"] == len(measured) == summary["planned"] == 45
        prompt = sum(r["prompt_tokens"] for r in measured)
        cached = sum(r["cached_tokens"] or 0 for r in measured)
        assert metrics["prompt_tokens"]["value"] == prompt
        assert metrics["cached_tokens"]["value"] == cached
        assert metrics["prefilled_tokens"]["value"] == prompt - cached
        assert abs(metrics["cached_share"]["value"] - 100 * cached / prompt) < 1e-3
        ttfts = [r["ttft_s"] for r in measured]
        assert abs(metrics["ttft_mean"]["value"] - statistics.mean(ttfts)) < 1e-3
        assert abs(metrics["ttft_median"]["value"] - statistics.median(ttfts)) < 1e-3
        classes = {r["seed"]: r for r in rows}
        continuing_main = [r for r in measured if classes[r["seed"]]["main"] and
                           classes[r["seed"]]["class"] in ("loop", "after_idle", "after_edit",
                                                           "retry", "abort_retry", "report",
                                                           "final")]
        assert metrics["full_reprefill_main"]["value"] == sum(
            1 for r in continuing_main if not r["cached_tokens"])
        assert summary["arms"][arm]["denominators"]["full_reprefill_main"] == \
            len(continuing_main)
        assert summary["arms"][arm]["completion_tokens"] == sum(
            r["completion_tokens"] for r in measured)
        # Scripted lengths: the random model writes exactly the planned answer.
        lengths = {s["seed"]: s["answer_tokens"] for s in planned_requests(plan)}
        assert all(r["completion_tokens"] == lengths[r["seed"]] for r in measured)
        assert 2 <= max(r["in_flight"] for r in rows) <= 8
        assert f"| prompt tokens | {prompt:,} " in report
    change = summary["changes"]["second"]
    assert change["prompt_tokens"]["kind"] == "rel" and "second vs first" in report


def test_an_arm_whose_requests_fail_marks_the_run_invalid(tmp_path):
    out = tmp_path / "ab"
    record = tmp_path / "ok-requests.jsonl"
    done = cli("run", "--out", str(out), "--scale", SCALE, "--max-answer", MAX_ANSWER,
               "--scripted-lengths", "--seeds", "3", "--control", "ok",
               "--arm", f"ok={FAKE} --record {record}", "--arm", f"bad={FAKE} --fail-after 3",
               timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    summary = json.loads((out / "seed-3" / "summary.json").read_text())
    report = (out / "seed-3" / "report.md").read_text()
    assert summary["valid"] is False and "**Run valid: NO**" in report
    bad_errors = [e for e in summary["errors"] if e.startswith("bad:")]
    assert any("HTTP 500" in e for e in bad_errors) and bad_errors[0] in report
    assert not [e for e in summary["errors"] if e.startswith("ok:")]
    # The warm-up and two plan requests succeeded, then the run stopped at the failure.
    assert summary["arms"]["bad"]["requests"] < summary["planned"]

    # The healthy arm ran everything; its server reports no cached tokens and keeps no log.
    ok = summary["arms"]["ok"]
    rows = [r for r in read_jsonl(out / "seed-3" / "ok" / "client.jsonl") if not r["aborted"]]
    assert ok["requests"] == len(rows) == summary["planned"] and not ok["server_log"]
    assert summary["ttft_clock"] == "client"
    assert ok["metrics"]["cached_tokens"]["value"] == 0
    assert ok["metrics"]["prompt_tokens"]["value"] == sum(r["prompt_tokens"] for r in rows)
    assert all(r["cached_tokens"] is None for r in rows)

    # Answers with tool calls were followed by one tool message per call, in order.
    sent = read_jsonl(record)
    streamed_calls = 0
    for request in sent:
        messages = request["messages"]
        for i, message in enumerate(messages):
            if message["role"] == "assistant" and message["calls"]:
                follow = [m["call_id"] for m in messages[i + 1:i + 1 + len(message["calls"])]]
                assert follow == message["calls"], request["tag"]
                streamed_calls += message["calls"][0].startswith("fake-call-")
    assert streamed_calls > 0
