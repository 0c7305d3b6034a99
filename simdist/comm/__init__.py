"""Communication: collective op descriptions, matching and ordering across ranks, algorithm selection, message
execution with real data, point-to-point, works and futures, races, and the run's shared context. The
torch.distributed face above it (backend, process group) is :mod:`simdist.c10d`."""
