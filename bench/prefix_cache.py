"""The prefix cache over HTTP, like a client: a growing conversation and a KV-pressure case,
each on a server with the cache and one without.

    python -m bench.prefix_cache --out results/ --server "infernix-serve --demo --device cpu" \
        [--turns 6 --grow 400] [--history 0] [--pressure 8,600,2048] [--restart] [--max-new 8]

Growing conversation: turn n resends the whole history (system text, every earlier user turn
and answer) plus about `--grow` new tokens of user text, streamed over Chat Completions; the
time to the first token (request sent -> first streamed content) and the cached tokens the
server reports are recorded per turn, for both servers, and the answers of the two are
compared (seeded sampling: they must be equal).

Pressure: `N,L,POOL` sends N requests of about L prompt tokens at once to servers whose KV
pool holds POOL tokens (`--kv-capacity POOL --max-concurrency min(N, 8)`): with the cache a
paused request keeps its state in the host tier; without it (`--no-prefix-cache
--host-context-mib 0`) it is recomputed. Reports wall time, preemptions and host-tier bytes
from /metrics, and whether every answer equals the same request sent alone to an idle server.

Where each turn's time to first token goes: the conversation's servers write a request log
(`--request-log OUT/requests-ARM.jsonl`); each turn's phases (docs/serving.md, request log:
receive, parse, render, tokenize, setup, queue, match, resume, prefill with its steps and runner time,
deliver, first write) are joined to it by its `x-request-tag` and printed per turn, with what
is left of the client's TTFT (the HTTP round trip, the client's own parsing).

Restart (`--restart`): the file tier brings a conversation back after a restart; turn 2's time
to first token on a restarted server with `--prefix-cache-file` against a server without the
cache, and whether their answers are equal.

The server command gets `--port`, `--seed 1`, `--max-context` and the arm's flags appended.
Writes `prefix_cache.json` and prints Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import shlex
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

# How long a server on `--prefix-cache-file` may take to stop: the file is written as it stops
# (a 100K-token conversation at the 27B shape is ~7 GB; the file tier's save runs at a few
# hundred MB/s even on a slow 2-core VM: `python -m bench.cache_file`), so a supervisor that
# kills it after 30 s loses the file.
SAVE_WAIT_S = 600.0
SYSTEM = "You are a coding agent. Read files carefully, answer briefly and cite paths. " * 8
ARMS = {"cache": [], "no-cache": ["--no-prefix-cache", "--host-context-mib", "0",
                                  "--device-snapshot-slots", "0"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `infernix-serve` process on a free port, stopped on exit. ready_s: seconds from
    launch to a healthy /health (a server on `--prefix-cache-file` reads the file first)."""

    def __init__(self, command: str, flags: list[str], log: Path):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        argv = shlex.split(command) + ["--port", str(self.port), "--seed", "1"] + flags
        self.log = log.open("w")
        started = time.monotonic()
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = started + 600
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited ({self.process.returncode}); see {log}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    self.ready_s = time.monotonic() - started
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server not ready after 600 s; see {log}")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.base + "/metrics", timeout=30).text
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line and not line.startswith("#") and "{" not in line}

    def close(self, timeout_s: float = 30.0) -> dict:
        """SIGTERM, then wait up to `timeout_s` for the process to exit (a server on
        `--prefix-cache-file` writes the file as it stops: give it the time a save of what
        it holds takes), then kill it. Returns the seconds it took and whether it was killed."""
        started = time.monotonic()
        self.process.terminate()
        killed = False
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            killed = True
        self.log.close()
        return {"shutdown_s": time.monotonic() - started, "killed": killed}


