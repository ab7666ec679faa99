"""GBNF -> Lark translation: the language each construct accepts, and the error messages.

Checked on a tiny byte-level tokenizer (256 byte tokens, a few merges, three special tokens),
feeding every text both one byte per token and with the merged tokens, so lexeme boundaries fall
both inside and across tokens. The real-vocabulary random walks are in test_constraints.py.
"""

from __future__ import annotations

import json

import pytest

from runtime.text.constraints import ConstraintError, ConstraintSpec
from runtime.text.constraints_compiler import ConstraintCompiler
from runtime.text.constraints_gbnf import gbnf_to_lark
from runtime.text.gbnf_parser import GbnfError
from tools.tokenizer_json import byte_to_unicode

MERGES = [("i", "n"), ("in", "g"), ("a", "b"), ("(", "(")]
SPECIALS = ["<think>", "</think>", "<|im_end|>"]
THINK, THINK_END, IM_END = 256 + len(MERGES), 257 + len(MERGES), 258 + len(MERGES)


def _tiny_tokenizer_json() -> bytes:
    table = byte_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    for left, right in MERGES:
        vocab[left + right] = len(vocab)
    added = [{"id": len(vocab) + i, "content": text, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True}
             for i, text in enumerate(SPECIALS)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                  "use_regex": False}
    return json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [[a, b] for a, b in MERGES]},
    }).encode()


@pytest.fixture(scope="module")
def compiler():
    return ConstraintCompiler(_tiny_tokenizer_json(), vocab_size=288, eos_ids=[IM_END])


def accepts(compiler, grammar: str, text: str) -> bool:
    """Whether the whole of `text` is a complete answer, checked byte by byte and with merged
    tokens; both ways must agree. (Commit checks the grammar; the mask would also insist on the
    canonical tokenization of forced text, which byte-by-byte feeding is not.)"""
    results = []
    for ids in (list(text.encode()), compiler.tokenizer.tokenize_str(text, parse_special=True)):
        constraint = compiler.compile(ConstraintSpec.grammar(grammar))
        try:
            for token in ids:
                constraint.commit(token)
            results.append(constraint.is_accepting())
        except ConstraintError:
            results.append(False)
    assert results[0] == results[1], f"byte / merged tokenizations disagree on {text!r}"
    return results[0]


