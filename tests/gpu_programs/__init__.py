"""Training programs written as users write them for GPUs (torchrun-style scripts: ``init_process_group("nccl")``,
``torch.cuda.set_device(LOCAL_RANK)``), each runnable three ways: ``main("cuda")`` under ``simdist.run`` on a GPU
cluster, ``main("cpu")`` as its CPU twin (the same program written for the CPU), and the file itself under
``python -m real --emulate-cuda`` (or torchrun on GPUs). tests/test_gpu_programs.py compares them bit for bit."""
