"""Peak device memory of a transformer block's training step, phase by phase: ``memory.json``.

``python benchmarks/gpu/memory.py [--out DIR] [--dry-run]``. For each block shape and dtype, one process-wide
peak is followed through a training step as ``torch.cuda.max_memory_allocated()`` reports it after each phase:
the model, the optimizer (AdamW), forward, backward, the first optimizer step (which creates AdamW's state),
and a whole second step. compare.py runs ``training_step`` cut after each phase under
``simdist.run(..., memory=True)`` and compares its peak with the measured one at that phase.
"""

from __future__ import annotations

import time

import torch
from common import Results, device, machine, parser
from model import BlockShape, block, block_input

#: the phases of a training step, in order; ``training_step(..., upto=phase)`` stops after that one
PHASES = ("model", "optimizer", "forward", "backward", "step", "second step")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def configs(dry_run: bool) -> list[tuple[BlockShape, str]]:
    """(block shape, dtype label) of each measurement."""
    if dry_run:
        return [(BlockShape(64, 4, 2, 32), "fp32")]
    shapes = (BlockShape(1024, 16, 8, 1024), BlockShape(2048, 16, 4, 2048))
    return [(s, dt) for s in shapes for dt in DTYPES]


def training_step(
    shape: BlockShape, dtype: str, dev: torch.device | str, upto: str, probe: dict[str, int] | None = None
) -> None:
    """Build a block and AdamW, and train it up to and including phase ``upto`` (one of PHASES).

    ``probe`` (on a GPU) receives ``max_memory_allocated()`` after each phase. The optimizer loops over
    parameters (``foreach=False``), as it does on every device, so the step's temporaries are the same.
    """
    model = block(shape, DTYPES[dtype], dev)
    phases = iter(PHASES)

    def done() -> bool:
        """Record the peak at the end of the next phase; whether it is the last one asked for."""
        phase = next(phases)
        if probe is not None:
            torch.cuda.synchronize()
            probe[phase] = torch.cuda.max_memory_allocated()
        return phase == upto

    if done():
        return
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    if done():
        return
    for step in range(2):
        x = block_input(shape, DTYPES[dtype], dev, seed=step)
        loss = model(x).float().pow(2).mean()
        if step == 0 and done():
            return
        loss.backward()
        if step == 0 and done():
            return
        opt.step()
        opt.zero_grad(set_to_none=True)
        del x, loss
        if done():
            return


def main() -> None:
    """Measure every configuration and write memory.json."""
    options = parser(__doc__.splitlines()[0]).parse_args()
    dev = device()
    results = Results(
        options.out / "memory.json", {**machine(), "dry_run": options.dry_run, "phases": PHASES}
    )
    start = time.perf_counter()
    for shape, dtype in configs(options.dry_run):
        where = f"block {dtype} {shape.label}"
        with results.guard(where):
            peaks: dict[str, int] = {}
            if dev.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                training_step(shape, dtype, dev, PHASES[-1], peaks)
                peaks = {phase: peak - base for phase, peak in peaks.items()}
            else:
                training_step(shape, dtype, dev, PHASES[-1])  # no allocator to ask: the code path only
            results.add({"shape": vars(shape), "dtype": dtype, "peak_bytes": peaks})
            text = (
                ", ".join(f"{p} {b / 2**20:.0f} MiB" for p, b in peaks.items()) or "(no CUDA: not measured)"
            )
            print(f"{where}: {text}", flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print(
        f"memory: {len(results.data['records'])} configs, {len(results.data['errors'])} errors, "
        f"{time.perf_counter() - start:.0f} s",
        flush=True,
    )


if __name__ == "__main__":
    main()