CASES = {
    "literal escapes": (r'root ::= "a\"b\\c\n\t\x41\u00e9\U0001F600"' + "\n",
                        ['a"b\\c\n\tAé😀'], ["a\"b\\c\n\tA", "ab"]),
    "classes": (r"root ::= [a-cx\]\-] [^\n0-9] [\u0400-\u04FF]" + "\n",
                ["a!ж", "]zЯ", "-\tд"], ["d!ж", "a\nж", "a5ж", "a!z"]),
    "dot any char": ('root ::= "<" . ">"\n', ["<\n>", "<😀>", "<a>"], ["<>", "<ab>"]),
    "repetition": ('root ::= "a"{3} "b"{2,} "c"{1,3} "d"{,2} "e"? "f"* "g"+\n',
                   ["aaabbcg", "aaabbbbcccddeffgg"], ["aabbcg", "aaabcg", "aaabbccccg",
                                                     "aaabbcdddg", "aaabbc"]),
    "groups, multi-line, comments": (
        '# leading comment\nroot ::= ( "x" | "y" "z" )+   # trailing\n'
        '  | "w"\n  # a comment between\n\n', ["x", "yzx", "w"], ["", "y", "wx"]),
    "names and forward references": (
        'root ::= my-rule_2 other\nother ::= "!"\nmy-rule_2 ::= "ok"\n', ["ok!"], ["ok"]),
    "empty alternative": ('root ::= "a" | \nunused ::= "b"\n', ["a", ""], ["b"]),
    "balanced parens": ('root ::= "(" root ")" root | ""\n', ["", "()", "(())()", "((()))"],
                        ["(", "())", ")("]),
    "left recursion": ('root ::= list\nlist ::= list "," item | item\nitem ::= [0-9]+\n',
                       ["1", "1,22,333"], ["", "1,", ",1"]),
    "mutual recursion": ('root ::= a\na ::= "[" b? "]"\nb ::= a ("," a)*\n',
                         ["[]", "[[],[[]]]"], ["[", "[],[]", "[,]"]),
    "regular root meets suffix": ('root ::= [a-z]* "ing"\n', ["ing", "sing", "singing"],
                                  ["sin", "ingx"]),
    "suffix inside recursive rule": ('root ::= "(" [a-z]* "ing" root? ")"\n',
                                     ["(sing)", "(singing(ing))"], ["(sin)", "(ing"]),
    "unicode repetition": ("root ::= [α-ω]{2,3} \"-\" [^a-z]+\n", ["αβ-Ж1", "ωωω-😀"],
                           ["α-1", "αβγδ-1", "αβ-a"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_language(compiler, name):
    grammar, good, bad = CASES[name]
    for text in good:
        assert accepts(compiler, grammar, text), f"{name}: rejected {text!r}"
    for text in bad:
        assert not accepts(compiler, grammar, text), f"{name}: accepted {text!r}"


def test_token_syntax(compiler):
    grammar = 'root ::= <think> "x" !<think> </think> "y" <[' + str(IM_END - 1) + "]>\n"
    constraint = compiler.compile(ConstraintSpec.grammar(grammar))
    for token in [THINK, ord("x"), ord("q"), THINK_END, ord("y"), THINK_END]:
        assert constraint.allowed_mask(288)[token]
        constraint.commit(token)
    assert constraint.is_accepting()
    negated = compiler.compile(ConstraintSpec.grammar('root ::= "x" !<think>\n'))
    negated.commit(ord("x"))
    mask = negated.allowed_mask(288)
    assert not mask[THINK] and mask[THINK_END] and mask[ord("a")]
    with pytest.raises(ConstraintError, match=r"unknown special token <nope>"):
        compiler.compile(ConstraintSpec.grammar('root ::= !<nope>\n'))


def test_regular_parts_become_single_terminals():
    lark = gbnf_to_lark('root ::= "(" [a-z]* "ing" root? ")"\n')
    # The run `"(" [a-z]* "ing"` is one terminal, so the regex engine sees it whole.
    assert any(line.startswith("T1: (/") and "ing" in line for line in lark.splitlines())
    assert "start: ROOT" in gbnf_to_lark('root ::= [a-z]* "ing"\n')


@pytest.mark.parametrize("grammar, message", [
    ('root = "a"\n', "line 1, column 6: expected '::=' after rule name 'root'"),
    ('root ::= "abc\n', "line 1, column 14: newline inside a string literal"),
    ('root ::= "abc', "line 1, column 10: unterminated string literal"),
    ("root ::= [abc\n", "unterminated character class|newline"),
    ("root ::= []\n", "empty character class"),
    (r'root ::= "\q"' + "\n", r"unknown escape \\q"),
    (r'root ::= "\x4"' + "\n", r"\\x needs exactly 2 hex digits"),
    ("root ::= [z-a]\n", "line 1, column 10: character range 'z'-'a' is reversed"),
    ('root ::= "a"{3,1}\n', "has max below min"),
    ('root ::= "a"{x}\n', "malformed repetition"),
    ('root ::= ("a"\n', "expected '\\)' to close the group"),
    ('root ::= "a")\n', "unmatched '\\)'"),
    ('root ::= "a" @\n', "unexpected character '@'"),
    ('root ::= "a"\n\nother ::= b\n', "line 3, column 11: rule 'b' is used but never defined"),
    ('root ::= "a"\nroot ::= "b"\n', "line 2: rule 'root' is defined twice"),
    ('main ::= "a"\n', "no 'root' rule"),
    ("root ::= <think\n", "unterminated token reference"),
])
def test_syntax_errors_name_line_and_column(grammar, message):
    with pytest.raises(GbnfError, match=message):
        gbnf_to_lark(grammar)
