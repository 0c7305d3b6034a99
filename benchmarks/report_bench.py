"""Size and opening time of the HTML report of a 1,024-rank step, in headless Chromium.

Prints figures; it is not a test. Usage: ``python benchmarks/report_bench.py [--nodes 128] [--repeat 3]``.

The step: every rank of ``--nodes`` DGX-H100 nodes (8 GPUs each, 1,024 ranks by default) runs two
iterations of a 2-layer MLP (width 64, batch 8) forward and backward and all-reduces each gradient, under
``simdist.run(..., memory=True)`` with the H100 compute model. The report is written with
``RunResult.save_report``; "open" is the wall time of ``chromium --headless --dump-dom`` on it (the page's
scripts, the timeline included, have run when the DOM is dumped), beside the same command on ``about:blank``
(the browser's own start), best of ``--repeat``.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import simdist


def step() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64))
    for _ in range(2):
        model(torch.randn(8, 64)).sum().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)


def dump_dom(browser: str, url: str) -> tuple[float, str]:
    """Wall seconds of one headless --dump-dom of ``url``, and the DOM."""
    t0 = time.perf_counter()
    out = subprocess.run([browser, "--headless", "--disable-gpu", "--no-sandbox", "--dump-dom", url],
                         capture_output=True, text=True, timeout=300, check=True)
    return time.perf_counter() - t0, out.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    browser = shutil.which("chromium")
    if browser is None:
        raise SystemExit("needs Debian's chromium on PATH (apt-get install chromium)")
    cluster = simdist.Cluster.preset("dgx-h100", nodes=a.nodes)
    t0 = time.perf_counter()
    res = simdist.run(step, cluster, memory=True)
    run_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "step.html"
        t0 = time.perf_counter()
        res.save_report(page)
        save_s = time.perf_counter() - t0
        size = os.path.getsize(page)
        opened = min(dump_dom(browser, page.as_uri())[0] for _ in range(a.repeat))
        blank = min(dump_dom(browser, "about:blank")[0] for _ in range(a.repeat))
        body = re.search(r"<body [^>]*>", dump_dom(browser, page.as_uri())[1]).group(0)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; {browser}")
    print(f"{cluster.world_size} ranks, {len(res.trace.spans)} spans; simdist.run {run_s:.1f} s, save_report {save_s:.2f} s")
    print(f"report {size / 1e6:.2f} MB; open (dump-dom) {opened:.2f} s, about:blank {blank:.2f} s, "
          f"the page's own {opened - blank:.2f} s")
    print(f"page: {body}")


if __name__ == "__main__":
    main()
