"""A tour of simdist on two simulated DGX-H100 nodes (16 ranks): timing, a hang, a mismatch, replay.

Every rank function is written as for torchrun on GPUs: NCCL, the GPU its LOCAL_RANK names, the model and each
batch copied to it; on simulated H100s they run on this machine's CPU.

1. What does overlapping gradient all-reduces with backward buy? The same data-parallel step twice: reducing
   after backward, and reducing each gradient asynchronously as soon as autograd has produced it. Both must
   equal the single-process model trained on the full batch.
2. A collective that hangs on one rank out of 16: rank 11 skips the last all-reduce; simdist reports a
   deadlock naming what every rank waits on instead of hanging.
3. A mismatched collective: rank 3 reduces bfloat16 where the others reduce float32.
4. Replay: the same (program, cluster, seed) gives the same trace hash; the Chrome trace of one step is
   written to demo_step.json in the output directory (reports/ by default; open it in ui.perfetto.dev).

The HTML report demo.html (in the same directory) shows the two variants' timelines side by side, their step
breakdown, and both diagnoses.

Prints a verdict table and exits non-zero if any expectation fails. Usage: python scenarios/demo.py [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from verdicts import finish

import simdist

WIDTH, LAYERS, BATCH = 512, 4, 32
NODES, GPUS = 2, 8
REPORTS = Path(__file__).resolve().parent.parent / "reports"


def setup() -> torch.device:
    """What a script launched by torchrun on GPUs does first: NCCL, and the GPU its LOCAL_RANK names."""
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 1))


def batch(rank: int) -> torch.Tensor:
    """Rank ``rank``'s batch as its data loader gives it: on the host."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(BATCH, WIDTH, generator=g)


def step_reduce_after_backward() -> list[torch.Tensor]:
    """Backward first, then one blocking all-reduce per gradient."""
    device = setup()
    model = make_model().to(device)
    model(batch(dist.get_rank()).to(device)).pow(2).mean().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    return [p.grad for p in model.parameters()]


def step_overlapped() -> list[torch.Tensor]:
    """Each gradient's all-reduce starts from its post-accumulate hook, overlapping the rest of backward."""
    device = setup()
    model = make_model().to(device)
    works = []

    def hook(p: torch.Tensor) -> None:
        works.append(dist.all_reduce(p.grad, async_op=True))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    model(batch(dist.get_rank()).to(device)).pow(2).mean().backward()
    for w in works:
        w.wait()
    for p in model.parameters():
        p.grad /= dist.get_world_size()
    return [p.grad for p in model.parameters()]


def step_one_rank_skips() -> None:
    """Rank 11 takes an early exit (say, an empty shard of data) and skips the last all-reduce."""
    t = torch.ones(1024, device=setup())
    dist.all_reduce(t)
    if dist.get_rank() != 11:
        dist.all_reduce(t)


def step_wrong_dtype() -> None:
    device = setup()
    dtype = torch.bfloat16 if dist.get_rank() == 3 else torch.float32
    dist.all_reduce(torch.ones(256, dtype=dtype, device=device))


def single_process_grads() -> list[torch.Tensor]:
    """The oracle: one process (here on the CPU) trains the model on every rank's batch at once."""
    model = make_model()
    full = torch.cat([batch(r) for r in range(NODES * GPUS)])
    model(full).pow(2).mean().backward()
    return [p.grad for p in model.parameters()]


