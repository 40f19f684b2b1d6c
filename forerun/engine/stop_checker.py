"""Stop-string detection on incrementally growing output text."""

from __future__ import annotations


class StopStringChecker:
    """Finds stop strings in output text as it grows, a delta at a time.

    Only matches that end inside the newly added characters are looked for: anything
    earlier was checked on a previous call. When several stop strings match, the one
    starting earliest wins (then the shortest), so the least text is kept.
    """

    __slots__ = ("_stop", "_include", "_max_len")

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        # Dict keeps the caller's order while dropping duplicates.
        self._stop: tuple[str, ...] = tuple(dict.fromkeys(stop))
        self._include = include_stop_str_in_output
        self._max_len = max((len(s) for s in self._stop), default=0)

    @property
    def stop(self) -> tuple[str, ...]:
        """The stop strings, deduplicated, in the caller's order."""
        return self._stop

    @property
    def holdback(self) -> int:
        """Characters at the end of the text that must not be streamed yet.

        They could be the start of a stop string that would then be cut out of the
        output. When the stop string is kept in the output there is nothing to hide.
        """
        if self._include or not self._stop:
            return 0
        return self._max_len - 1

    def check(self, output_text: str, new_char_count: int) -> tuple[int, str] | None:
        """Look for a stop string ending in the last `new_char_count` characters.

        Returns `(truncate_to, matched_stop)`: the output should be cut to
        `output_text[:truncate_to]`, which excludes the stop string unless
        `include_stop_str_in_output`. Returns None when nothing matched.
        """
        if not self._stop or new_char_count <= 0:
            return None
        old_len = len(output_text) - min(new_char_count, len(output_text))
        best: tuple[int, str] | None = None
        for s in self._stop:
            # A match of s ending at old_len + 1 or later starts at or after this.
            start = max(0, old_len - len(s) + 1)
            at = output_text.find(s, start)
            if at == -1:
                continue
            if best is None or at < best[0] or (at == best[0] and len(s) < len(best[1])):
                best = (at, s)
        if best is None:
            return None
        at, s = best
        return (at + len(s) if self._include else at), s

    def streamable_len(self, text_len: int, finished: bool) -> int:
        """How many characters of a `text_len`-long output may be streamed now."""
        if finished:
            return text_len
        return max(0, text_len - self.holdback)