def chat(base: str, messages: list[dict], max_new: int, seed: int, tag: str = "") -> dict:
    """One streamed chat request: answer text, TTFT and the usage block. tag: its
    `x-request-tag` (the request log's `tag`)."""
    body = {"model": "m", "messages": messages, "max_tokens": max_new, "seed": seed,
            "stream": True, "stream_options": {"include_usage": True},
            "chat_template_kwargs": {"enable_thinking": False}}
    headers = {"x-request-tag": tag} if tag else {}
    sent = time.perf_counter()
    first, text, usage = None, [], {}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, headers=headers,
                      timeout=3600) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {}).get("content")
                if delta:
                    first = first or time.perf_counter()
                    text.append(delta)
    return {"text": "".join(text), "ttft_s": (first or time.perf_counter()) - sent,
            "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def filler(tokens: int, salt: int) -> str:
    """About `tokens` tokens of distinct user text (numbered words)."""
    return " ".join(f"item{salt}_{i}" for i in range(max(1, tokens // 4)))


def user_turn(turn: int, grow: int, history: int) -> dict:
    """User turn `turn` (from 0): `grow` new tokens; turn 0 also opens with `history` tokens of
    earlier session text (a long session resumed cold)."""
    text = filler(grow, turn)
    if turn == 0 and history:
        text = filler(history, 999) + "\n" + text
    return {"role": "user", "content": text}


def conversation(base: str, turns: int, grow: int, max_new: int, history: int = 0,
                 log: Path | None = None) -> list[dict]:
    """The growing conversation; with the server's request log, each turn's row also has its
    logged phases (`phases`, `prefill_steps`, `prefill_compute_s`, `resume_path`)."""
    messages = [{"role": "system", "content": SYSTEM}]
    rows = []
    for turn in range(turns):
        messages.append(user_turn(turn, grow, history))
        result = chat(base, messages, max_new, seed=turn, tag=f"turn-{turn + 1}")
        messages.append({"role": "assistant", "content": result["text"] or "ok"})
        rows.append(result)
    if log is not None:
        logged = logged_requests(log)
        for turn, row in enumerate(rows):
            record = logged.get(f"turn-{turn + 1}", {})
            row.update({key: record.get(key) for key in (
                "phases", "prefill_steps", "prefill_compute_s", "resume_path")})
    return rows


def logged_requests(log: Path) -> dict[str, dict]:
    """The `request_done` lines of a server's request log, by tag (the line is written as the
    response ends, before the client sees the end of the stream)."""
    lines = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return {line["tag"]: line for line in lines
            if line.get("event") == "request_done" and line.get("tag")}


PHASE_COLUMNS = ("receive", "parse", "prepare_wait", "render", "tokenize", "setup", "submit", "queue",
                 "match", "resume", "prefill", "deliver", "first_write")


def phase_table(turns: dict[str, list[dict]]) -> list[str]:
    """Markdown rows: per arm and turn, the client's TTFT, each phase in ms, the prefill's
    steps and runner time, and what is left of the TTFT outside the server's phases."""
    head = ["arm", "turn", "TTFT ms", *PHASE_COLUMNS, "prefill steps", "prefill runner ms",
            "rest ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for arm, rows in turns.items():
        for n, row in enumerate(rows):
            phases = row.get("phases") or {}
            cells = [f"{phases[name] * 1e3:.1f}" if name in phases else "" for name in
                     PHASE_COLUMNS]
            compute = row.get("prefill_compute_s")
            lines.append("| " + " | ".join([
                arm, str(n + 1), f"{row['ttft_s'] * 1e3:.1f}", *cells,
                str(row.get("prefill_steps") or ""),
                f"{compute * 1e3:.1f}" if compute is not None else "",
                f"{(row['ttft_s'] - sum(phases.values())) * 1e3:.1f}" if phases else ""]) + " |")
    return lines


def restart(command: str, flags: list[str], out: Path, grow: int, max_new: int, history: int) -> dict:
    """The file tier: turn 1 (`history` + `grow` tokens) on a server with `--prefix-cache-file`,
    that server stopped (it writes the file as it stops; the stop is waited for, up to
    `SAVE_WAIT_S`) and a new one started on the file; turn 2's time to first token there
    against a server without the cache (what the file saves is that recomputation), and the
    two answers compared. The restarted server reads the file before it is ready, so the
    read's seconds (its /metrics) are reported too: what a client sees after a restart is
    the read plus the time to first token."""
    cache_file = out / "prefix-cache.bin"
    cache_file.unlink(missing_ok=True)
    messages = [{"role": "system", "content": SYSTEM}, user_turn(0, grow, history)]
    with_file = flags + ["--prefix-cache-file", str(cache_file)]
    server = Server(command, with_file, out / "serve-restart-before.log")
    try:
        first = chat(server.base, messages, max_new, seed=0)
    finally:
        stopped = server.close(SAVE_WAIT_S)
    # What the restart reads (the restarted server rewrites the file as it stops).
    file_bytes = cache_file.stat().st_size if cache_file.exists() else 0
    messages += [{"role": "assistant", "content": first["text"] or "ok"}, user_turn(1, grow, history)]
    runs, ready, read = {}, {}, {}
    try:
        for name, arm_flags in (("after_restart", with_file), ("recompute", flags + ARMS["no-cache"])):
            server = Server(command, arm_flags, out / f"serve-restart-{name}.log")
            try:
                ready[name] = server.ready_s
                runs[name] = chat(server.base, messages, max_new, seed=1)
                read[name] = server.metrics()
            finally:
                server.close(SAVE_WAIT_S)
    finally:
        cache_file.unlink(missing_ok=True)  # a scratch file of ~64 KB a token: not a result
    numbers = read["after_restart"]
    return {"file_bytes": file_bytes, "shutdown_s": stopped["shutdown_s"],
            "shutdown_killed": stopped["killed"],
            "file_read_s": numbers.get("infernix_prefix_cache_file_read_seconds", 0.0),
            "file_read_bytes": numbers.get("infernix_prefix_cache_file_read_bytes", 0),
            "ready_after_restart_s": ready["after_restart"], "ready_recompute_s": ready["recompute"],
            "prompt_tokens": runs["recompute"]["prompt_tokens"],
            "cached_tokens": runs["after_restart"]["cached_tokens"],
            "ttft_after_restart_s": runs["after_restart"]["ttft_s"],
            "ttft_recompute_s": runs["recompute"]["ttft_s"],
            "same_text": runs["after_restart"]["text"] == runs["recompute"]["text"]}


def pressure(base: str, count: int, length: int, max_new: int) -> dict:
    prompts = [[{"role": "user", "content": filler(length, 1000 + n)}] for n in range(count)]
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=count) as pool:
        results = list(pool.map(lambda p: chat(base, p, max_new, seed=7), prompts))
    return {"wall_s": time.perf_counter() - started, "texts": [r["text"] for r in results],
            "prompts": prompts}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--server", default="infernix-serve --demo --device cpu")
    ap.add_argument("--turns", type=int, default=6, help="turns of the growing conversation, cache on "
                    "and off (0: skip it, run only --pressure / --restart)")
    ap.add_argument("--grow", type=int, default=400, help="new user tokens per turn")
    ap.add_argument("--history", type=int, default=0, help="tokens of earlier session text in the "
                    "first turn (e.g. 100000: a turn adding --grow to a 100K-token conversation)")
    ap.add_argument("--max-new", type=int, default=8)
    ap.add_argument("--max-context", type=int, default=8192)
    ap.add_argument("--restart", action="store_true", help="also measure the file tier: turn 2 of a "
                    "conversation after a restart against recomputing it")
    ap.add_argument("--pressure", default="", help="N,L,POOL: N requests of L tokens, POOL-token "
                    "KV pool (empty: skip)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"server": args.server, "turns": {}, "pressure": {}, "restart": {}}
    for arm, flags in ARMS.items() if args.turns else ():
        log = args.out / f"requests-{arm}.jsonl"
        log.unlink(missing_ok=True)                  # the server appends to it
        server = Server(args.server, ["--max-context", str(args.max_context),
                                      "--request-log", str(log)] + flags,
                        args.out / f"serve-{arm}.log")
        try:
            report["turns"][arm] = conversation(server.base, args.turns, args.grow, args.max_new,
                                                args.history, log)
        finally:
            server.close()
    if args.pressure:
        count, length, pool = (int(x) for x in args.pressure.split(","))
        shape = ["--max-context", str(args.max_context), "--kv-capacity", str(pool),
                 "--max-concurrency", str(min(count, 8)), "--max-pending-requests", str(count)]
        for arm, flags in ARMS.items():
            server = Server(args.server, shape + flags, args.out / f"serve-pressure-{arm}.log")
            try:
                run = pressure(server.base, count, length, args.max_new)
                metrics = server.metrics()
                # The same requests one after another: their outputs alone, and (without a cache,
                # which would answer them from the run above) the FIFO time the issue compares with.
                started = time.perf_counter()
                alone = [chat(server.base, p, args.max_new, seed=7)["text"] for p in run["prompts"]]
                alone_s = time.perf_counter() - started
            finally:
                server.close()
            report["pressure"][arm] = {
                "wall_s": run["wall_s"],
                "one_by_one_s": alone_s,
                "preemptions": metrics.get("infernix_engine_preemptions_total", 0),
                "pauses_saved": metrics.get("infernix_prefix_cache_pauses_saved_total", 0),
                "device_to_host_bytes": metrics.get(
                    "infernix_prefix_cache_device_to_host_bytes_total", 0),
                "outputs_equal_alone": run["texts"] == alone}
    if args.restart:
        report["restart"] = restart(args.server, ["--max-context", str(args.max_context)], args.out,
                                    args.grow, args.max_new, args.history)
    (args.out / "prefix_cache.json").write_text(json.dumps(report, indent=2))
    if report["turns"]:
        print("| turn | prompt tokens | cached (cache) | TTFT cache s | TTFT no-cache s | same text |")
        print("|---:|---:|---:|---:|---:|:---:|")
        for n, (on, off) in enumerate(zip(report["turns"]["cache"], report["turns"]["no-cache"])):
            print(f"| {n + 1} | {on['prompt_tokens']} | {on['cached_tokens']} | {on['ttft_s']:.3f} "
                  f"| {off['ttft_s']:.3f} | {'yes' if on['text'] == off['text'] else 'NO'} |")
        print("\nWhere each turn's time to first token goes (server phases from its request log, ms):\n")
        print("\n".join(phase_table(report["turns"])))
    if report["pressure"]:
        fifo = report["pressure"]["no-cache"]["one_by_one_s"]
        print(f"\nFIFO, the requests one by one without a cache: {fifo:.2f} s\n")
        print("| arm | wall s | of FIFO | preemptions | pauses kept | device->host MiB | equal alone |")
        print("|---|---:|---:|---:|---:|---:|:---:|")
        for arm, row in report["pressure"].items():
            print(f"| {arm} | {row['wall_s']:.2f} | {row['wall_s'] / fifo:.2f}x | {row['preemptions']:.0f} | "
                  f"{row['pauses_saved']:.0f} | {row['device_to_host_bytes'] / 2**20:.1f} | "
                  f"{'yes' if row['outputs_equal_alone'] else 'NO'} |")
    if report["restart"]:
        r = report["restart"]
        print("\n| restart: prompt tokens | cached from the file | file read s | TTFT after restart s "
              "| read + TTFT s | TTFT recompute s | file MiB | shutdown s | same text |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
        print(f"| {r['prompt_tokens']} | {r['cached_tokens']} | {r['file_read_s']:.3f} | "
              f"{r['ttft_after_restart_s']:.3f} | {r['file_read_s'] + r['ttft_after_restart_s']:.3f} | "
              f"{r['ttft_recompute_s']:.3f} | {r['file_bytes'] / 2**20:.1f} | {r['shutdown_s']:.1f}"
              f"{' (killed)' if r['shutdown_killed'] else ''} | {'yes' if r['same_text'] else 'NO'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
