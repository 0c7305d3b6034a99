"""The equivalence oracle: check a parallel training run against its single-process reference, step by step."""
