"""A client/worker remote-tensor runtime: the client's autograd tensors live on a worker that runs commands.

``simulate(fn, seed=..., link=LinkSpec(...))`` runs a client function against a worker over a simulated link;
``Client`` and ``Worker`` are the two ends, shared with the real transport in ``real``. A ``BufferingWorker``
runs hot paths as compiled batches; its ``BufferPolicy`` (one of ``POLICIES``, by name) decides what happens
to commands that touch tensors a batch has not stored yet.
"""

from simdist.runtime.buffering import BufferingWorker, StreamTimes
from simdist.runtime.client import Client, RemoteArray
from simdist.runtime.errors import BufferPolicyError, RemoteError, RuntimeConfigError
from simdist.runtime.hotpath import HotPath, OpRecord, PathMatcher, SegmentDetector, signature
from simdist.runtime.policies import (
    POLICIES,
    BufferPolicy,
    EagerIfIndependent,
    FallBackToEager,
    FlushOnBackward,
    FreePlacement,
    OpPlacement,
    SeparateBuffers,
    TrackDependencies,
    buffer_policy,
)
from simdist.runtime.simulated import Delivery, LinkSpec, SimRuntimeResult, simulate, trace_hash
from simdist.runtime.worker import Worker, WorkerStats

__all__ = [
    "POLICIES",
    "BufferPolicy",
    "BufferPolicyError",
    "BufferingWorker",
    "Client",
    "Delivery",
    "EagerIfIndependent",
    "FallBackToEager",
    "FlushOnBackward",
    "FreePlacement",
    "HotPath",
    "LinkSpec",
    "OpPlacement",
    "OpRecord",
    "PathMatcher",
    "RemoteArray",
    "RemoteError",
    "RuntimeConfigError",
    "SegmentDetector",
    "SeparateBuffers",
    "SimRuntimeResult",
    "StreamTimes",
    "TrackDependencies",
    "Worker",
    "WorkerStats",
    "buffer_policy",
    "signature",
    "simulate",
    "trace_hash",
]
