"""Simulated time and rank threads: one OS thread per rank, one simpy clock, a baton passed between them."""

from simdist.clock.baton import Baton, RankAbort, RankState, current_rank_state
from simdist.clock.ranktime import RankTime
from simdist.clock.sites import caller_site

__all__ = ["Baton", "RankAbort", "RankState", "RankTime", "caller_site", "current_rank_state"]
