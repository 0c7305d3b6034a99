"""The private torch internals simdist relies on, so a torch upgrade that moves one fails here, by name.

The supported range is pinned in pyproject.toml (torch>=2.13.0,<2.14); widen it only with this file green.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.utils import _python_dispatch


def test_c10d_world_is_replaceable_and_has_the_fields_simdist_makes_per_thread():
    from simdist.comm.thread_world import ThreadLocalWorld

    assert isinstance(c10d._world, c10d._World)
    for name in ("default_pg", "pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "group_count",
                 "tags_to_pg", "pg_to_tag", "pg_coalesce_state", "comms"):
        assert hasattr(c10d._World, name), name
        assert isinstance(getattr(ThreadLocalWorld, name), property), name


def test_process_group_creation_helpers():
    params = inspect.signature(c10d._new_process_group_helper).parameters
    for name in ("group_size", "group_rank", "global_ranks_in_group", "backend", "store", "group_name", "timeout", "group_desc"):
        assert name in params, name
    assert callable(c10d._process_group_name) and callable(c10d._update_default_pg)
    assert callable(c10d._get_default_timeout) and isinstance(c10d.default_pg_timeout.total_seconds(), float)
    assert callable(c10d._unregister_all_process_groups)
    from torch._C._distributed_c10d import _set_thread_isolation_mode

    assert callable(_set_thread_isolation_mode)
    assert "extended_api" in inspect.signature(dist.Backend.register_backend).parameters


def test_autograd_engine_hooks_for_draining_collectives_in_backward():
    assert torch._C._current_graph_task_id() == -1
    assert callable(torch.autograd.Variable._execution_engine.queue_callback)
    assert callable(torch.autograd.set_multithreading_enabled)


def test_dispatch_mode_hooks():
    assert callable(_python_dispatch._disable_current_modes)
    assert hasattr(_python_dispatch.TorchDispatchMode, "_should_skip_dynamo")


def test_python_process_group_and_work_are_subclassable():
    from simdist.errors import SimTimeoutError

    assert issubclass(SimTimeoutError, dist.DistBackendError)
    assert dist.ProcessGroup.__init__ is not object.__init__
    assert dist.Work.__init__ is not object.__init__


def test_an_op_overload_call_is_its_cpp_operator_call():
    # the cost mode calls an OpOverload's ``_op`` directly (simdist.compute.cost), skipping __call__'s Python frame
    body = inspect.getsource(torch._ops.OpOverload.__call__).strip().splitlines()
    assert body[-1].strip() == "return self._op(*args, **kwargs)"
    a, b = torch.randn(3), torch.randn(3)
    assert torch.equal(torch.ops.aten.add.Tensor._op(a, b, alpha=2), torch.ops.aten.add.Tensor(a, b, alpha=2))
