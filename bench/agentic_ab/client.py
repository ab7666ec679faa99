"""The closed-loop client: replays a plan against one server and writes one JSON row per
request attempt to client.jsonl.

Each main session runs on its own thread, each subagent on a thread its parent starts. A
session appends the arm's own streamed answer to its history (reasoning, content, tool calls),
as an agent client does, then delivers the next planned observation: one `tool` message per
call when the answer had tool calls (the observation goes to the first, the others get a fixed
line), else a user message. Scripted delays (tool execution, user think time) are the same in
every arm.

Main sessions that have joined the lock-step rounds send their next request only when every
other member is ready too (`Rounds`), so a faster server cannot run one session ahead and
change which session's prefix the cache evicts: cache numbers measure the cache, not speed.

Row fields: tag, seed, class, actor, main, api, t_send / t_first / t_done (seconds since the
run started, client clock), finish, prompt_tokens, cached_tokens (null when the server does not
report it), completion_tokens, tool_calls, content_chars, reasoning_chars, max_tokens,
aborted, in_flight (requests in flight when this one was sent, itself included), error.
Any error stops the run: the rows written so far stay, and the error makes the run invalid.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import httpx

from bench.agentic_ab.corpus import estimate_tokens
from bench.agentic_ab.wire import PATHS, Answer, body, read_stream

NO_OUTPUT = "No additional output."
GUARD_KEEP = 6  # tool results kept when the context guard clears older ones


class Rounds:
    """A barrier whose membership changes: members arrive when ready to send; all are
    released together once every member has arrived. Leaving releases the others if they
    were only waiting for the one who left."""

    def __init__(self, stop: threading.Event):
        self.members: set[str] = set()
        self.arrived: set[str] = set()
        self.round = 0
        self.stop = stop
        self.lock = threading.Condition()

    def join(self, name: str) -> None:
        with self.lock:
            self.members.add(name)

    def leave(self, name: str) -> None:
        with self.lock:
            self.members.discard(name)
            self.arrived.discard(name)
            self._release_if_complete()

    def arrive(self, name: str) -> None:
        with self.lock:
            if name not in self.members:
                return
            self.arrived.add(name)
            current = self.round
            self._release_if_complete()
            while self.round == current and not self.stop.is_set():
                self.lock.wait(0.5)

    def _release_if_complete(self) -> None:
        if self.arrived and self.arrived >= self.members:
            self.arrived.clear()
            self.round += 1
            self.lock.notify_all()


@dataclass
class ReplayConfig:
    base_url: str
    api: str = "chat"
    scripted_lengths: bool = False
    max_context: int | None = None  # context guard; None reads /v1/models max_model_len
    timeout_s: float = 1200.0
    model: str = "agentic-ab"


class Replay:
    def __init__(self, plan: dict, config: ReplayConfig, rows_path: str):
        self.plan, self.config = plan, config
        self.rows_file = open(rows_path, "w")
        self.stop = threading.Event()
        self.rounds = Rounds(self.stop)
        self.signals: dict[str, threading.Event] = {}
        self.lock = threading.Lock()
        self.in_flight = 0
        self.errors: list[str] = []
        self.warnings: list[str] = []
        self.reports: dict[str, str] = {}  # finished subagent -> its final answer
        self.t0 = time.monotonic()

    def signal(self, name: str) -> threading.Event:
        with self.lock:
            return self.signals.setdefault(name, threading.Event())

    def fail(self, message: str) -> None:
        with self.lock:
            self.errors.append(message)
        self.stop.set()

    def run(self) -> dict:
        """Replays every main session to the end (or to the first error); returns the run's
        wall time, errors and validity warnings."""
        if self.config.max_context is None:
            self.config.max_context = served_context(self.config.base_url)
        self.t0 = time.monotonic()
        threads = [threading.Thread(target=self.session, args=(name,), name=name)
                   for name, actor in self.plan["actors"].items() if actor["main"]]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.rows_file.close()
        return {"wall_s": round(time.monotonic() - self.t0, 3), "errors": self.errors,
                "warnings": self.warnings}

    def session(self, name: str) -> None:
        try:
            Session(self, name).run()
        except Exception as error:  # any failure makes the run invalid; say which and why
            self.fail(f"{name}: {type(error).__name__}: {error}")
        finally:
            self.rounds.leave(name)

    def write_row(self, row: dict) -> None:
        with self.lock:
            self.rows_file.write(json.dumps(row) + "\n")
            self.rows_file.flush()

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 4)


class Session:
    """One actor's live history and its walk through the plan's steps."""

    def __init__(self, replay: Replay, name: str):
        self.replay, self.name = replay, name
        actor = replay.plan["actors"][name]
        self.main = actor["main"]
        persona = replay.plan["personas"][actor["persona"]]
        self.system, self.tools = persona["system"], persona["tools"]
        self.steps = actor["steps"]
        self.history = [dict(m) for m in actor["messages"]]
        self.last: Answer | None = None  # the answer the next delivery follows
        self.ratio = 1.0  # server prompt tokens / client estimate, for the context guard
        self.http = httpx.Client(base_url=replay.config.base_url, timeout=httpx.Timeout(
            replay.config.timeout_s, connect=30.0))

    def run(self) -> None:
        try:
            for step in self.steps:
                if self.replay.stop.is_set():
                    return
                getattr(self, "op_" + step["op"])(step)
        finally:
            self.http.close()

    # --- ordering -------------------------------------------------------------------------

    def op_join(self, step: dict) -> None:
        self.replay.rounds.join(self.name)

    def op_signal(self, step: dict) -> None:
        self.replay.signal(step["name"]).set()

    def _outside_rounds(self, wait) -> None:
        """Leave the rounds while not ready to send, so the others are not held up."""
        member = self.name in self.replay.rounds.members
        self.replay.rounds.leave(self.name)
        wait()
        if member:
            self.replay.rounds.join(self.name)

    def op_wait(self, step: dict) -> None:
        def wait():
            for name in step["names"]:
                event = self.replay.signal(name)
                while not event.wait(0.5):
                    if self.replay.stop.is_set():
                        return
        self._outside_rounds(wait)

    def op_idle(self, step: dict) -> None:
        self._outside_rounds(lambda: self.replay.stop.wait(step["seconds"]))

    def op_spawn(self, step: dict) -> None:
        children = [threading.Thread(target=self.replay.session, args=(child,), name=child)
                    for child in step["children"]]

        def wait():
            for child in children:
                child.start()
            for child in children:
                child.join()
        self._outside_rounds(wait)

    # --- history --------------------------------------------------------------------------

    def deliver(self, deliver: dict | None) -> None:
        if deliver is None:
            return
        if "reports" in deliver:
            text = "\n\n".join(f"Report from {child}:\n{self.replay.reports.get(child, '')}"
                               for child in deliver["reports"])
            observation, user = text, None
        else:
            observation = (deliver.get("observation") or {}).get("text")
            user = deliver.get("user")
        calls = self.last.tool_calls if self.last is not None else []
        if calls and observation is not None:
            for i, call in enumerate(calls):
                self.history.append({"role": "tool", "tool_call_id": call["id"],
                                     "content": observation if i == 0 else NO_OUTPUT,
                                     "observation": True})
            if user:
                self.history.append({"role": "user", "content": user})
            return
        parts = [p for p in (observation, user) if p]
        self.history.append({"role": "user", "content": "\n\n".join(parts) or "Continue.",
                             "observation": observation is not None})

    def op_edit(self, step: dict) -> None:
        self.clear_observations(step["keep"], step["text"])

    def clear_observations(self, keep: int, text: str) -> int:
        """A client-side history edit: every tool result but the last `keep` replaced by
        `text` (the prefix changes from the first cleared message on)."""
        marked = [m for m in self.history if m.get("observation") or m["role"] == "tool"]
        cleared = marked[:-keep] if keep else marked
        for message in cleared:
            message["content"] = text
        return len(cleared)

    def wire_messages(self) -> list[dict]:
        return [{k: v for k, v in m.items() if k != "observation"} for m in self.history]

    # --- requests -------------------------------------------------------------------------

    def op_send(self, step: dict) -> None:
        self.deliver(step.get("deliver"))
        answer = self.request(step, self.system, self.wire_messages(), self.tools)
        if answer is not None:
            self.append(answer)

    def op_retry(self, step: dict) -> None:
        if step["replace"] and self.history and self.history[-1]["role"] == "assistant":
            self.history.pop()  # the user retry: the new answer replaces the old one
        answer = self.request(step, self.system, self.wire_messages(), self.tools)
        if answer is not None:
            self.append(answer)

    def op_compact(self, step: dict) -> None:
        persona = self.replay.plan["personas"]["compact"]
        messages = self.wire_messages()
        # Calls without results would be a malformed conversation; they were never run.
        calls = messages[-1].get("tool_calls", []) if messages else []
        messages += [{"role": "tool", "tool_call_id": call["id"], "content": NO_OUTPUT}
                     for call in calls]
        messages.append({"role": "user", "content": step["instruction"]})
        self.request(step, persona["system"], messages, persona["tools"])
        # The model's summary is discarded: a scripted one seeds the fresh context, so every
        # arm continues from the same bytes.
        self.history = [{"role": "user", "content": step["summary"]}]
        self.last = None

    def op_side(self, step: dict) -> None:
        persona = self.replay.plan["personas"]["check"]
        flat = "\n\n".join(f"[{m['role']}] {m.get('reasoning_content', '')}{m['content']}"
                           f"{json.dumps(m['tool_calls']) if m.get('tool_calls') else ''}"
                           for m in self.history)
        self.request(step, persona["system"], [{"role": "user", "content": flat + "\n\n" +
                                                step["instruction"]}], persona["tools"])

    def append(self, answer: Answer) -> None:
        self.history.append(answer.message())
        self.last = answer
        if not self.main:
            self.replay.reports[self.name] = answer.content or answer.reasoning

    def guard(self, system: str, messages: list[dict], tools: list[dict], max_tokens: int):
        """Clear old tool results if the estimated prompt would come within the answer's room
        of the server's context (a validity warning: the workload was changed)."""
        limit = self.replay.config.max_context
        if not limit:
            return messages
        estimate = estimate_tokens(system + json.dumps(tools) + json.dumps(messages))
        if estimate * self.ratio + max_tokens <= limit:
            return messages
        cleared = self.clear_observations(GUARD_KEEP, "[cleared to fit the context]")
        self.replay.warnings.append(f"{self.name}: context guard cleared {cleared} tool "
                                    f"results (estimated {int(estimate * self.ratio)} tokens)")
        return self.wire_messages()

    def request(self, step: dict, system: str, messages: list[dict], tools: list[dict]
                ) -> Answer | None:
        config = self.replay.config
        max_tokens = step["answer_tokens"] if config.scripted_lengths else step["max_tokens"]
        if step["op"] in ("send", "retry"):  # the session's own history, which a guard may edit
            messages = self.guard(system, messages, tools, max_tokens)
        self.replay.rounds.arrive(self.name)
        if self.replay.stop.is_set():
            return None
        time.sleep(step["delay_s"])
        payload = body(config.api, config.model, system, messages, tools, max_tokens,
                       step["seed"])
        abort_after = step.get("abort_after_s")
        with self.replay.lock:
            self.replay.in_flight += 1
            in_flight = self.replay.in_flight
        t_send = self.replay.now()
        try:
            answer = self.stream(payload, step["tag"], abort_after)
        finally:
            with self.replay.lock:
                self.replay.in_flight -= 1
        t_done = self.replay.now()
        t_first = None if answer.t_first is None else round(answer.t_first - self.replay.t0, 4)
        aborted = abort_after is not None
        row = {"tag": step["tag"], "seed": step["seed"], "class": step["class"],
               "actor": self.name, "main": self.main, "api": config.api, "t_send": t_send,
               "t_first": t_first, "t_done": t_done, "finish": answer.finish,
               "prompt_tokens": answer.prompt_tokens, "cached_tokens": answer.cached_tokens,
               "completion_tokens": answer.completion_tokens,
               "tool_calls": len(answer.tool_calls), "content_chars": len(answer.content),
               "reasoning_chars": len(answer.reasoning), "max_tokens": max_tokens,
               "aborted": aborted, "in_flight": in_flight, "error": answer.error}
        self.replay.write_row(row)
        if answer.error and not aborted:
            self.replay.fail(f"{step['tag']}: {answer.error}")
            return None
        if answer.prompt_tokens:
            estimate = estimate_tokens(system + json.dumps(tools) + json.dumps(messages))
            self.ratio = min(2.0, max(0.5, answer.prompt_tokens / estimate))
        return None if aborted else answer

    def stream(self, payload: dict, tag: str, abort_after: float | None) -> Answer:
        """One streamed request. An aborted attempt closes the connection at its first token
        or after `abort_after` seconds without data, whichever comes first (the server sees
        the disconnect and cancels)."""
        answer = Answer()
        api = self.replay.config.api
        timeout = None if abort_after is None else httpx.Timeout(
            self.replay.config.timeout_s, connect=30.0, read=abort_after)
        try:
            with self.http.stream("POST", PATHS[api], json=payload, timeout=timeout or
                                  httpx.USE_CLIENT_DEFAULT,
                                  headers={"x-request-tag": tag}) as response:
                if response.status_code != 200:
                    response.read()
                    answer.error = f"HTTP {response.status_code}: {response.text[:300]}"
                    return answer
                lines = response.iter_lines()
                if abort_after is not None:
                    lines = _until_first_token(lines, answer)
                read_stream(api, lines, answer)
        except httpx.ReadTimeout:
            if abort_after is None:
                answer.error = "read timeout"
        except httpx.HTTPError as error:
            answer.error = f"{type(error).__name__}: {error}"
        if abort_after is None and answer.error is None and answer.finish is None:
            answer.error = "stream ended without a finish reason"
        return answer


def _until_first_token(lines, answer: Answer):
    """Pass lines through until the reader has seen the first token, then stop: the caller
    leaves the `with` block and the connection closes mid-answer."""
    for line in lines:
        yield line
        if answer.t_first is not None:
            return


def served_context(base_url: str) -> int | None:
    """max_model_len from /v1/models, where the server reports it."""
    try:
        models = httpx.get(base_url + "/v1/models", timeout=30.0).json()
        return int(models["data"][0]["max_model_len"])
    except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError):
        return None
