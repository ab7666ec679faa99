"""The runner: for each seed, one plan, then each arm in turn on the same machine: start its
server from its own command line, wait for /health, one excluded warm-up request, replay the
plan, stop the server, wait until the machine is idle. The arm order rotates from seed to seed
(interleaving), so neither arm always runs on a machine just warmed by the other.

An arm is `NAME=COMMAND`. The command may hold `{port}` (a free port chosen per run; required)
and `{request_log}` (the arm's request_log.jsonl; leave it out for a server without one). So
the control can be another build, the same build with other flags (`--no-prefix-cache`), or
another engine.

Layout: OUT/config.json, OUT/runner.log, OUT/seed-N/{plan.json, run.json, report.md,
summary.json, ARM/{client.jsonl, request_log.jsonl, serve.log, arm.json}}, and with several
seeds OUT/report.md and OUT/summary.json combining them.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from bench.agentic_ab.analyze import aggregate, analyze
from bench.agentic_ab.client import Replay, ReplayConfig
from bench.agentic_ab.corpus import load_tree
from bench.agentic_ab.wire import PATHS, Answer, body, read_stream
from bench.agentic_ab.workload import build_plan, plan_bytes


@dataclass(frozen=True)
class Arm:
    name: str
    command: str


def parse_arm(text: str) -> Arm:
    name, sep, command = text.partition("=")
    if not sep or not name.strip() or not command.strip():
        raise ValueError(f"an arm is NAME=COMMAND, not {text!r}")
    if "{port}" not in command:
        raise ValueError(f"arm {name!r}: the command must contain {{port}}")
    if not name.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"arm name {name!r}: letters, digits, - and _ only (it names a folder)")
    return Arm(name.strip(), command.strip())


@dataclass
class RunConfig:
    arms: list[Arm]
    control: str
    seeds: list[int]
    scale: float
    out: str
    source: str = "."
    rev: str = "HEAD"
    api: str = "chat"
    scripted_lengths: bool = False
    max_answer: int | None = None
    ready_timeout_s: float = 900.0
    stop_grace_s: float = 30.0
    idle_gpu_mib: int = 6144  # the GPU counts as idle below this much memory in use
    idle_timeout_s: float = 300.0
    request_timeout_s: float = 1200.0


class Runner:
    def __init__(self, config: RunConfig):
        self.config = config
        self.out = Path(config.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log_file = open(self.out / "runner.log", "a")

    def log(self, message: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {message}"
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def run(self) -> list[dict]:
        config = self.config
        (self.out / "config.json").write_text(json.dumps(
            {**asdict(config), "arms": [asdict(a) for a in config.arms]}, indent=1) + "\n")
        tree = load_tree(config.source, config.rev)
        self.log(f"source {tree.origin}")
        summaries = []
        for turn, seed in enumerate(config.seeds):
            seed_dir = self.out / f"seed-{seed}"
            seed_dir.mkdir(exist_ok=True)
            plan = build_plan(tree, seed, config.scale, max_answer=config.max_answer)
            (seed_dir / "plan.json").write_bytes(plan_bytes(plan))
            order = config.arms[turn % len(config.arms):] + config.arms[:turn % len(config.arms)]
            (seed_dir / "run.json").write_text(json.dumps({
                "arms": [a.name for a in config.arms], "control": config.control,
                "order": [a.name for a in order], "api": config.api,
                "scripted_lengths": config.scripted_lengths}, indent=1) + "\n")
            self.log(f"seed {seed}: {plan['requests']} requests, arms in order "
                     f"{[a.name for a in order]}")
            for arm in order:
                self.run_arm(arm, plan, seed_dir / arm.name)
            summary = analyze(seed_dir)
            self.log(f"seed {seed}: valid={summary['valid']}, report {seed_dir / 'report.md'}")
            summaries.append(summary)
        if len(config.seeds) > 1:
            combined = aggregate(self.out)
            self.log(f"all seeds: valid={combined['valid']}, report {self.out / 'report.md'}")
        return summaries

    def run_arm(self, arm: Arm, plan: dict, arm_dir: Path) -> None:
        arm_dir.mkdir(parents=True, exist_ok=True)
        log_path = arm_dir / "request_log.jsonl"
        log_path.unlink(missing_ok=True)
        port = free_port()
        command = arm.command.replace("{port}", str(port)).replace("{request_log}",
                                                                   str(log_path))
        info = {"name": arm.name, "command": command, "port": port, "errors": [],
                "warnings": []}
        self.log(f"{arm.name}: starting `{command}`")
        started = time.monotonic()
        with open(arm_dir / "serve.log", "w") as serve_log:
            process = subprocess.Popen(shlex.split(command), stdout=serve_log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_ready(base, process, self.config.ready_timeout_s)
            info["ready_s"] = round(time.monotonic() - started, 2)
            info["warmup"] = warm_up(base, self.config.api, plan["warmup_seed"])
            if info["warmup"].get("error"):
                raise ArmError(f"warm-up failed: {info['warmup']['error']}")
            self.log(f"{arm.name}: ready in {info['ready_s']} s; replaying")
            result = Replay(plan, ReplayConfig(
                base, api=self.config.api, scripted_lengths=self.config.scripted_lengths,
                timeout_s=self.config.request_timeout_s), str(arm_dir / "client.jsonl")).run()
            info["wall_s"] = result["wall_s"]
            info["errors"] += [f"{arm.name}: {e}" for e in result["errors"]]
            info["warnings"] += [f"{arm.name}: {w}" for w in result["warnings"]]
        except ArmError as error:
            info["errors"].append(f"{arm.name}: {error}")
        finally:
            info["exit_code"] = stop(process, self.config.stop_grace_s)
            info["idle_wait_s"] = wait_idle(port, self.config.idle_gpu_mib,
                                            self.config.idle_timeout_s)
            (arm_dir / "arm.json").write_text(json.dumps(info, indent=1) + "\n")
        self.log(f"{arm.name}: done, wall {info.get('wall_s')} s, errors {len(info['errors'])}")


class ArmError(RuntimeError):
    """The arm could not run its plan (no server, failed warm-up)."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def port_open(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.5)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def wait_ready(base: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ArmError(f"server exited with code {process.returncode} before it was ready "
                           "(see serve.log)")
        try:
            if httpx.get(base + "/health", timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise ArmError(f"server not ready after {timeout_s} s")


def warm_up(base: str, api: str, seed: int) -> dict:
    """One short request the analysis leaves out: first-request costs (lazy set-up, caches of
    the HTTP layer) do not land on the plan's first turn."""
    payload = body(api, "agentic-ab", "You are a helpful assistant.",
                   [{"role": "user", "content": "Say hello in one word."}], [], 8, seed)
    answer = Answer()
    started = time.monotonic()
    try:
        with httpx.stream("POST", base + PATHS[api], json=payload, timeout=600.0,
                          headers={"x-request-tag": "warmup"}) as response:
            if response.status_code != 200:
                response.read()
                answer.error = f"HTTP {response.status_code}: {response.text[:300]}"
            else:
                read_stream(api, response.iter_lines(), answer)
    except httpx.HTTPError as error:
        answer.error = f"{type(error).__name__}: {error}"
    return {"seconds": round(time.monotonic() - started, 3), "error": answer.error,
            "finish": answer.finish}


def stop(process: subprocess.Popen, grace_s: float) -> int:
    """SIGTERM to the server's own process group (it was started in a new session), SIGKILL
    after the grace period."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode


def wait_idle(port: int, idle_gpu_mib: int, timeout_s: float) -> float:
    """Until the port is closed and, on a machine with nvidia-smi, every GPU uses less than
    `idle_gpu_mib` (memory is released after the process exits); returns the seconds waited."""
    started = time.monotonic()
    deadline = started + timeout_s
    while port_open(port) and time.monotonic() < deadline:
        time.sleep(0.2)
    smi = shutil.which("nvidia-smi")
    while smi and time.monotonic() < deadline:
        used = subprocess.run([smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True).stdout.split()
        if all(int(v) < idle_gpu_mib for v in used if v.isdigit()):
            break
        time.sleep(1.0)
    return round(time.monotonic() - started, 2)
