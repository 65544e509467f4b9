"""Stop strings: where a sample's decoded text ends (vLLM's and SGLang's `stop`).

The host loop decodes a row's tokens after each round; generation stops at the stop string that
appears first as tokens arrive, the one whose first occurrence ENDS earliest in the decoded text (a
tie: the longer, which starts earlier), as a decoder that checks after every token finds it. The
output keeps the fewest tokens whose text holds that occurrence whole (the tokens after it are never
emitted; a round that accepted several tokens past it is cut there), and the text ends before the stop
string (or after it, with `include_stop_str_in_output`). So every method stops where `ar` stops.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence


@dataclasses.dataclass(frozen=True)
class Stop:
    """Where a sample stops: its first `tokens` tokens, its `text`, the stop string `matched`."""

    tokens: int
    text: str
    matched: str


def first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """(start, string) of the stop string whose first occurrence in `text` ends earliest (a tie: the
    longer one), or None."""
    best = None
    for s in stops:
        at = text.find(s)
        if at >= 0 and (best is None or (at + len(s), at) < (best[0] + len(best[1]), best[0])):
            best = (at, s)
    return best


def find_stop(
    ids: list[int], decode: Callable[[list[int]], str], stops: Sequence[str], include: bool
) -> Stop | None:
    """Where the tokens `ids` stop under `stops` (None: no stop string in their text): the fewest
    tokens whose decoded text holds a stop string (a binary search: a longer prefix's text extends a
    shorter one's), the text cut before it (`include`: after it)."""
    if not stops or first_stop(decode(ids), stops) is None:
        return None
    lo, hi = 1, len(ids)  # the fewest tokens with a stop string lie in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if first_stop(decode(ids[:mid]), stops) is None:
            lo = mid + 1
        else:
            hi = mid
    text = decode(ids[:lo])
    at, matched = first_stop(text, stops)
    return Stop(lo, text[: at + len(matched)] if include else text[:at], matched)


def cut_rounds(acceptance: list[int], tokens: int) -> list[int]:
    """The acceptance lengths of the rounds that emitted the first `tokens` tokens (the prefill's
    token first, in no round), the last round cut to the tokens it emitted before the stop."""
    out, total = [], 1
    for a in acceptance:
        if total >= tokens:
            break
        out.append(min(a, tokens - total))
        total += out[-1]
    return out
