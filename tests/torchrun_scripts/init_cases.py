"""A torchrun-style script that calls ``init_process_group`` with each argument a user gets wrong, and writes what
happened to ``OUT/rank<RANK>.json``: ``python -m torch.distributed.run --nproc-per-node 2 init_cases.py OUT``
(real gloo processes) or ``simdist run init_cases.py --world-size 2 -- OUT``.

Each case either initialises (then all-reduces and destroys the group) or raises; waits that would hang are
bounded by a 3-second timeout (60 seconds for the cases that initialise). Every process runs the cases in the same order, so the group names stay in step.
A ``file://`` store in a directory that does not exist is left out: real processes wait for it whatever the
timeout (measured by hand), which simdist refuses at once.
"""

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

out = sys.argv[1]
rank = int(os.environ["RANK"])
short = datetime.timedelta(seconds=3)
patient = datetime.timedelta(seconds=60)

CASES = {
    "world-size-too-large": {"world_size": 3},
    "rank-out-of-range": {"rank": 5},
    "rank-negative": {"rank": -2},
    "rank-not-an-int": {"rank": "1"},
    "rank-claimed-twice": {"world_size": 2, "rank": 0},
    "world-size-zero": {"world_size": 0},
    "device-id-cpu": {"device_id": torch.device("cpu")},
    "device-id-int-without-accelerator": {"device_id": 0},
    "init-method-unknown-scheme": {"init_method": "foo://somewhere"},
    "init-method-tcp-without-rank": {"init_method": "tcp://127.0.0.1:29999"},
    "init-method-env-with-rank-in-url": {"init_method": "env://?rank=0", "rank": 0},
    "store-hash-store": {"store": dist.HashStore(), "world_size": 2, "rank": rank},
    "store-without-world-size": {"store": dist.HashStore()},
    "store-and-init-method": {
        "store": dist.HashStore(),
        "init_method": "env://",
        "world_size": 2,
        "rank": rank,
    },
    "timeout-not-a-timedelta": {"timeout": 5},
    # the cases that initialise wait longer: rank 1 comes to them about 3 s before rank 0 (it was refused at once
    # where rank 0 waited out rank-claimed-twice), so 3 s would leave them to the machine's load
    "env-explicit": {"init_method": "env://", "world_size": 2, "rank": rank, "timeout": patient},
    "file-store": {
        "init_method": f"file://{os.path.join(out, 'file-store')}",
        "world_size": 2,
        "rank": rank,
        "timeout": patient,
    },
}

results = {}
for name, kwargs in CASES.items():
    kwargs.setdefault("timeout", short)
    try:
        dist.init_process_group("gloo", **kwargs)
    except Exception as e:  # noqa: BLE001 - what each case raises is the measurement
        results[name] = {"raised": [c.__name__ for c in type(e).__mro__], "message": str(e)}
        continue
    t = torch.ones(2) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    results[name] = {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "sum": t.tolist()}
    dist.destroy_process_group()

with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(results, f, indent=1)
