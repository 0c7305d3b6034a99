"""A simulated CUDA device for CPU builds of torch: tensors that report ``cuda:i`` and compute on the CPU, the
native pieces autograd needs for them, and the per-thread current device."""
