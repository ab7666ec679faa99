"""`infernix-serve --spec mtp --ngram-draft-tokens N` on the tiny dense model (CPU, 2 lanes):
concurrent seeded answers equal those of a server without speculation, and the rounds show
in the request log (per request) and in /metrics (engine totals)."""

from __future__ import annotations

import json

import httpx

from tests.e2e.conftest import run_concurrently
from tests.e2e.model_serving import cpu_settings, serve_model, stop_model

MESSAGES = [{"role": "user", "content": "Tell me about the quick brown fox."}]


def serve(path, log_path, *spec):
    return serve_model(cpu_settings(path, "--max-context", "512", "--max-concurrency", "2", "--max-new", "24",
                                    *spec), log_path)


def answers(server) -> list[str]:
    def one(n):
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 24, "seed": 100 + n,
                "chat_template_kwargs": {"enable_thinking": False}}
        reply = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120,
                           headers={"Authorization": "Bearer x"})
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["message"]["content"]
    return run_concurrently(one, 3, timeout=180)


SPEC = ("--spec", "mtp", "--draft-tokens", "2", "--ngram-draft-tokens", "4",
        "--ngram-min-match", "4")


def test_speculative_server_answers_and_reports_rounds(tiny_dense_path, tmp_path):
    server = serve(tiny_dense_path, tmp_path / "plain.jsonl")
    try:
        plain = answers(server)
    finally:
        stop_model(server)
    server = serve(tiny_dense_path, tmp_path / "spec.jsonl", *SPEC)
    try:
        assert answers(server) == plain
        metrics = httpx.get(server.base_url + "/metrics", timeout=10).text
    finally:
        stop_model(server)
    records = [json.loads(line) for line in (tmp_path / "spec.jsonl").read_text().splitlines()
               if '"request_done"' in line]
    assert len(records) == 3
    for record in records:
        assert record["spec_rounds"] >= 10, record
        assert record["spec_rounds"] <= record["drafted_tokens"] <= 4 * record["spec_rounds"]
        assert 0 <= record["accepted_tokens"] <= record["drafted_tokens"]
    totals = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("infernix_engine_spec_")}
    assert totals["infernix_engine_spec_rounds_total"] == sum(r["spec_rounds"] for r in records)
    assert totals["infernix_engine_spec_drafted_tokens_total"] == sum(
        r["drafted_tokens"] for r in records)
    plain_records = [json.loads(line) for line in
                     (tmp_path / "plain.jsonl").read_text().splitlines()
                     if '"request_done"' in line]
    assert [r["spec_rounds"] for r in plain_records] == [0, 0, 0]
