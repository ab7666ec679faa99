"""Stop conditions and the streaming stop-string matcher."""

from __future__ import annotations

import random

import pytest

from runtime.text.stops import StopConditions, StopStringMatcher


def _run(stops, chunks):
    matcher = StopStringMatcher(stops)
    out = []
    for chunk in chunks:
        text, hit = matcher.push(chunk)
        out.append(text)
        if hit is not None:
            return "".join(out), hit
    return "".join(out) + matcher.release(), None


def test_build_normalises_inputs():
    conditions = StopConditions.build("END", ["a", "", "a", "b"], [3, 3, 7])
    assert conditions.stop_strings == ("END",)
    assert conditions.reasoning_stop_strings == ("a", "b")
    assert conditions.stop_token_ids == {3, 7}
    assert conditions.end_ids([248046, 248044]) == {3, 7, 248044, 248046}
    assert StopConditions.build() == StopConditions()
    with pytest.raises(TypeError):
        StopConditions.build([1])


def test_match_split_over_chunks_is_never_leaked():
    assert _run(["STOP"], ["abc S", "T", "OP tail"]) == ("abc ", "STOP")
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("abc ST") == ("abc ", None)
    assert matcher.held == "ST"
    assert matcher.push("ART") == ("START", None)
    assert matcher.push("x") == ("x", None)


def test_earliest_match_wins_and_overlaps():
    assert _run(["abcd", "bc"], ["abc"]) == ("a", "bc")
    assert _run(["cd", "abcdef"], ["ab", "cdef"]) == ("", "abcdef")
    assert _run(["cd", "abcdef"], ["ab", "cdx"]) == ("ab", "cd")
    assert _run(["aab"], ["a", "a", "a", "b"]) == ("a", "aab")
    assert _run(["\n\n"], ["line\n", "\n", "more"]) == ("line", "\n\n")


def test_no_match_releases_everything():
    assert _run(["xyz"], ["xy", "z" * 0, "a"]) == ("xya", None)
    assert _run([], ["anything"]) == ("anything", None)
    assert _run(["Stop"], ["unicode é中", "😀 Sto"]) == ("unicode é中😀 Sto", None)


def test_after_a_match_nothing_more():
    matcher = StopStringMatcher(["X"])
    assert matcher.push("aXb") == ("a", "X")
    assert matcher.push("more") == ("", None)
    assert matcher.matched == "X" and not matcher.active and matcher.release() == ""


def test_random_chunking_agrees_with_a_whole_search():
    rng = random.Random(5)
    alphabet = "ab\n "
    for _ in range(500):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        chunks = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        found = [(text.find(s), -len(s), s) for s in stops if s in text]
        if found:
            at, _, stop = min(found)
            assert _run(stops, chunks) == (text[:at], stop)
        else:
            assert _run(stops, chunks) == (text, None)


def test_long_stop_strings():
    stop = "=" * 300 + " END"
    assert _run([stop, "zz"], ["a" + "=" * 150, "=" * 150, " EN", "D tail"]) == ("a", stop)
    assert _run([stop], ["=" * 300, " ENx"]) == ("=" * 300 + " ENx", None)
