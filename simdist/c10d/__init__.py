"""torch.distributed's face of the simulator: what torch and rank code call, above the collective machinery.

The ``"simdist"`` backend's registration and its per-thread worlds (``backend``), the ``ProcessGroup`` rank
code holds (``process_group``), the argument checks that make it refuse what gloo refuses (``arguments``) and
the functional collectives' kernels (``funcol``). Below it, :mod:`simdist.comm` matches, orders and executes
collectives and messages without knowing torch.distributed's API.
"""
