"""Hostile uses of timing-only runs (``tensors="fake"``): wrong values of the option, value reads in rank code,
checks that need data asked for anyway, a cluster without GPUs; and programs that must run alike with and without
data (a model made on the meta device and moved with ``to_empty``), with the run with data as the oracle."""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hostile_cases import Case, check, params

import simdist


def _gpus(n: int) -> simdist.Cluster:
    return simdist.Cluster.preset("dgx-h100", world_size=n)


def _read(how: str) -> None:
    torch.cuda.set_device(0)
    x = torch.ones(4, device="cuda").sum()
    if how == "item":
        x.item()
    elif how == "cpu":
        x.cpu()
    elif how == "format":
        print(f"loss {x:.3f}")
    elif how == "equal":
        torch.equal(x, x)
    elif how == "masked_select":
        x.unsqueeze(0).masked_select(x.unsqueeze(0) > 0)
    elif how == "argwhere":
        torch.argwhere(torch.ones(4, device="cuda"))
    elif how == "no_meta_kernel":  # torch has no meta kernel for histogram's: shapes alone do not run it
        torch.histogram(torch.ones(4, device="cuda"), 4)
    elif how == "no_meta_kernel_plain":  # nor for geqrf's (an op of device tensors alone, without keywords)
        torch.geqrf(torch.ones(4, 4, device="cuda"))
    elif how == "save":  # a checkpoint: torch.save copies each tensor to the host
        torch.save(torch.nn.Linear(4, 4, device="cuda").state_dict(), io.BytesIO())


def _fake(fn: Callable[..., Any], *args: object) -> simdist.RunResult:
    return simdist.run(fn, _gpus(1), args=args, tensors="fake")


def _shown() -> str:
    torch.cuda.set_device(0)
    return repr(torch.ones(2, 3, device="cuda", dtype=torch.bfloat16))


def _host_values() -> tuple:
    # host tensors keep their values, and so does a copy of one on the device (DDP's checks read such copies back)
    torch.cuda.set_device(0)
    y = torch.arange(4.0) * 2
    z = y.cuda()
    w = torch.empty(4, device="cuda")
    w.copy_(y)
    return tuple(z.shape), y.sum().item(), z.cpu().tolist(), w.cpu().tolist(), repr(z + torch.ones(4, device="cuda"))


def _meta_init_fsdp2() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.cuda.set_device(dist.get_rank())
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cuda")
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    opt.step()


def _both(fn: Callable[..., Any]) -> tuple[simdist.RunResult, simdist.RunResult]:
    runs = [
        simdist.run(fn, _gpus(2), tensors=t, memory=True, races="off", watchdog=math.inf) for t in ("real", "fake")
    ]
    return runs[0], runs[1]


def _alike(runs: tuple[simdist.RunResult, simdist.RunResult]) -> None:
    real, fake = runs
    assert fake.sim_time == pytest.approx(real.sim_time, rel=0.01)
    assert [m.peak_bytes for m in fake.memory] == [m.peak_bytes for m in real.memory]


