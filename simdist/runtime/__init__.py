"""A client/worker remote-tensor runtime: the client's autograd tensors live on a worker that runs commands.

``simulate(fn, seed=..., link=LinkSpec(...))`` runs a client function against a worker over a simulated link;
``Client`` and ``Worker`` are the two ends, shared with the real transport in ``real``.
"""

from simdist.runtime.buffering import POLICIES, BufferingWorker, StreamTimes
from simdist.runtime.client import Client, RemoteArray, RemoteError
from simdist.runtime.hotpath import HotPath, OpRecord, PathMatcher, SegmentDetector, signature
from simdist.runtime.sim import Delivery, LinkSpec, SimRuntimeResult, simulate
from simdist.runtime.worker import Worker, WorkerStats

__all__ = [
    "POLICIES",
    "BufferingWorker",
    "Client",
    "Delivery",
    "HotPath",
    "LinkSpec",
    "OpRecord",
    "PathMatcher",
    "RemoteArray",
    "RemoteError",
    "SegmentDetector",
    "SimRuntimeResult",
    "StreamTimes",
    "Worker",
    "WorkerStats",
    "signature",
    "simulate",
]
