"""`infernix` end to end on tiny models with --device cpu: the output contract, determinism
against a direct NumpyRunner loop, seeded sampling, the thinking budget's exact insertion, stop
strings, a constrained run, and every option and input error path (one line, exit code 2).

The CLI runs in-process (`runtime.cli.main` with captured streams); one test runs it as a real
subprocess to check the stdout / stderr split and the console script module path.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime.cli import main

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Say something."


def run_cli(*args: str) -> tuple[int, str, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    code = main([str(a) for a in args], stdout=stdout, stderr=stderr)
    return code, stdout.getvalue(), stderr.getvalue()


def token_ids(stderr: str) -> list[int]:
    match = re.search(r"^token ids ?(.*)$", stderr, re.M)
    assert match, stderr
    return [int(t) for t in match.group(1).split()]


def finish_reason(stderr: str) -> str:
    match = re.search(r"\| finish (\w+)", stderr)
    assert match, stderr
    return match.group(1)


@pytest.fixture(scope="module")
def model(tiny_dense_path) -> Path:
    return Path(tiny_dense_path)


@pytest.fixture(scope="module")
def text_layer(model):
    from runtime.artifact import open_artifact
    from runtime.text.chat import load_chat_template
    from runtime.text.tokenizer import Tokenizer

    artifact = open_artifact(model)
    resources = artifact.component("text").resources
    tokenizer = Tokenizer.from_artifact_resources(resources)
    return tokenizer, load_chat_template(resources)


def direct_greedy(model: Path, prompt_ids: list[int], max_new: int, eos) -> list[int]:
    """The reference: a plain prefill + argmax decode loop on a fresh NumpyRunner."""
    from runtime.model.numpy_runner import NumpyRunner
    from runtime.model.runner import DecodeItem, PrefillChunk

    runner = NumpyRunner.from_artifact(model, num_pages=8, num_slots=1)
    pages = list(range(8))
    runner.reset_slot(0)
    logits = runner.prefill(PrefillChunk(0, prompt_ids, 0, pages))
    out = [int(np.argmax(logits[-1]))]
    while len(out) < max_new and out[-1] not in eos:
        pos = len(prompt_ids) + len(out) - 1
        logits = runner.decode([DecodeItem(0, out[-1], pos, pages)])
        out.append(int(np.argmax(logits[0])))
    return out


# --- runs that generate --------------------------------------------------------------------------

def test_greedy_is_deterministic_and_equals_a_direct_runner_loop(model, text_layer):
    tokenizer, template = text_layer
    args = (model, "--device", "cpu", "--prompt", PROMPT, "--greedy", "--max-new", "24",
            "--print-token-ids")
    code, out1, err1 = run_cli(*args)
    assert code == 0, err1
    code, out2, err2 = run_cli(*args)
    assert code == 0 and out1 == out2 and token_ids(err1) == token_ids(err2)
    prompt_ids = template.render_ids(tokenizer, [{"role": "user", "content": PROMPT}])
    assert token_ids(err1) == direct_greedy(model, prompt_ids, 24, tokenizer.eos_ids)
    assert re.search(r"prompt tokens \d+ \| output tokens \d+", err1)
    assert "time to first token" in err1 and "decode" in err1 and "tok/s" in err1


def test_seeded_sampling_is_reproducible(model):
    base = (model, "--device", "cpu", "--prompt", PROMPT, "--max-new", "24", "--temperature",
            "1.0", "--top-k", "0", "--print-token-ids")
    first = token_ids(run_cli(*base, "--seed", "7")[2])
    again = token_ids(run_cli(*base, "--seed", "7")[2])
    other = token_ids(run_cli(*base, "--seed", "8")[2])
    assert first == again and first != other


def test_thinking_budget_inserts_exactly_the_close_span(model, text_layer):
    from runtime.session import THINKING_CLOSE_TEXT

    tokenizer, _ = text_layer
    close = tokenizer.encode(THINKING_CLOSE_TEXT)
    budget = 6
    code, out, err = run_cli(model, "--device", "cpu", "--prompt", PROMPT, "--greedy",
                             "--thinking-budget", budget, "--max-new", budget + len(close) + 8,
                             "--print-token-ids")
    assert code == 0, err
    ids = token_ids(err)
    end_ids = {tokenizer.special.think_end} | set(tokenizer.eos_ids)
    assert not end_ids & set(ids[:budget]), "pick another prompt: the model closed by itself"
    assert ids[budget:budget + len(close)] == close
    # The guidance is published as reasoning (stderr), never as the answer.
    assert "Considering the limited time" in err and "Considering" not in out
    assert "closed by the thinking budget" in err


def test_thinking_budget_without_room_is_rejected(model):
    code, out, err = run_cli(model, "--device", "cpu", "--prompt", PROMPT,
                             "--thinking-budget", "10", "--max-new", "12")
    assert code == 2 and out == ""
    assert err.strip().splitlines()[-1].startswith("infernix: error:")
    assert "thinking budget" in err


def test_stop_string_ends_the_answer_without_leaking_it(model):
    base = (model, "--device", "cpu", "--prompt", PROMPT, "--greedy", "--no-thinking",
            "--max-new", "40")
    code, full, err = run_cli(*base)
    assert code == 0, err
    text = full.rstrip("\n")
    stop = next(text[i:i + 2] for i in range(6, len(text) - 2) if text[i:i + 2].strip()
                and text.find(text[i:i + 2]) == i)
    code, out, err = run_cli(*base, "--stop", stop)
    assert code == 0, err
    assert out.rstrip("\n") == text[:text.index(stop)]
    assert finish_reason(err) == "stop"


def _reasoning(stderr: str) -> str:
    """The reasoning text: stderr between the engine-ready line and the report."""
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("engine ready"))
    end = next(i for i, line in enumerate(lines) if line.startswith("prompt tokens"))
    return "\n".join(lines[start + 1:end])


def test_reasoning_stop_ends_the_output_inside_the_thinking(model):
    base = (model, "--device", "cpu", "--prompt", PROMPT, "--greedy", "--max-new", "30")
    code, out, err = run_cli(*base)
    assert code == 0, err
    reasoning = _reasoning(err)
    stop = next(reasoning[i:i + 2] for i in range(4, len(reasoning) - 2)
                if reasoning[i:i + 2].strip() and "\n" not in reasoning[i:i + 2]
                and reasoning.find(reasoning[i:i + 2]) == i)
    code, out, err = run_cli(*base, "--reasoning-stop", stop)
    assert code == 0, err
    assert out == "" and finish_reason(err) == "stop"
    assert _reasoning(err).rstrip("\n") == reasoning[:reasoning.index(stop)].rstrip("\n")


def test_raw_output_shows_the_markers(model):
    code, out, err = run_cli(model, "--device", "cpu", "--prompt", PROMPT, "--greedy",
                             "--thinking-budget", "3", "--max-new", "120", "--raw-output")
    assert code == 0, err
    assert "</think>" in out and "Considering the limited time" in out


def test_choice_constraint_after_thinking(model):
    code, out, err = run_cli(model, "--device", "cpu", "--prompt", "Yes or no?",
                             "--thinking-budget", "4", "--max-new", "150", "--seed", "3",
                             "--choice", "yes", "--choice", "no")
    assert code == 0, err
    assert out.strip() in ("yes", "no"), (out, err)
    assert finish_reason(err) == "stop"


def test_regex_constraint(model):
    code, out, err = run_cli(model, "--device", "cpu", "--prompt", "Ticket?", "--no-thinking",
                             "--regex", "(BUG|TASK)-[0-9]{4}", "--max-new", "30")
    assert code == 0, err
    assert re.fullmatch(r"(BUG|TASK)-[0-9]{4}", out.strip()), out


def test_messages_file_with_history_and_tools(model, tmp_path):
    messages = {
        "messages": [
            {"role": "system", "content": "Answer concisely."},
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
             "tool_calls": [{"type": "function", "function": {
                 "name": "weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
            {"role": "developer", "content": "Be brief."},
        ],
        "tools": [{"type": "function", "function": {
            "name": "weather", "description": "weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
    }
    path = tmp_path / "messages.json"
    path.write_text(json.dumps(messages))
    code, out, err = run_cli(model, "--device", "cpu", "--messages", path, "--max-new", "8",
                             "--greedy", "--json-object")
    assert code == 0, err
    assert re.search(r"prompt tokens (\d+)", err)


def test_config_file_options_are_logged(model, tmp_path):
    config = tmp_path / "infernix.toml"
    config.write_text(f'model = "{model}"\ndevice = "cpu"\n[cli]\nmax-new = 3\ngreedy = true\n')
    code, out, err = run_cli("--config", config, "--prompt", PROMPT, "--print-token-ids")
    assert code == 0, err
    assert "options from" in err and "max-new" in err
    assert len(token_ids(err)) <= 3


def test_demo_builds_the_model_once_into_the_cache(model, tmp_path, monkeypatch):
    import shutil

    import tools.make_tiny

    calls = []

    def fake_make_tiny(out_path, *, hf_dir, **kw):
        # The real one takes ~15 s (real vocabulary); the small tiny model stands in for it.
        calls.append(kw)
        Path(hf_dir).mkdir()
        shutil.copy(model, out_path)
        return Path(out_path)

    monkeypatch.setenv("INFERNIX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tools.make_tiny, "make_tiny", fake_make_tiny)
    errors = []
    for _ in range(2):
        code, out, err = run_cli("--demo", "--prompt", PROMPT, "--max-new", "2")
        assert code == 0, err
        assert "demo" in err and "device cpu" in err
        errors.append(err)
    assert [{k: v for k, v in call.items() if k != "on_phase"} for call in calls] == [
        {"family": "dense", "vocab": "real", "seed": 0, "log": None}]
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [
        "demo-tiny-dense-real-seed0.infernix"]
    # The first run says it is building (it takes seconds), before the model is loaded.
    first = errors[0]
    assert first.index("building the demo model once") < first.index("demo model built") \
        < first.index("loading ")
    assert "building" not in errors[1] and "demo model built" not in errors[1]


def test_demo_answers_without_thinking_unless_asked(model, tmp_path, monkeypatch):
    """The random model thinks until --max-new, so `infernix --demo --prompt Hello` printed
    nothing on stdout: the demo turns thinking off unless a thinking option asks for it."""
    import shutil

    import tools.make_tiny

    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy(model, cache / "demo-tiny-dense-real-seed0.infernix")
    monkeypatch.setenv("INFERNIX_CACHE", str(cache))
    monkeypatch.setattr(tools.make_tiny, "make_tiny", None)  # the cached model is used
    code, out, err = run_cli("--demo", "--prompt", PROMPT, "--max-new", "2",
                             "--log-level", "debug")
    assert code == 0, err
    assert "demo: thinking off, so the answer shows on stdout" in err
    assert "non-thinking mode" in err
    code, out, err = run_cli("--demo", "--prompt", PROMPT, "--max-new", "2",
                             "--reasoning-effort", "low", "--log-level", "debug")
    assert code == 0, err
    assert "demo: thinking off" not in err and ", thinking mode" in err


def test_demo_on_cuda_says_why_it_runs_on_the_cpu(model, tmp_path, monkeypatch):
    import shutil

    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy(model, cache / "demo-tiny-dense-real-seed0.infernix")
    monkeypatch.setenv("INFERNIX_CACHE", str(cache))
    code, out, err = run_cli("--demo", "--device", "cuda", "--prompt", PROMPT, "--max-new", "2")
    assert code == 0, err
    assert "--demo runs on the CPU, not --device cuda: no GPU kernels are built" in err
    assert "device cpu" in err


def test_subprocess_keeps_stdout_for_the_answer_only(model):
    result = subprocess.run(
        [sys.executable, "-m", "runtime.cli", str(model), "--device", "cpu", "--prompt", PROMPT,
         "--greedy", "--no-thinking", "--max-new", "6", "--log-colours", "off"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "engine ready" in result.stderr and "prompt tokens" in result.stderr
    assert "engine ready" not in result.stdout and "tok/s" not in result.stdout
    assert "\x1b[" not in result.stderr and "\r" not in result.stderr


def test_a_closed_stdout_ends_the_run_quietly(model):
    """`infernix ... | head -c 1`: once the reader is gone the run stops with 141 (as after
    SIGPIPE) and no traceback. The regex forces 1,500 tokens, so writing continues well after
    the read end is closed."""
    process = subprocess.Popen(
        [sys.executable, "-m", "runtime.cli", str(model), "--device", "cpu", "--prompt", PROMPT,
         "--no-thinking", "--regex", "x{1500}", "--max-new", "1600", "--max-context", "2048"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout.read(1) == b"x"
    process.stdout.close()
    _, err = process.communicate(timeout=120)
    assert process.returncode == 141, err.decode()
    assert b"Traceback" not in err and b"BrokenPipe" not in err


# --- option and input errors: one line, exit code 2 ---------------------------------------------

def _messages_file(tmp_path, content) -> Path:
    path = tmp_path / "m.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


ERROR_CASES = {
    "no model": ([], "no model given"),
    "demo and model": (["{model}", "--demo"], "--demo"),
    "no input": (["{model}"], "exactly one of --prompt and --messages"),
    "both inputs": (["{model}", "--prompt", "x", "--messages", "{messages}"],
                    "mutually exclusive"),
    "unknown option": (["{model}", "--prompt", "x", "--frobnicate"], "unrecognized"),
    "bad integer": (["{model}", "--prompt", "x", "--max-new", "many"], "--max-new"),
    "out of range": (["{model}", "--prompt", "x", "--top-k", "21"], "--top-k"),
    "bad choice": (["{model}", "--prompt", "x", "--kv-dtype", "int3"], "--kv-dtype"),
    "effort conflict": (["{model}", "--prompt", "x", "--no-thinking", "--reasoning-effort",
                         "high"], "cannot be combined with --no-thinking"),
    "budget no thinking": (["{model}", "--prompt", "x", "--no-thinking", "--thinking-budget",
                            "5"], "--thinking-budget"),
    "budget effort none": (["{model}", "--prompt", "x", "--reasoning-effort", "none",
                            "--thinking-budget", "5"], "--thinking-budget"),
    "loop no thinking": (["{model}", "--prompt", "x", "--no-thinking", "--reasoning-loop",
                          "stop"], "--reasoning-loop"),
    "two constraints": (["{model}", "--prompt", "x", "--json-object", "--regex", "a"],
                        "mutually exclusive"),
    "constraint and stop": (["{model}", "--prompt", "x", "--choice", "a", "--stop", "b"],
                            "--stop"),
    "constraint and stop id": (["{model}", "--prompt", "x", "--regex", "a",
                                "--stop-token-id", "3"], "--stop-token-id"),
    "constraint and reasoning stop": (["{model}", "--prompt", "x", "--json-object",
                                       "--reasoning-stop", "b"], "--reasoning-stop"),
    "constraint and raw": (["{model}", "--prompt", "x", "--json-object", "--raw-output"],
                           "--raw-output"),
    "regex with tools": (["{model}", "--messages", "{tools_messages}", "--regex", "a"],
                         "requires no tools"),
    "missing schema": (["{model}", "--prompt", "x", "--json-schema-file", "/nonexistent.json"],
                       "does not exist"),
    "invalid schema": (["{model}", "--prompt", "x", "--json-schema-file", "{bad_json}"],
                       "schema"),
    "missing messages": (["{model}", "--messages", "/nonexistent.json"], "does not exist"),
    "messages not json": (["{model}", "--messages", "{bad_json}"], "not valid JSON"),
    "empty messages": (["{model}", "--messages", "{empty_messages}"], "non-empty"),
    "bad role": (["{model}", "--messages", "{bad_role}"], "role"),
    "image part": (["{model}", "--messages", "{image_messages}"], "vision"),
    "prefill chunk": (["{model}", "--prompt", "x", "--prefill-chunk", "100"], "multiple of 64"),
    "bad device": (["{model}", "--prompt", "x", "--device", "tpu"], "--device"),
    "cuda without a gpu": (["{model}", "--prompt", "x", "--device", "cuda"], "no CUDA GPU"),
    "synthetic on cpu": (["{model}", "--prompt", "x", "--device", "cpu", "--synthetic-weights", "3"],
                         "--synthetic-weights fills weights on the GPU"),
    "synthetic seed negative": (["{model}", "--prompt", "x", "--synthetic-weights", "-1"],
                                "--synthetic-weights"),
    "synthetic shape without weights": (["{model}", "--prompt", "x", "--device", "cpu",
                                         "--synthetic-shape", "qwen3.6-27b"],
                                        "give --synthetic-weights SEED too"),
    "missing template": (["{model}", "--prompt", "x", "--chat-template", "/nonexistent.jinja"],
                         "--chat-template"),
    "missing model": (["/nonexistent.infernix", "--prompt", "x"], "does not exist"),
    "hugging face directory": (["{hf_dir}", "--prompt", "x"],
                               "is a Hugging Face checkpoint directory; convert it first: "
                               "python -m tools.convert"),
    "plain directory": (["{plain_dir}", "--prompt", "x"], "is a directory, not a .infernix"),
    "missing config": (["--config", "/nonexistent.toml", "--prompt", "x"], "--config"),
    "prompt too long": (["{model}", "--device", "cpu", "--prompt", "word " * 200,
                         "--max-context", "64"], "max context"),
    "bad grammar": (["{model}", "--device", "cpu", "--prompt", "x", "--grammar-file",
                     "{bad_grammar}"], "grammar"),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_option_and_input_errors_exit_2_with_one_line(case, model, tmp_path):
    files = {
        "model": model,
        "messages": _messages_file(tmp_path, [{"role": "user", "content": "x"}]),
        "tools_messages": _messages_file(tmp_path / "..", {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
        "bad_json": tmp_path / "bad.json",
        "empty_messages": tmp_path / "empty.json",
        "bad_role": tmp_path / "role.json",
        "image_messages": tmp_path / "image.json",
        "bad_grammar": tmp_path / "bad.gbnf",
        "hf_dir": model.with_name(model.stem + "-hf"),
        "plain_dir": tmp_path,
    }
    files["bad_json"].write_text("{not json")
    files["empty_messages"].write_text("[]")
    files["bad_role"].write_text(json.dumps([{"role": "robot", "content": "x"}]))
    files["image_messages"].write_text(json.dumps([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "a.png"}}]}]))
    files["bad_grammar"].write_text("root ::= (")
    if case == "cuda without a gpu":
        from runtime.session import gpu_present
        if gpu_present():
            pytest.skip("a GPU is visible: --device cuda is not an error here")
    args, expected = ERROR_CASES[case]
    args = [a.format(**files) for a in args]
    code, out, err = run_cli(*args)
    assert code == 2, (case, err)
    assert out == ""
    last = err.strip().splitlines()[-1]
    assert last.startswith("infernix: error:") and expected in last, (case, err)
