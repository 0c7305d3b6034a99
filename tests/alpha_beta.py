"""Alpha-beta times of all-reduce, written from Thakur, Rabenseifner & Gropp (2005) as an oracle for the tests.

``alpha`` is the latency of one message between two ranks (seconds, the whole path), ``beta`` the time per
byte (seconds/byte, 1 / the path's bandwidth), ``nbytes`` the buffer each rank reduces. The forms hold for an
uncontended network and a world size that is a power of two; they are kept apart from simdist's own estimates
so that a test compares the simulation with the paper, not with the code under test.
"""

from __future__ import annotations


def all_reduce_seconds(algorithm: str, n: int, nbytes: float, alpha: float, beta: float) -> float:
    """Time (s) of an all-reduce of ``nbytes`` on each of ``n`` ranks with ``algorithm``."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"expected a world size that is a power of two, got {n}")
    if n == 1:
        return 0.0
    steps = n.bit_length() - 1  # log2 n
    share = (n - 1) / n * nbytes  # what each rank sends in a reduce-scatter (or an all-gather) of the buffer
    if algorithm == "ring":
        # reduce-scatter then all-gather around the ring: n - 1 steps each, m/n bytes per step
        return 2 * (n - 1) * alpha + 2 * share * beta
    if algorithm == "tree":
        # binomial-tree reduce to one rank, then binomial-tree broadcast: log2 n steps each, whole buffer per step
        return 2 * steps * (alpha + nbytes * beta)
    if algorithm == "rhd":
        # Rabenseifner: reduce-scatter by recursive halving, all-gather by recursive doubling
        return 2 * steps * alpha + 2 * share * beta
    if algorithm == "direct":
        # every rank sends its n - 1 pieces of m/n bytes at once (one latency, all bytes through its one
        # link), in a reduce-scatter phase and then an all-gather phase. Not in the paper; with n > 2 the
        # messages into one rank contend, so a large buffer takes longer than this (a lower bound then)
        return 2 * alpha + 2 * share * beta
    raise ValueError(f"expected one of ring, tree, rhd, direct; got algorithm {algorithm!r}")
