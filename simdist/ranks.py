"""Rank lists in messages: ``0-4, 6-1023`` rather than a thousand numbers, so reports stay complete at any scale."""

from __future__ import annotations

from collections.abc import Iterable


def format_ranks(ranks: Iterable[int]) -> str:
    """``rank 5`` or ``ranks 0-3, 6`` (sorted, consecutive runs as ranges)."""
    rs = sorted(set(ranks))
    return ("rank " if len(rs) == 1 else "ranks ") + ranges(rs)


def ranges(ranks: Iterable[int]) -> str:
    """``0-3, 6`` for ``[0, 1, 2, 3, 6]`` (sorted, duplicates dropped)."""
    rs = sorted(set(ranks))
    parts, i = [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ", ".join(parts)


def by_text(items: Iterable[tuple[int, str]]) -> list[tuple[list[int], str]]:
    """Ranks grouped by identical text: the rarest text first (the odd rank out), ties by lowest rank."""
    groups: dict[str, list[int]] = {}
    for rank, text in items:
        groups.setdefault(text, []).append(rank)
    return sorted(((sorted(rs), text) for text, rs in groups.items()), key=lambda g: (len(g[0]), g[0][0]))