CASES: list[Case] = [
    Case("fake-tensors-meta", "simdist.run(fn, c, tensors='meta')",
         lambda: simdist.run(lambda: None, _gpus(1), tensors="meta"), error=simdist.RunArgumentError,
         match=r"tensors must be one of \('real', 'fake'\), got 'meta'"),
    Case("fake-tensors-true", "simdist.run(fn, c, tensors=True)",
         lambda: simdist.run(lambda: None, _gpus(1), tensors=True), error=simdist.RunArgumentError,
         match=r"tensors must be one of \('real', 'fake'\), got True"),
    Case("fake-on-cpu-cluster", "tensors='fake' on a cluster of CPUs",
         lambda: simdist.run(lambda: None, simdist.Cluster.switch(2, device="cpu"), tensors="fake"),
         error=simdist.RunArgumentError, match=r'tensors="fake" times programs written for GPUs.*no GPU model'),
    Case("fake-with-races-error", "tensors='fake' with races='error'",
         lambda: simdist.run(lambda: None, _gpus(1), tensors="fake", races="error"), error=simdist.RunArgumentError,
         match=r"races='error' with tensors=\"fake\": the race detector .* leave races unset"),
    Case("fake-equivalence-oracle", "simdist.check_equivalence(..., tensors='fake')",
         lambda: simdist.check_equivalence(lambda: None, lambda: None, _gpus(2), tensors="fake"),
         error=simdist.RunArgumentError, match=r"the oracle compares values .* computes none"),
    Case("fake-item", "loss.item() in a timing-only run", lambda: _fake(_read, "item"), error=simdist.RankError,
         match=r"rank 0 raised NoValuesError: rank 0: aten::_local_scalar_dense reads the values .*\(tensors=\"fake\"\)"),
    Case("fake-cpu-copy", "t.cpu() in a timing-only run", lambda: _fake(_read, "cpu"), error=simdist.RankError,
         match=r"NoValuesError: rank 0: aten::_to_copy reads the values of a tensor on cuda:0"),
    Case("fake-format", "f'{loss:.3f}' in a timing-only run", lambda: _fake(_read, "format"),
         error=simdist.RankError, match=r"NoValuesError: .*_local_scalar_dense reads the values"),
    Case("fake-equal", "torch.equal on device tensors in a timing-only run", lambda: _fake(_read, "equal"),
         error=simdist.RankError, match=r"NoValuesError: .*aten::equal reads the values"),
    Case("fake-masked-select", "masked_select (a shape from values) in a timing-only run",
         lambda: _fake(_read, "masked_select"), error=simdist.RankError,
         match=r"NoValuesError: .*masked_select reads the values of a tensor on cuda:0 \(to the host, or for the shape"),
    Case("fake-argwhere", "argwhere (a shape from values) in a timing-only run", lambda: _fake(_read, "argwhere"),
         error=simdist.RankError, match=r"NoValuesError: .*aten::nonzero reads the values"),
    Case("fake-no-meta-kernel", "an op torch has no meta kernel for, in a timing-only run",
         lambda: _fake(_read, "no_meta_kernel"), error=simdist.RankError,
         match=r"NoValuesError: rank 0: aten::histogram on cuda:0 has no kernel that works from shapes alone .*torch: "
               r"aten::histogram.bin_ct: attempted to run this operator with Meta tensors"),
    Case("fake-no-meta-kernel-plain", "an op of device tensors alone torch has no meta kernel for, timing-only",
         lambda: _fake(_read, "no_meta_kernel_plain"), error=simdist.RankError,
         match=r"NoValuesError: rank 0: aten::geqrf on cuda:0 has no kernel that works from shapes alone .*torch: "
               r"aten::geqrf: attempted to run this operator with Meta tensors"),
    Case("fake-save", "torch.save of a model's state in a timing-only run", lambda: _fake(_read, "save"),
         error=simdist.RankError,
         match=r"NoValuesError: saving a tensor on cuda:0 \(torch.save, pickle\) copies its values to the host"),
    Case("fake-repr", "print(t) of a fake tensor", lambda: _fake(_shown).returns, check=lambda r: (
        r == ["tensor(..., device='cuda:0', size=(2, 3), dtype=torch.bfloat16, no values)"]) or pytest.fail(str(r))),
    Case("fake-host-values", "host tensors and copies of them on the device in a timing-only run",
         lambda: _fake(_host_values).returns[0], check=lambda r: r == (
             (4,), 12.0, [0.0, 2.0, 4.0, 6.0], [0.0, 2.0, 4.0, 6.0],
             "tensor(..., device='cuda:0', size=(4,), dtype=torch.float32, no values)") or pytest.fail(str(r))),
    Case("fake-meta-init-fsdp2", "FSDP2 over a model made on the meta device, then to_empty('cuda') and initialised",
         lambda: _both(_meta_init_fsdp2), check=_alike),
]  # fmt: skip


@pytest.mark.parametrize("case", params(CASES))
def test_hostile(case: Case) -> None:
    check(case)
