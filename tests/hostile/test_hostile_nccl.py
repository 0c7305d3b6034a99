"""Hostile uses of NCCL's collective model: misspelt NCCL_ALGO/NCCL_PROTO/NCCL_NVLS_ENABLE in rank code, the model asked of a
device or a topology it does not know, and a command line asking for it on a cluster without nodes.

Each case ends in a clear error naming what was wrong and what to use, or in a result checked by an oracle
(NCCL's tuner's own prediction, computed apart from the run)."""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable

import networkx as nx
import pytest
import torch
import torch.distributed as dist
from hostile_cases import Case, check, params

import simdist
from simdist.algorithms import nccl
from simdist.cli import main as simdist_main
from simdist.errors import ClusterSpecError, NcclEnvironmentError


def _all_reduce_with(env: dict[str, str]) -> Callable[[], simdist.RunResult]:
    def rank() -> float:
        os.environ.update(env)
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        t0 = simdist.now()
        dist.all_reduce(torch.ones(1 << 20, device="cuda"))
        return simdist.now() - t0

    cluster = simdist.Cluster.preset("dgx-h100", world_size=8, collective_model="nccl")
    return lambda: simdist.run(rank, cluster, compute=False)


def _no_nodes() -> simdist.RunResult:
    graph = nx.complete_graph(4, nx.DiGraph)
    nx.set_edge_attributes(graph, 100e9, "bandwidth")
    nx.set_edge_attributes(graph, 1e-6, "latency")
    return simdist.run(lambda: dist.all_reduce(torch.ones(4)), simdist.Cluster(graph, collective_model="nccl"))


def _bench_on_ring() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        status = simdist_main(["bench", "--cluster", "ring", "-m", "nccl", "-b", "8", "-e", "8"])
    assert status == 2, out.getvalue()
    raise ClusterSpecError(out.getvalue())


def _only_ring_predicted(res: simdist.RunResult) -> None:
    fab = nccl.fabric("H100", 8, 1, 50e9)
    want = nccl.choose(fab, "all_reduce", 4 << 20, nccl.Enabled(frozenset({"Ring"}))).seconds
    assert max(res.returns) == pytest.approx(want, rel=1e-3)


CASES: list[Case] = [
    Case("nccl-algo-misspelt", "os.environ['NCCL_ALGO'] = 'Rign' in rank code (NCCL itself would ignore it)",
         _all_reduce_with({"NCCL_ALGO": "Rign"}), error=NcclEnvironmentError,
         match=r"rank 0: NCCL_ALGO='Rign': unknown name 'Rign'; expected a comma-separated list of Tree, Ring"),
    Case("nccl-proto-empty", "NCCL_PROTO='' (nothing enabled)", _all_reduce_with({"NCCL_PROTO": ""}),
         error=NcclEnvironmentError, match=r"NCCL_PROTO='' names nothing; expected a comma-separated list of LL"),
    Case("nccl-nvls-enable-word", "os.environ['NCCL_NVLS_ENABLE'] = 'yes' in rank code (NCCL reads an integer)",
         _all_reduce_with({"NCCL_NVLS_ENABLE": "yes"}), error=NcclEnvironmentError,
         match=r"rank 0: NCCL_NVLS_ENABLE='yes' is not an integer; expected 0 \(NVLink SHARP off\), 1 or 2.*first collective, .*test_hostile_nccl.py:\d+"),
    Case("nccl-algo-excludes-all-but-ring", "NCCL_ALGO='^tree,nvls,nvlstree,collnetdirect,collnetchain' (mixed case)",
         _all_reduce_with({"NCCL_ALGO": "^tree,nvls,NVLSTree,collnetdirect,CollNetChain"}),
         check=_only_ring_predicted),
    Case("nccl-model-on-cpu", "Cluster.preset('dgx-h100', collective_model='nccl', device='cpu')",
         lambda: simdist.Cluster.preset("dgx-h100", world_size=8, collective_model="nccl", device="cpu"),
         error=ClusterSpecError, match=r"knows NCCL's tuning on H100, H200, A100, A100-40GB only.*'alpha-beta'"),
    Case("nccl-model-misspelt", "collective_model='NCCL'",
         lambda: simdist.Cluster.preset("dgx-h100", world_size=8, collective_model="NCCL"),
         error=ClusterSpecError, match=r"collective_model must be one of alpha-beta, nccl, gloo; found 'NCCL'"),
    Case("nccl-model-without-nodes", "collective_model='nccl' on a graph with no nodes of GPUs", _no_nodes,
         error=ClusterSpecError, match=r"needs nodes of GPUs \(a two_level cluster or a preset such as 'dgx-h100'\)"),
    Case("bench-nccl-on-ring", "simdist bench --cluster ring -m nccl", _bench_on_ring,
         error=ClusterSpecError, match=r"needs nodes of GPUs"),
]


@pytest.mark.parametrize("case", params(CASES))
def test_hostile(case: Case) -> None:
    check(case)
