"""A few hundred malformed request bodies (mutated fields, broken JSON bytes, deep nesting,
random bytes) against the real server over the scripted fake backend: each is a 200 or a 400
in the API's own error shape, and the server stays healthy."""

from __future__ import annotations

import copy
import json
import random

import httpx
import orjson

from tests.e2e.fake_server_support import USER


def _mutations(rng: random.Random) -> list[bytes]:
    valid = {"/v1/chat/completions": {"model": "m", "messages": USER, "max_tokens": 5},
             "/v1/responses": {"model": "m", "input": "hi", "max_output_tokens": 5},
             "/v1/messages": {"model": "m", "messages": USER, "max_tokens": 5}}
    junk = [None, True, -1, 1e308, "", "x" * 50, [], {}, [None], {"type": None},
            [{"role": 5}], {"role": "user"}, [[[]]], "\u0000\ud7ff", 2 ** 70]
    bodies = []
    for path, body in valid.items():
        for _ in range(90):
            mutated = json.loads(json.dumps(body))
            for _ in range(rng.randint(1, 3)):
                target = mutated
                key = rng.choice(list(target))
                if isinstance(target[key], list) and target[key] and rng.random() < 0.5:
                    target = target[key][0] if isinstance(target[key][0], dict) else target
                    key = rng.choice(list(target)) if target else key
                if rng.random() < 0.2:
                    target.pop(key, None)
                else:
                    target[key] = copy.deepcopy(rng.choice(junk))
                if rng.random() < 0.3:
                    target[rng.choice(["tools", "tool_choice", "stream", "system", "stop",
                                       "thinking", "temperature", "input", "response_format",
                                       "reasoning", "text", "messages"])] = copy.deepcopy(rng.choice(junk))
            bodies.append((path, json.dumps(mutated).encode()))
        raw = orjson.dumps(body)
        for _ in range(20):
            cut = rng.randrange(len(raw))
            bodies.append((path, raw[:cut] + bytes([rng.randrange(256)]) + raw[cut + 1:]))
        bodies.append((path, b"[" * 300 + b"]" * 300))
        bodies.append((path, b'{"messages": ' + b"[" * 2000 + b"]" * 2000 + b"}"))
        bodies.append((path, rng.randbytes(200)))
    return bodies


def test_a_few_hundred_malformed_bodies_never_take_the_server_down(fake_server):
    server = fake_server()
    rng = random.Random(1234)
    statuses = {}
    with httpx.Client(base_url=server.base_url, timeout=10) as client:
        for path, body in _mutations(rng):
            response = client.post(path, content=body,
                                   headers={"content-type": "application/json"})
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code in (200, 400), (path, body[:200], response.text)
            payload = response.json()
            if response.status_code == 400:
                if path == "/v1/messages":
                    assert payload["type"] == "error"
                    assert payload["error"]["type"] == "invalid_request_error"
                else:
                    assert payload["error"]["type"] == "invalid_request_error"
                    assert payload["error"]["message"]
        assert client.get("/health").json() == {"status": "ok"}
    assert sum(statuses.values()) >= 300 and statuses.get(400, 0) > 200
