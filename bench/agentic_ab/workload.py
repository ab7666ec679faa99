"""The workload: a deterministic plan of agentic coding traffic from a seed and a scale.

Three main sessions share one server, each working in its own area of the tree: A (cc
persona), B (qc) and C (cc). Their cold resumes (~85K / ~60K / ~25K tokens at scale 1) run one
after another, then the sessions interleave in lock-step rounds with up to 8 requests in flight:

- A: loop -> explore fan-out of 4 subagents (one shared system+tools prefix) -> report turn ->
  loop with a copy-heavy turn -> compaction (the model's summary is discarded, a scripted one
  seeds a fresh context) -> restart turn -> loop -> a fan-out of 3 -> report -> waits until B and
  C are done -> loop -> review subagent -> report -> final write-up without tools.
- B: loop -> user retry (same prompt resent, the new answer replaces the old) -> loop ->
  loop-check side call (whole history flattened) -> loop -> two surveys at once -> report ->
  idle until A has restarted, plus an idle gap -> after-idle turn -> loop -> side call -> history
  edit (all but the last tool results cleared) -> after-edit turn -> loop.
- C: loop -> a pasted CI log that the client aborts and resends -> loop -> review subagent ->
  report -> loop.

Every observation is generated here, before any run (bench.agentic_ab.corpus), so arms differ
only in their own streamed answers. Token sizes, loop lengths, tool lists, delays and answer
lengths shrink with `scale` (1.0 is the full workload, ~0.01 fits the CPU demo model).

plan.json: {format, version, seed, scale, source, personas: {name: {system, tools}}, actors:
{name: {persona, main, messages (the resumed history, Chat Completions shape), steps}},
requests, warmup_seed}. Steps (`op`):
- send: tag, seed, class, deliver ({observation, user} | {reports: [child actors]} | null),
  delay_s, answer_tokens (planned length), max_tokens (what an agent sends), est_prompt_tokens,
  abort_after_s (only for the aborted attempt);
- retry: a send of the previous prompt again; `replace` drops the last answer first (user
  retry) or not (resend after an abort);
- compact: a send with the compact persona over the whole history, then `summary` replaces it;
- side: the check persona over the flattened history; the answer is not kept;
- edit: tool results before the last `keep` replaced by `text`;
- spawn: children run at once; the parent waits for them all;
- join: enter the lock-step rounds; wait / signal: ordering between sessions; idle: seconds.
"""

from __future__ import annotations

import hashlib
import json
import math
from random import Random

from bench.agentic_ab.corpus import Observer, SourceTree, estimate_tokens
from bench.agentic_ab.personas import personas

FORMAT = "infernix_agentic_plan"
VERSION = 1
MEDIAN_ANSWER, P90_ANSWER = 380, 4000  # tokens at scale 1 (production agent turns)
AGENT_MAX_TOKENS = 64000  # what the imitated agents send on every turn
Z90 = 1.2815515655446004
# Per area: observation kind weights for the main session working there.
MIXES = [
    {"read": 34, "grep": 18, "edit": 18, "test": 14, "diff": 10, "glob": 6},
    {"read": 30, "grep": 20, "edit": 16, "test": 18, "diff": 8, "glob": 8},
    {"read": 28, "grep": 14, "edit": 14, "test": 26, "diff": 12, "glob": 6},
]
SUBAGENT_MIX = {"read": 40, "grep": 30, "diff": 15, "glob": 15}
CLEARED = "[Old tool result content cleared]"
SHORT_USER = ["Continue.", "Looks right, go on.", "Keep going; run the tests when done.",
              "Good. Next step?", "Check the callers too.", "Make it simpler if you can."]


