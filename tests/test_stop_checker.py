"""StopStringChecker: hand-checked cases plus streaming properties against naive oracles."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forerun.engine.stop_checker import StopStringChecker


def feed(checker: StopStringChecker, deltas: list[str]) -> tuple[str, str | None, list[str]]:
    """Stream deltas the way the engine does; return (final text, matched stop, streamed)."""
    text = ""
    sent = 0
    streamed: list[str] = []
    for i, delta in enumerate(deltas):
        text += delta
        hit = checker.check(text, len(delta))
        finished = hit is not None or i == len(deltas) - 1
        if hit is not None:
            text = text[: hit[0]]
        upto = checker.streamable_len(len(text), finished)
        if upto > sent:
            streamed.append(text[sent:upto])
            sent = upto
        if hit is not None:
            return text, hit[1], streamed
    return text, None, streamed


def test_no_stop_strings() -> None:
    checker = StopStringChecker([])
    assert checker.check("anything at all", 5) is None
    assert checker.holdback == 0
    assert checker.streamable_len(15, finished=False) == 15


def test_empty_stop_string_rejected() -> None:
    with pytest.raises(ValueError):
        StopStringChecker(["ok", ""])


def test_exclude_and_include() -> None:
    text = "Hello world. Bye"
    assert StopStringChecker(["."]).check(text, len(text)) == (text.index("."), ".")
    assert StopStringChecker(["."], include_stop_str_in_output=True).check(text, len(text)) == (
        text.index(".") + 1,
        ".",
    )


def test_stop_at_very_start() -> None:
    assert StopStringChecker(["<|end|>"]).check("<|end|>", 7) == (0, "<|end|>")
    assert StopStringChecker(["<|end|>"], True).check("<|end|>tail", 11) == (7, "<|end|>")


def test_spanning_two_deltas() -> None:
    checker = StopStringChecker(["STOP"])
    assert checker.check("abcST", 2) is None
    assert checker.check("abcSTOPxyz", 5) == (3, "STOP")
    final, matched, streamed = feed(checker, ["abc", "ST", "OPxyz"])
    assert (final, matched, "".join(streamed)) == ("abc", "STOP", "abc")


def test_old_text_not_searched_again() -> None:
    # A match wholly inside already-checked text was reported before; not again.
    assert StopStringChecker(["ab"]).check("ab" + "cdef", 4) is None
    # But one ending in the new characters is found even if it starts in old text.
    assert StopStringChecker(["ab"]).check("xa" + "b", 1) == (1, "ab")


def test_earliest_match_wins() -> None:
    checker = StopStringChecker(["world", "o w", "Hello"])
    assert checker.check("Hello world", 11) == (0, "Hello")
    assert checker.check("Say: Hello world", 11) == (5, "Hello")
    # Same start: the shorter one ends first, so it is the one that stopped generation.
    assert StopStringChecker(["abc", "ab"], True).check("abcd", 4) == (2, "ab")


def test_overlapping_candidates_in_one_string() -> None:
    checker = StopStringChecker(["aab"])
    assert checker.check("aaab", 4) == (1, "aab")
    assert checker.check("aaaab", 1) == (2, "aab")


def test_duplicates_and_order() -> None:
    checker = StopStringChecker(["x", "yy", "x"])
    assert checker.stop == ("x", "yy")
    assert checker.holdback == 1


def test_holdback_and_streamable_len() -> None:
    checker = StopStringChecker(["###", "<end>"])
    assert checker.holdback == 4
    assert checker.streamable_len(10, finished=False) == 6
    assert checker.streamable_len(3, finished=False) == 0
    assert checker.streamable_len(10, finished=True) == 10
    assert StopStringChecker(["<end>"], include_stop_str_in_output=True).holdback == 0


def test_new_char_count_larger_than_text() -> None:
    assert StopStringChecker(["ab"]).check("ab", 99) == (0, "ab")
    assert StopStringChecker(["ab"]).check("ab", 0) is None


def first_completed(text: str, stops: list[str]) -> tuple[int, int] | None:
    """Oracle for char-by-char streaming: (start, end) of the first stop string to complete."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if text[:end].endswith(s)]
        if starts:
            return min(starts), end
    return None


def random_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 6))))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


small_text = st.text(alphabet="ab<>|x", min_size=1, max_size=30)
stop_lists = st.lists(st.text(alphabet="ab<>|", min_size=1, max_size=4), min_size=1, max_size=3)


@settings(max_examples=300, deadline=None)
@given(text=small_text, stops=stop_lists, include=st.booleans())
def test_char_by_char_stream_matches_oracle(text: str, stops: list[str], include: bool) -> None:
    checker = StopStringChecker(stops, include)
    final, matched, streamed = feed(checker, list(text))
    hit = first_completed(text, stops)
    if hit is None:
        assert (final, matched) == (text, None)
    else:
        start, end = hit
        assert final == text[: end if include else start]
        assert matched == text[start:end]
    assert "".join(streamed) == final


@settings(max_examples=300, deadline=None)
@given(
    text=small_text,
    stop=st.text(alphabet="ab<>|", min_size=1, max_size=4),
    include=st.booleans(),
    seed=st.integers(0, 10**6),
)
def test_single_stop_any_chunking(text: str, stop: str, include: bool, seed: int) -> None:
    # With one stop string, its first occurrence is always the one found, however the
    # text is chunked, and nothing past the kept text is ever streamed.
    checker = StopStringChecker([stop], include)
    final, matched, streamed = feed(checker, random_split(text, random.Random(seed)))
    at = text.find(stop)
    expected = text if at == -1 else text[: at + len(stop) if include else at]
    assert final == expected
    assert matched == (None if at == -1 else stop)
    assert "".join(streamed) == expected


@settings(max_examples=300, deadline=None)
@given(text=small_text, stops=stop_lists, include=st.booleans(), seed=st.integers(0, 10**6))
def test_streamed_text_is_always_final_prefix(
    text: str, stops: list[str], include: bool, seed: int
) -> None:
    checker = StopStringChecker(stops, include)
    final, matched, streamed = feed(checker, random_split(text, random.Random(seed)))
    assert "".join(streamed) == final
    if matched is None:
        assert final == text and not any(s in text for s in stops)
    else:
        # The kept text never contains a complete stop string (besides an included one).
        kept = final[: len(final) - len(matched)] if include else final
        assert not any(s in kept for s in stops)
