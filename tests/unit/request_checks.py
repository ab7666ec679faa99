"""Shared by the request-validation tests (tests/unit/test_protocols_*_requests.py and their
neighbours): the capabilities a backend may offer, a one-message conversation, and `rejects`,
which expects an `ApiError` naming the field."""

from __future__ import annotations

import pytest

from protocols.errors import ApiError
from protocols.job import Capabilities

FULL = Capabilities(logprobs=False, constraints=True)
BARE = Capabilities()
USER = [{"role": "user", "content": "hi"}]


def rejects(call, param: str, status: int = 400, *, in_message: bool = True) -> ApiError:
    with pytest.raises(ApiError) as info:
        call()
    assert info.value.status == status
    assert info.value.param == param, info.value.message
    if in_message:
        assert param in info.value.message
    return info.value