def breakdown(res: simdist.RunResult, rank: int) -> tuple[float, float]:
    return res.trace.busy_time(rank, "compute"), res.trace.busy_time(rank, "comm")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out",
        type=Path,
        default=REPORTS,
        metavar="DIR",
        help="where the HTML report and the Chrome trace are written (default: %(default)s)",
    )
    args = ap.parse_args(argv)
    cluster = simdist.Cluster.preset("dgx-h100", world_size=NODES * GPUS)
    verdicts: list[tuple[str, bool, str]] = []
    page = simdist.report.ScenarioReport(
        "simdist demo: 16 ranks on two DGX-H100 nodes",
        description=__doc__,
        cluster=cluster,
        seed=0,
        command="python scenarios/demo.py",
    )
    print(cluster.describe())
    print()

    ref = single_process_grads()
    after = simdist.run(step_reduce_after_backward, cluster, seed=0)
    overlap = simdist.run(step_overlapped, cluster, seed=0)
    print("1. data-parallel step, 4x512 MLP, batch 32 per rank, H100 cost model")
    print("   (compute includes copying the model and the batch from the host to the GPU)")
    print(f"   {'variant':28s} {'step (us)':>10} {'compute (us)':>13} {'comm (us)':>10}")
    for name, res in (("reduce after backward", after), ("overlapped (async in hooks)", overlap)):
        comp, comm = breakdown(res, 0)
        print(f"   {name:28s} {res.sim_time * 1e6:>10.1f} {comp * 1e6:>13.1f} {comm * 1e6:>10.1f}")
    same = all(
        torch.allclose(g, r, rtol=1e-4, atol=1e-6)
        for res in (after, overlap)
        for g, r in zip(res.returns[5], ref)
    )
    verdicts.append(("both variants equal the single-process model", same, "rank 5 vs full-batch gradients"))
    page.runs(
        "Reduce after backward vs overlapped",
        {"reduce after backward": after, "overlapped (async in hooks)": overlap},
        note="One data-parallel step of a 4x512 MLP on 16 ranks; the overlapped variant starts each "
        "gradient's all-reduce from its post-accumulate hook.",
    )
    page.bar_plot(
        "Step time per variant",
        {
            name: {
                "step": res.sim_time,
                "compute (rank 0)": breakdown(res, 0)[0],
                "communication (rank 0)": breakdown(res, 0)[1],
            }
            for name, res in (("reduce after backward", after), ("overlapped", overlap))
        },
        y_label="simulated time",
        unit="time",
        nav="step time",
    )
    gain = after.sim_time / overlap.sim_time
    verdicts.append(("overlap shortens the step", gain > 1.0, f"{gain:.2f}x faster"))
    print()

    print("2. one rank out of 16 skips a collective")
    try:
        simdist.run(step_one_rank_skips, cluster)
        verdicts.append(("hang reported as a deadlock", False, "no error raised"))
    except simdist.DeadlockError as e:
        text = str(e)
        print("   " + "\n   ".join(text.splitlines()))
        page.text(
            "Diagnosis: one rank skips a collective",
            text,
            error=True,
            nav="deadlock",
            note="Rank 11 skips the last all-reduce; instead of hanging, the run reports what every rank waits on.",
        )
        verdicts.append(("hang reported as a deadlock", "never issued by rank 11;" in text, "names rank 11"))
    print()

    print("3. a rank reduces the wrong dtype")
    try:
        simdist.run(step_wrong_dtype, cluster)
        verdicts.append(("mismatch reported", False, "no error raised"))
    except simdist.CollectiveMismatchError as e:
        lines = str(e).splitlines()
        print("   " + "\n   ".join(lines[:3]))
        page.text("Diagnosis: a rank reduces the wrong dtype", str(e), error=True, nav="mismatch")
        verdicts.append(
            (
                "mismatch reported",
                "rank 3: all_reduce(shape=(256,), dtype=bfloat16" in str(e),
                "names rank 3 and its call site",
            )
        )
    print()

    again = simdist.run(step_overlapped, cluster, seed=0)
    out = args.out / "demo_step.json"
    overlap.trace.save_chrome(out)
    print(f"4. replay: trace hash {overlap.trace_hash[:16]} twice; Chrome trace written to {out}")
    verdicts.append(
        ("same seed, same trace hash", again.trace_hash == overlap.trace_hash, overlap.trace_hash[:16])
    )
    print()

    return finish(page, verdicts, args.out, "demo")


if __name__ == "__main__":
    sys.exit(main())
