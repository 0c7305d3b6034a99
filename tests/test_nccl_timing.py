"""Collectives timed by NCCL's model in a run: the simulated time is the model's (the tuner's prediction and an
NVLS pipeline's fill), contention on shared links still shows, NCCL_ALGO/NCCL_PROTO/NCCL_NVLS_ENABLE in rank
code pin NCCL's choice, and the alpha-beta model stays the default."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import networkx as nx
import pytest
import torch
import torch.distributed as dist

import simdist
from simdist import Cluster
from simdist.algorithms import nccl
from simdist.cli import main
from simdist.compute import get_device
from simdist.errors import ClusterSpecError, NcclEnvironmentError


def _timed(collective: str, numel: int, env: dict[str, str]) -> tuple[float, str]:
    os.environ.update(env)
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    n = dist.get_world_size()
    x = torch.ones(numel, device="cuda")
    if collective == "all_reduce":
        call = lambda: dist.all_reduce(x)
    elif collective == "all_gather":
        out = torch.empty(numel * n, device="cuda")
        call = lambda: dist.all_gather_into_tensor(out, x)
    elif collective == "reduce_scatter":
        out = torch.empty(numel, device="cuda")
        x = torch.ones(numel * n, device="cuda")
        call = lambda: dist.reduce_scatter_tensor(out, x)
    elif collective == "reduce":
        call = lambda: dist.reduce(x, 0)
    else:
        call = lambda: dist.broadcast(x, 0)
    t0 = simdist.now()
    call()
    return simdist.now() - t0


def _run(
    cluster: Cluster, collective: str, numel: int, env: dict[str, str] | None = None
) -> simdist.RunResult:
    return simdist.run(
        _timed, cluster, args=(collective, numel, env or {}), compute=False, trace="collectives"
    )


def _label(res: simdist.RunResult) -> str:
    return res.trace.spans[-1].args.get("nccl", "") if res.trace.spans else ""


@pytest.mark.parametrize(
    ("world", "collective", "numel"),
    [
        (8, "all_reduce", 2),
        (8, "all_reduce", 1 << 18),
        (8, "all_reduce", 1 << 24),
        (8, "all_gather", 1 << 18),
        (8, "reduce_scatter", 1 << 16),
        (8, "broadcast", 1 << 20),
        (16, "reduce", 1 << 20),
        (16, "reduce_scatter", 1 << 12),
        (16, "all_reduce", 1 << 22),
        (16, "all_gather", 1 << 10),
    ],
)
def test_uncontended_time_is_the_tuners(world: int, collective: str, numel: int) -> None:
    cluster = Cluster.preset("dgx-h100", world_size=world, collective_model="nccl")
    res = _run(cluster, collective, numel)
    nbytes = 4 * numel * (world if collective in ("all_gather", "reduce_scatter") else 1)
    fab = nccl.fabric("H100", world, world // 8, 50e9)
    predicted = nccl.choose(fab, collective, nbytes)
    assert max(res.returns) == pytest.approx(predicted.seconds, rel=2e-3)
    assert _label(res) == predicted.label


def _two_groups(numel: int, both: bool) -> float:
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    other = dist.new_group(list(range(dist.get_world_size())))
    a, b = torch.ones(numel, device="cuda"), torch.ones(numel, device="cuda")
    t0 = simdist.now()
    works = [dist.all_reduce(a, async_op=True)]
    if both:
        works.append(dist.all_reduce(b, group=other, async_op=True))
    for w in works:
        w.wait()
    return simdist.now() - t0


def test_concurrent_collectives_share_links() -> None:
    cluster = Cluster.preset("dgx-h100", world_size=8, collective_model="nccl")
    one = simdist.run(_two_groups, cluster, args=(1 << 24, False), compute=False).returns[0]
    two = simdist.run(_two_groups, cluster, args=(1 << 24, True), compute=False).returns[0]
    assert two > 1.8 * one


def test_nccl_env_pins_choice() -> None:
    cluster = Cluster.preset("dgx-h100", world_size=8, collective_model="nccl")
    assert _label(_run(cluster, "all_reduce", 1 << 24)) == "NVLS/Simple"
    assert _label(_run(cluster, "all_reduce", 1 << 24, {"NCCL_ALGO": "^NVLS"})) == "Ring/Simple"
    # Simple only: NVLS's 25 us beats the ring's 8.4 + 14 x 3.4 us even at 8 bytes
    assert _label(_run(cluster, "all_reduce", 2, {"NCCL_PROTO": "Simple"})) == "NVLS/Simple"
    assert (
        _label(_run(cluster, "all_reduce", 2, {"NCCL_ALGO": "tree", "NCCL_PROTO": "LL128"})) == "Tree/LL128"
    )
    with pytest.raises(
        NcclEnvironmentError, match=r"rank 0: NCCL_ALGO='Rign': unknown name .*test_nccl_timing.py:\d+"
    ):
        _run(cluster, "all_reduce", 2, {"NCCL_ALGO": "Rign"})


def test_nvls_enable_0_turns_nvls_off() -> None:
    # NCCL_NVLS_ENABLE=0 in rank code, as nccl-tests' NVLS-off runs set it: NCCL runs the ring, at the ring's time
    cluster = Cluster.preset("dgx-h100", world_size=8, collective_model="nccl")
    res = _run(cluster, "all_reduce", 1 << 24, {"NCCL_NVLS_ENABLE": "0"})
    assert _label(res) == "Ring/Simple"
    ring = nccl.choose(
        nccl.fabric("H100", 8, 1, 50e9), "all_reduce", 4 << 24, nccl.Enabled(frozenset({"Ring"}))
    )
    assert max(res.returns) == pytest.approx(ring.seconds, rel=2e-3)


def _pinned(algorithm: str) -> str:
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    simdist.set_algorithms(all_reduce=algorithm)
    dist.all_reduce(torch.ones(1 << 16, device="cuda"))
    return ""


def test_pinned_algorithms() -> None:
    cluster = Cluster.preset("dgx-h100", world_size=8, collective_model="nccl")
    res = simdist.run(_pinned, cluster, args=("ring",), compute=False, trace="collectives")
    assert _label(res).startswith("Ring/")
    # an algorithm NCCL does not have runs on the links' own timing
    res = simdist.run(_pinned, cluster, args=("rhd",), compute=False, trace="collectives")
    assert _label(res) == "" and res.trace.spans[-1].args["algorithm"] == "rhd"


def _by_backend() -> dict[str, str]:
    dist.init_process_group("nccl")
    gloo = dist.new_group(backend="gloo")
    both = dist.new_group(backend="cpu:gloo,cuda:nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.all_reduce(torch.ones(1 << 16, device="cuda"))
    dist.all_reduce(torch.ones(1 << 16), group=gloo)
    dist.all_reduce(torch.ones(1 << 16), group=both)  # CPU tensors: its gloo part
    dist.all_reduce(torch.ones(1 << 16, device="cuda"), group=both)  # CUDA tensors: its NCCL part
    dist.all_reduce(torch.ones(1 << 16, device="cuda"), group=gloo)  # gloo on CUDA tensors
    return {}


def test_groups_presenting_gloo_keep_link_timing() -> None:
    cluster = Cluster.preset("dgx-h100", world_size=8, collective_model="nccl")
    res = simdist.run(_by_backend, cluster, compute=False, trace="collectives")
    spans = [s for s in res.trace.spans if s.rank == 0 and "Collective name" in s.args]
    assert [s.args.get("nccl") for s in spans] == ["Ring/LL", None, None, "Ring/LL", None]


def test_gpu_presets_time_with_nccl_and_alpha_beta_stays_selectable() -> None:
    assert Cluster.preset("dgx-h100", world_size=8).collective_model == "nccl"
    assert Cluster.preset("dgx-a100", world_size=8).collective_model == "nccl"
    assert Cluster.preset("dgx-h100", world_size=8, device="H200").collective_model == "nccl"
    cluster = Cluster.preset("dgx-h100", world_size=8, collective_model="alpha-beta")
    assert _label(_run(cluster, "all_reduce", 1 << 18)) == ""
    # custom clusters and the other presets keep the link-level model
    assert (
        Cluster.preset("switch").collective_model
        == Cluster.switch(4, device="H100").collective_model
        == "alpha-beta"
    )


def test_a_gpu_preset_on_a_device_nccls_model_does_not_know_is_timed_link_by_link() -> None:
    # the preset's default yields to the device (a cost model you built, the CPU); asking for NCCL's model is refused
    slow = dataclasses.replace(get_device("H100"), name="H100/1000")
    assert Cluster.preset("dgx-h100", world_size=8, device=slow).collective_model == "alpha-beta"
    assert Cluster.preset("dgx-h100", world_size=8, device="cpu").collective_model == "alpha-beta"
    with pytest.raises(ClusterSpecError, match="H100/1000"):
        Cluster.preset("dgx-h100", world_size=8, device=slow, collective_model="nccl")


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_a_saved_cluster_keeps_its_nodes_and_its_collective_model(tmp_path: Path, suffix: str) -> None:
    cluster = Cluster.preset("dgx-h100", nodes=2)
    cluster.save(tmp_path / f"c{suffix}")
    loaded = Cluster.from_file(tmp_path / f"c{suffix}")
    assert (loaded.collective_model, loaded.ranks_per_node, loaded.gpus_per_node) == ("nccl", 8, 8)
    size = 1 << 22
    spans = [_run(c, "all_reduce", size).trace.spans[-1] for c in (loaded, cluster)]
    assert spans[0].end - spans[0].start == spans[1].end - spans[1].start
    assert _label(_run(loaded, "all_reduce", size)) == _label(_run(cluster, "all_reduce", size)) != ""
    text = re.sub(r'\s*"?gpus_per_node"?\s*[=:]\s*8,?', "", (tmp_path / f"c{suffix}").read_text())
    (tmp_path / f"d{suffix}").write_text(text)
    with pytest.raises(ClusterSpecError, match="ranks_per_node without gpus_per_node"):
        Cluster.from_file(tmp_path / f"d{suffix}")


def test_refused_where_nccl_model_does_not_apply() -> None:
    with pytest.raises(ClusterSpecError, match="alpha-beta"):
        Cluster.preset("dgx-h100", world_size=8, collective_model="nccl", device="cpu")
    with pytest.raises(ClusterSpecError, match="collective_model"):
        Cluster.preset("dgx-h100", world_size=8, collective_model="nccl2")
    graph = nx.complete_graph(4, nx.DiGraph)
    nx.set_edge_attributes(graph, 100e9, "bandwidth")
    nx.set_edge_attributes(graph, 1e-6, "latency")
    cluster = Cluster(graph, collective_model="nccl")
    with pytest.raises(ClusterSpecError, match="nodes of GPUs"):
        _run(cluster, "all_reduce", 2)


def test_bench_times_with_nccl_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "all_reduce", "--world-size", "8", "-b", "8M", "-e", "8M", "-m", "nccl"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("8388608"))
    predicted = nccl.choose(nccl.fabric("H100", 8, 1, 50e9), "all_reduce", 8 << 20)
    assert row.split()[-1] == predicted.label
    assert float(row.split()[5]) == pytest.approx(predicted.seconds * 1e6, abs=0.01)
    with pytest.raises(SystemExit):
        main(["bench", "-m", "nccl2"])
