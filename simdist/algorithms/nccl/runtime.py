"""What NCCL 2.21.5 runs once its tuner has chosen: the chunks of an NVLS all-reduce and the pipeline they fill.

The tuner prices a call as ``latency + bytes / bandwidth`` (:mod:`simdist.algorithms.nccl.tuning`), a pipeline
already full. An NVLS all-reduce in one node is a pipeline of three groups of warps per channel
(``RunWorkElement<AllReduce, NVLS, Simple>``, src/device/all_reduce.h 362-430): scatter warps copy a chunk per
head into the heads' NVLS buffers, reduce warps reduce it in the switch and broadcast the sum
(``multimem``), gather warps copy the sum out. One loop of a channel moves ``heads x chunk`` bytes through the
three stages, so a call of ``k`` loops per channel takes ``k + 2`` loop times, where the tuner counts ``k``;
and the chunk shrinks to 16-64 KiB for mid-size buffers (``computeCollChunkInfo``, src/enqueue.cc 1742-1750),
so those two extra loop times weigh most between 1 and 64 MiB. The NVLS-tree all-reduce across nodes is the
same pipeline with a fourth stage (the reduce warps send to the network, other warps receive and broadcast;
all_reduce.h 498-600) and chunks of its own (enqueue.cc 1751-1762).

Rings and trees fill their pipeline step by step, which the tuner counts (``2(n-1)`` hardware latencies for a
ring all-reduce). Below ``channels x threads x threshold`` bytes NCCL runs them on fewer channels and threads
(``getChannnelThreadInfo``, src/enqueue.cc 1566-1614); the times do not follow it (docs/nccl.md says why).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Runtime:
    """NCCL's run-time constants the model's times use beyond the tuner's (defaults as NCCL 2.21.5 ships them)."""

    #: CTAs (channels) of an NVLS call: ``NCCL_NVLS_NCHANNELS``, default 16 (src/transport/nvls.cc 232)
    nvls_channels: int = 16
    #: largest NVLS chunk, bytes: ``NCCL_NVLS_CHUNKSIZE``, default 128 KiB (src/transport/nvls.cc 233)
    nvls_chunk_size: int = 128 << 10
    #: Simple protocol's buffer per connection, bytes: ``NCCL_BUFFSIZE``, default 4 MiB (src/init.cc 544), in
    #: ``NCCL_STEPS`` = 8 steps (src/include/device.h 22)
    simple_buffsize: int = 4 << 20
    #: stages of the NVLS all-reduce's pipeline in one node: scatter, reduce-and-broadcast, gather warps
    nvls_stages: int = 3
    #: stages of the NVLS-tree all-reduce's pipeline: scatter, reduce-and-send to the network, receive-and-
    #: broadcast, gather warps (src/device/all_reduce.h 498-600)
    nvls_tree_stages: int = 4
    #: largest NVLS-tree chunk from 4 nodes up, bytes: ``NCCL_NVLSTREE_MAX_CHUNKSIZE``'s default
    #: (src/enqueue.cc 1720, 1755-1756)
    nvls_tree_max_chunk_4_nodes: int = 64 << 10


DEFAULT = Runtime()
"""NCCL's defaults; a communicator whose environment changes none of them runs with these."""

_STEPS = 8


def nvls_chunk(nbytes: int, heads: int, rt: Runtime = DEFAULT) -> int:
    """The chunk (bytes per head) NCCL's NVLS all-reduce of ``nbytes`` in one node uses
    (``computeCollChunkInfo``, src/enqueue.cc 1722-1750)."""
    chunk = min(rt.simple_buffsize // _STEPS, rt.nvls_chunk_size)
    concurrent = rt.nvls_channels * heads
    if nbytes < 64 * concurrent * chunk and chunk > 65536:
        chunk = 65536
    if nbytes < 8 * concurrent * chunk and chunk > 32768:
        chunk = 32768
    if nbytes < 2 * concurrent * chunk and chunk > 16384:
        chunk = 16384
    return chunk


def nvls_tree_chunk(nbytes: int, heads: int, nodes: int, rt: Runtime = DEFAULT) -> int:
    """The chunk (bytes per head) NCCL's NVLS-tree all-reduce of ``nbytes`` uses (``computeCollChunkInfo``,
    src/enqueue.cc 1751-1762)."""
    chunk = rt.nvls_chunk_size
    if nodes >= 4:
        chunk = min(chunk, rt.nvls_tree_max_chunk_4_nodes)
    concurrent = rt.nvls_channels * heads
    for factor, floor in ((32, 262144), (16, 131072), (4, 65536), (1, 32768)):
        if nbytes < factor * concurrent * chunk and chunk > floor:
            chunk = floor
    return chunk


def nvls_fill(nbytes: int, heads: int, nodes: int, bandwidth: float, rt: Runtime = DEFAULT) -> float:
    """Seconds an NVLS (one node) or NVLS-tree (several) all-reduce of ``nbytes`` takes beyond the tuner's time:
    the pipeline's first loop passing all its stages but the last, at the tuner's ``bandwidth`` (bytes/s)
    shared by the channels. Never decreasing in ``nbytes``: the chunk only grows with the size."""
    if nodes == 1:
        chunk, stages = nvls_chunk(nbytes, heads, rt), rt.nvls_stages
    else:
        chunk, stages = nvls_tree_chunk(nbytes, heads, nodes, rt), rt.nvls_tree_stages
    per_channel = nbytes / rt.nvls_channels
    return (stages - 1) * min(heads * chunk, per_channel) / (bandwidth / rt.nvls_channels)