def request_seed(seed: int, actor: str, index: int, attempt: int = 0) -> int:
    """A 31-bit request seed from (workload seed, actor, step, attempt): the request's `seed`
    field in every arm and the join key with the server's request log."""
    digest = hashlib.sha256(f"{seed}/{actor}/{index}/{attempt}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def count(n: int, scale: float, low: int = 1) -> int:
    return max(low, round(n * scale))


class Actor:
    """One session's plan under construction: its history estimate and its steps."""

    def __init__(self, plan: "PlanBuilder", name: str, persona: str, observer: Observer,
                 mix: dict, main: bool):
        self.plan, self.name, self.persona, self.observer = plan, name, persona, observer
        self.mix, self.main = mix, main
        self.rng = Random(request_seed(plan.seed, name, -1))
        self.messages: list[dict] = []
        self.steps: list[dict] = []
        base = plan.personas[persona]
        self.est_tokens = estimate_tokens(base["system"] + json.dumps(base["tools"]))

    def add(self, op: str, **fields) -> dict:
        step = {"op": op, **fields}
        self.steps.append(step)
        return step

    def request(self, op: str, cls: str, *, answer: int | None = None, max_tokens: int =
                AGENT_MAX_TOKENS, delay_s: float = 0.0, **fields) -> dict:
        index = len(self.steps)
        step = self.add(op, tag=f"{self.name}#{index}", seed=self.plan.new_seed(self.name, index),
                        **{"class": cls}, delay_s=round(delay_s, 3),
                        answer_tokens=answer, max_tokens=count(max_tokens, self.plan.scale, 16),
                        est_prompt_tokens=self.est_tokens, **fields)
        if answer is None:
            self.plan.agent_turns.append(step)
        return step

    def grow(self, text: str) -> None:
        self.est_tokens += estimate_tokens(text) + 8  # + role/template tokens

    def observe(self, kind: str | None = None, tokens: int | None = None):
        if kind is None:
            kinds = sorted(self.mix)
            kind = self.rng.choices(kinds, [self.mix[k] for k in kinds])[0]
        return self.observer.observe(self.rng, kind, tokens)

    def resume(self, target: int, task: str) -> None:
        """A resumed history: the task, then prior tool round trips (reasoning + one call with
        a deterministic id + its result) with a short progress exchange every 9 rounds, until
        the estimated prompt reaches the target; then the cold-resume request."""
        self.messages.append({"role": "user", "content": task})
        self.grow(task)
        rounds = 0
        while self.est_tokens < target:
            rounds += 1
            if rounds % 9 == 0:
                progress = [{"role": "assistant", "content": f"Progress: {rounds} steps in; the "
                             "main path is understood, now checking edge cases."},
                            {"role": "user", "content": self.rng.choice(SHORT_USER)}]
                self.messages.extend(progress)
                self.grow(" ".join(m["content"] for m in progress))
                continue
            obs = self.observe()
            reasoning = (f"Next I look at {json.dumps(obs.arguments)[:160]} to see how this "
                         "part behaves before changing anything.")
            call_id = f"call_{self.name}_{rounds:04d}"
            self.messages.append({"role": "assistant", "content": "", "reasoning_content":
                                  reasoning, "tool_calls": [{
                                      "id": call_id, "type": "function", "function": {
                                          "name": obs.tool,
                                          "arguments": json.dumps(obs.arguments)}}]})
            self.messages.append({"role": "tool", "tool_call_id": call_id, "content": obs.text})
            self.grow(reasoning + json.dumps(obs.arguments) + obs.text)
        self.request("send", "cold_resume", deliver={"observation": None,
                                                     "user": "Continue where we left off."})
        self.grow("Continue where we left off.")

    def turn(self, cls: str = "loop", kind: str | None = None, user: str | None = None,
             tokens: int | None = None, **fields) -> dict:
        obs = self.observe(kind, tokens)
        think = 0.0
        if user is None and self.rng.random() < 0.2:
            user = self.rng.choice(SHORT_USER)
        if user is not None:
            think = (1.0 + 7.0 * self.rng.random()) * self.plan.scale
        self.grow(obs.text + (user or ""))
        return self.request("send", cls, delay_s=obs.exec_s + think,
                            deliver={"observation": {"tool": obs.tool, "arguments":
                                                     obs.arguments, "text": obs.text},
                                     "user": user}, **fields)

    def loop(self, n: int, copy_heavy: int = 0) -> None:
        """n turns at scale 1 (scaled, at least one); `copy_heavy` of them read a whole file
        and ask for it rewritten with one added comment (long verbatim answers)."""
        turns = count(n, self.plan.scale)
        heavy = set(self.rng.sample(range(turns), min(copy_heavy, turns)))
        for i in range(turns):
            if i in heavy:
                obs_tokens = self.observer.target(self.rng, 1500, 5200)
                self.turn(kind="read", tokens=obs_tokens, user="Rewrite this whole file with "
                          "write_file, unchanged except for one comment line at the top that "
                          "says what the file is for.")
            else:
                self.turn()

    def fan_out(self, names: list[str], persona: str, turns: int, task: str) -> None:
        for name in names:
            child = self.plan.actor(name, persona, self.observer, SUBAGENT_MIX, main=False)
            subject = child.observer.code[child.rng.randrange(len(child.observer.code))]
            first = f"{task} Start from {subject}."
            child.messages.append({"role": "user", "content": first})
            child.grow(first)
            child.request("send", "subagent_first", deliver=None)
            n = count(turns, self.plan.scale, 2) - 1
            for i in range(n):
                last = i == n - 1
                child.turn("subagent_loop", user="That is enough research: write your final "
                           "report now." if last else None)
        self.add("spawn", children=names)
        self.request("send", "report", deliver={"reports": names})
        # The reports are the children's own answers; estimate ~300 tokens each at scale 1.
        self.est_tokens += self.plan.tokens(300) * len(names)


class PlanBuilder:
    def __init__(self, tree: SourceTree, seed: int, scale: float, max_answer: int | None):
        if not 0 < scale <= 1:
            raise ValueError(f"scale must be in (0, 1], not {scale}")
        self.tree, self.seed, self.scale, self.max_answer = tree, seed, scale, max_answer
        self.areas = [Observer(tree, area, scale) for area in tree.areas()]
        self.personas = personas(self.areas[0], scale)
        self.actors: dict[str, Actor] = {}
        self.seeds: set[int] = set()
        self.agent_turns: list[dict] = []

    def new_seed(self, actor: str, index: int) -> int:
        attempt = 0
        while (value := request_seed(self.seed, actor, index, attempt)) in self.seeds:
            attempt += 1  # a collision would break the join with the server log
        self.seeds.add(value)
        return value

    def actor(self, name: str, persona: str, observer: Observer, mix: dict,
              main: bool) -> Actor:
        self.actors[name] = Actor(self, name, persona, observer, mix, main)
        return self.actors[name]

    def tokens(self, n: int) -> int:
        return count(n, self.scale, 16)

    def task(self, observer: Observer, what: str) -> str:
        paths = ", ".join(observer.code[:: max(1, len(observer.code) // 4)][:4])
        return (f"{what} The relevant code is around {paths}. Work step by step, run the "
                "tests, and tell me what you changed.")

    def build(self) -> dict:
        s = self.scale
        a = self.actor("A", "cc", self.areas[0], MIXES[0], main=True)
        b = self.actor("B", "qc", self.areas[1], MIXES[1], main=True)
        c = self.actor("C", "cc", self.areas[2], MIXES[2], main=True)

        a.resume(self.tokens(85000), self.task(a.observer, "Profile and speed up the hot path."))
        a.add("signal", name="A_resumed")
        a.add("wait", names=["C_resumed"])
        a.add("join")
        a.loop(7)
        a.fan_out([f"explore-{i}" for i in range(1, count(4, s, 2) + 1)], "explore", 5,
                  "Find every caller of the function we are changing and explain how each "
                  "uses its result.")
        a.loop(9, copy_heavy=1)
        summary_text = ("Summary of the work so far:\n" + a.observer.doc_text(
            self.tokens(2500), offset=5))
        a.request("compact", "compaction", answer=self.tokens(1500), max_tokens=8192,
                  instruction="Summarise the conversation above for a fresh context.",
                  summary=summary_text + "\n\nContinue with the task from this summary.")
        a.est_tokens = estimate_tokens(self.personas["cc"]["system"]) + estimate_tokens(
            summary_text)
        a.request("send", "restart", deliver=None)
        a.add("signal", name="A_restarted")
        a.loop(7)
        a.fan_out([f"explore-{i}" for i in range(count(4, s, 2) + 1, count(4, s, 2) +
                                                 count(3, s, 2) + 1)],
                  "explore", 4, "Check how the tests cover this module and list the gaps.")
        a.add("wait", names=["B_done", "C_done"])
        a.loop(6, copy_heavy=1)
        a.fan_out(["review-2"], "review", 4, "Review the change on this branch.")
        a.turn("final", kind="test", user="Write the pull-request description: what changed, "
               "why, how it was tested, in about 1,500 words. No tools.",
               answer=self.tokens(2000))

        b.add("wait", names=["A_resumed"])
        b.resume(self.tokens(60000), self.task(b.observer, "Add the missing request fields."))
        b.add("signal", name="B_resumed")
        b.add("wait", names=["C_resumed"])
        b.add("join")
        b.loop(3)
        b.request("retry", "retry", replace=True, delay_s=4.0 * s)
        b.loop(2)
        b.request("side", "check", answer=self.tokens(120), max_tokens=256,
                  instruction="Is the agent above stuck in a loop? Answer with the JSON object.")
        b.loop(6, copy_heavy=1)
        b.fan_out(["survey-1", "survey-2"], "explore", 4,
                  "Survey how errors are reported across this package.")
        b.add("wait", names=["A_restarted"])
        b.add("idle", seconds=round(20.0 * s, 3))
        b.turn("after_idle", user="I'm back. Where were we?")
        b.loop(4)
        b.request("side", "check", answer=self.tokens(120), max_tokens=256,
                  instruction="Is the agent above stuck in a loop? Answer with the JSON object.")
        keep = count(20, s)
        b.add("edit", keep=keep, text=CLEARED)
        b.turn("after_edit")
        b.loop(5)
        b.add("signal", name="B_done")

        c.add("wait", names=["B_resumed"])
        c.resume(self.tokens(25000), self.task(c.observer, "Fix the flaky tests."))
        c.add("signal", name="C_resumed")
        c.add("join")
        c.loop(7, copy_heavy=1)
        log = c.observer.pasted_log(c.rng, self.tokens(16000))
        c.grow(log)
        c.request("send", "aborted", deliver={"observation": None, "user": "CI failed, here is "
                  "the log:\n" + log}, abort_after_s=round(1.5 * s, 3))
        c.request("retry", "abort_retry", replace=False, delay_s=4.0 * s)
        c.loop(3, copy_heavy=1)
        c.fan_out(["review-1"], "review", 4, "Review the test changes made so far.")
        c.loop(5)
        c.add("signal", name="C_done")

        self.assign_answer_lengths()
        requests = sum(1 for actor in self.actors.values() for step in actor.steps
                       if "seed" in step)
        return {"format": FORMAT, "version": VERSION, "seed": self.seed, "scale": s,
                "max_answer": self.max_answer,
                "source": self.tree.origin, "personas": self.personas,
                "actors": {name: {"persona": actor.persona, "main": actor.main,
                                  "messages": actor.messages, "steps": actor.steps}
                           for name, actor in self.actors.items()},
                "requests": requests, "warmup_seed": request_seed(self.seed, "warmup", 0)}

    def assign_answer_lengths(self) -> None:
        """Planned lengths of agent turns: log-normal with the production median and p90,
        drawn stratified (one draw per quantile slice, shuffled) so that even a short plan has
        the right median and tail. `max_answer` (CI-sized runs on a CPU) cuts the tail."""
        rng = Random(request_seed(self.seed, "lengths", 0))
        sigma = math.log(P90_ANSWER / MEDIAN_ANSWER) / Z90
        n = len(self.agent_turns)
        quantiles = [(i + rng.random()) / n for i in range(n)]
        rng.shuffle(quantiles)
        for step, q in zip(self.agent_turns, quantiles):
            tokens = MEDIAN_ANSWER * math.exp(sigma * _normal_quantile(q))
            cap = min(AGENT_MAX_TOKENS, self.max_answer or AGENT_MAX_TOKENS)
            step["answer_tokens"] = max(2, min(cap, round(tokens * self.scale)))


def _normal_quantile(q: float) -> float:
    """Inverse standard normal CDF by bisection on erf (stdlib only; 60 halvings is exact to
    double precision on the bracket)."""
    low, high = -10.0, 10.0
    for _ in range(60):
        mid = (low + high) / 2
        if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < q:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def build_plan(tree: SourceTree, seed: int, scale: float, max_answer: int | None = None) -> dict:
    return PlanBuilder(tree, seed, scale, max_answer).build()


def plan_bytes(plan: dict) -> bytes:
    """The canonical plan.json bytes: sorted keys, so equal plans are equal files."""
    return (json.dumps(plan, sort_keys=True, ensure_ascii=False, indent=1) + "\n").encode()
