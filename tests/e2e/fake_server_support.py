"""Shared by the fake-server end-to-end tests (tests/e2e/test_server_fake_*.py): the user
message and the weather tool in each API's shape, a slow script for the fake backend, and a
polling wait."""

from __future__ import annotations

import time

from protocols.fake import Script
from runtime.text.events import ContentDelta

USER = [{"role": "user", "content": "What's the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
WEATHER_FLAT = {"type": "function", "name": "get_weather", "description": "Weather",
                "parameters": WEATHER["function"]["parameters"]}
WEATHER_ANTHROPIC = {"name": "get_weather", "description": "Weather",
                     "input_schema": WEATHER["function"]["parameters"]}


def slow(step_s=0.05, prefill_s=0.0, n=200):
    return lambda job: Script(events=[ContentDelta(f"w{i} ") for i in range(n)], step_s=step_s,
                              prefill_s=prefill_s)


def wait_until(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()
