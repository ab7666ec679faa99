"""JSON request bodies (`protocols.app.parse_json_body`): nesting past `MAX_JSON_DEPTH` and
bodies that are not a JSON object are a 400 naming the body."""

from __future__ import annotations

import pytest

from protocols.app import MAX_JSON_DEPTH, json_depth, parse_json_body
from tests.unit.request_checks import rejects


def nested(depth: int) -> bytes:
    return b'{"a":' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


def test_json_depth_limit():
    assert json_depth(parse_json_body(nested(MAX_JSON_DEPTH))) == MAX_JSON_DEPTH
    error = rejects(lambda: parse_json_body(nested(MAX_JSON_DEPTH + 1)), "body")
    assert str(MAX_JSON_DEPTH) in error.message
    rejects(lambda: parse_json_body(nested(5000)), "body")


@pytest.mark.parametrize("body", [b"", b"   ", b"{", b"[1, 2]", b'"text"', b"nul",
                                  b'{"a": 1,}', b"\xff\xfe"])
def test_bad_bodies_are_400(body):
    rejects(lambda: parse_json_body(body), "body")
