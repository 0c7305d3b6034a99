"""Direct algorithms: every message goes straight to its final rank in one step (n^2 messages at most)."""

from __future__ import annotations

from collections.abc import Sequence

from simdist.algorithms.schedule import Msg, msg, offsets_from_sizes, split_offsets


def reduce_scatter(n: int, off: list[int], step0: int = 0) -> list[Msg]:
    """Every rank sends chunk j straight to rank j, which reduces it."""
    return [msg(r, j, step0, off[j], off[j + 1], "reduce") for r in range(n) for j in range(n) if j != r]


def all_gather(n: int, off: list[int], step0: int = 0) -> list[Msg]:
    """Every rank sends its chunk straight to every other rank."""
    return [msg(r, j, step0, off[r], off[r + 1], "copy") for r in range(n) for j in range(n) if j != r]


def all_reduce(n: int, numel: int) -> list[Msg]:
    """Direct reduce-scatter, then direct all-gather."""
    off = split_offsets(numel, n)
    return reduce_scatter(n, off) + all_gather(n, off, 1)


def broadcast(n: int, numel: int, root: int) -> list[Msg]:
    """The root sends the whole buffer to every other rank."""
    return [msg(root, j, 0, 0, numel, "copy") for j in range(n) if j != root]


def reduce(n: int, numel: int, root: int) -> list[Msg]:
    """Every other rank sends its whole buffer to the root, which reduces them."""
    return [msg(j, root, 0, 0, numel, "reduce") for j in range(n) if j != root]


def gather(n: int, off: list[int]) -> list[Msg]:
    """Relative rank v sends its chunk to the root (relative rank 0)."""
    return [msg(v, 0, 0, off[v], off[v + 1], "copy") for v in range(1, n)]


def scatter(n: int, off: list[int]) -> list[Msg]:
    """The root (relative rank 0) sends chunk v to relative rank v."""
    return [msg(0, v, 0, off[v], off[v + 1], "copy") for v in range(1, n)]


def all_to_all(n: int, send_counts: Sequence[Sequence[int]], recv_counts: Sequence[Sequence[int]]) -> list[Msg]:
    """Pairwise exchange: rank r's block j goes to rank j's block r (self-blocks are the caller's copy).

    ``send_counts[r]`` are rank r's input block sizes (elements), ``recv_counts[j]`` rank j's output block sizes.
    """
    in_off = [offsets_from_sizes(s) for s in send_counts]
    out_off = [offsets_from_sizes(s) for s in recv_counts]
    return [
        Msg(r, j, 0, in_off[r][j], in_off[r][j + 1], out_off[j][r], out_off[j][r + 1], "copy")
        for r in range(n)
        for j in range(n)
        if j != r
    ]
