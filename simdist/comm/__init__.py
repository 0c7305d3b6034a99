"""Communication: the ``"simdist"`` torch.distributed backend, collective op descriptions, matching and
ordering across ranks, message execution with real data, point-to-point, works and futures, races."""
