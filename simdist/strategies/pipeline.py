"""An optimizer wrapper for pipeline-parallel training, with gradient-synchronisation modes, in plain torch.distributed.

``PipelineOptimizer`` wraps a torch optimizer over the parameters of this rank's pipeline stages and, in
``step()``, reduces gradients, steps, and broadcasts parameters as its configuration says::

    opt = PipelineOptimizer(torch.optim.SGD(stage.parameters(), lr=0.1), [stage],
                            PipelineOptimizerConfig(sync_mode=GradientSyncMode.STAGE_WISE),
                            pp_group=pp_group, dp_group=dp_group, ties=[{0: "embed.weight", 3: "head.weight"}])
    ...forward and backward of every microbatch...
    opt.step()

Which mode is correct depends on what the stages hold:

| mode       | what step() does                                                  | correct when                          |
|------------|-------------------------------------------------------------------|---------------------------------------|
| NONE       | nothing                                                           | one replica of each stage             |
| AVERAGE    | all-reduce every gradient over the pipeline group, / its size     | stages are replicas of one model      |
| SUM        | all-reduce every gradient over the pipeline group                 | replicas, with a loss already / n     |
| STAGE_WISE | average each gradient over ``dp_group`` (replicas of this stage)  | stages are partitions of one model    |

AVERAGE and SUM match parameters by position across the pipeline group: on partitioned stages of different
shapes they raise :class:`PipelineShapeError`; on partitioned stages that happen to have equal shapes they
silently mix the gradients of different layers. They are kept because that is what they are named for.

This module imports nothing from the simulator: the same code runs under simdist and under ``real``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import operator
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class PipelineShapeError(ValueError):
    """Ranks of a group hold parameters that do not match by position (count, shape or dtype)."""


class PipelineTimeoutError(RuntimeError):
    """A collective the pipeline optimizer issued did not complete in time, or its backend failed."""


class GradientSyncMode(enum.Enum):
    """How ``PipelineOptimizer.step()`` reduces gradients before the optimizer step."""

    NONE = "none"  # no reduction: each stage (and each replica) steps on its own gradients
    AVERAGE = "average"  # all-reduce over the pipeline group, divided by its size
    SUM = "sum"  # all-reduce over the pipeline group
    STAGE_WISE = "stage_wise"  # no reduction across stages; averaged over dp_group (replicas of this stage)


#: the longest communication timeout, in milliseconds (about 146 years). torch's C++ backends hold a deadline as
#: a 64-bit count of nanoseconds: gloo refuses a longer timeout ("Invalid timeout") or overflows it into one that
#: has already passed, and ``timedelta`` itself ends at 8.64e16 ms. Half the range leaves room for the clock's own
#: reading, which is added to the timeout.
MAX_TIMEOUT_MS = 2**62 // 10**6


@dataclasses.dataclass
class PipelineOptimizerConfig:
    """What ``PipelineOptimizer.step()`` synchronises, and how long each collective may take."""

    sync_mode: GradientSyncMode | str = GradientSyncMode.AVERAGE
    #: False: step() reduces no gradient, in any mode
    synchronize_gradients: bool = True
    #: after the step: AVERAGE/SUM/NONE broadcast every parameter from pipeline rank 0 over the pipeline
    #: group; STAGE_WISE broadcasts from dp rank 0 over dp_group (nothing without one)
    broadcast_parameters: bool = True
    #: milliseconds each collective the optimizer issues may take before PipelineTimeoutError
    communication_timeout_ms: int = 30000

    def validate(self) -> None:
        """Raise TypeError/ValueError for an invalid field; a sync_mode given as a string becomes the enum."""
        if isinstance(self.sync_mode, str):
            try:
                self.sync_mode = GradientSyncMode(self.sync_mode.lower())
            except ValueError:
                raise ValueError(
                    f"PipelineOptimizerConfig.sync_mode must be one of {[m.value for m in GradientSyncMode]} "
                    f"or a GradientSyncMode; got {self.sync_mode!r}"
                ) from None
        elif not isinstance(self.sync_mode, GradientSyncMode):
            raise TypeError(
                f"PipelineOptimizerConfig.sync_mode must be a GradientSyncMode (or its value as a string); "
                f"got {self.sync_mode!r} of type {type(self.sync_mode).__name__}"
            )
        for field in ("synchronize_gradients", "broadcast_parameters"):
            value = getattr(self, field)
            if not isinstance(value, bool):
                raise TypeError(f"PipelineOptimizerConfig.{field} must be True or False; got {value!r}")
        self.communication_timeout_ms = _milliseconds(self.communication_timeout_ms)


def _milliseconds(timeout: object) -> int:
    """``communication_timeout_ms`` as an int in ``1..MAX_TIMEOUT_MS``, or TypeError/ValueError naming it."""
    field = "PipelineOptimizerConfig.communication_timeout_ms"
    try:
        if isinstance(timeout, bool):
            raise TypeError
        value = operator.index(timeout)  # int, or an integer type such as numpy.int64
    except TypeError:
        raise TypeError(
            f"{field} must be an int of milliseconds; got {timeout!r} of type {type(timeout).__name__}"
        ) from None
    if value <= 0:
        raise ValueError(f"{field} must be > 0 milliseconds; got {value}")
    if value > MAX_TIMEOUT_MS:
        raise ValueError(
            f"{field} must be at most {MAX_TIMEOUT_MS} milliseconds (about 146 years: torch's backends count a "
            f"deadline in 64-bit nanoseconds); got {value}"
        )
    return value


@dataclasses.dataclass(frozen=True)
class _Local:
    """One parameter this rank holds: which local stage, its qualified name in that stage, the tensor."""

    stage: int  # index into the rank's stage list
    name: str
    param: nn.Parameter


class PipelineOptimizer:
    """Wraps ``base_optimizer`` over this rank's pipeline stages; ``step()`` synchronises as configured.

    ``stages`` are this rank's stages (torch ``PipelineStage`` objects or plain modules); ``pp_group`` is the
    pipeline group (default: the world); ``dp_group`` the data-parallel group of this rank's stage (used by
    STAGE_WISE only). ``ties`` lists tensors tied across stages, each as {global rank: qualified parameter
    name}; every rank passes the same list.
    """

    def __init__(
        self,
        base_optimizer: torch.optim.Optimizer,
        stages: Sequence[nn.Module | Any],
        config: PipelineOptimizerConfig | None = None,
        *,
        pp_group: dist.ProcessGroup | None = None,
        dp_group: dist.ProcessGroup | None = None,
        ties: Sequence[Mapping[int, str]] = (),
    ) -> None:
        if not isinstance(base_optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"PipelineOptimizer wraps a torch.optim.Optimizer; got {type(base_optimizer).__name__}"
            )
        config = dataclasses.replace(config) if config is not None else PipelineOptimizerConfig()
        if not isinstance(config, PipelineOptimizerConfig):
            raise TypeError(f"config must be a PipelineOptimizerConfig; got {type(config).__name__}")
        config.validate()
        if isinstance(stages, nn.Module) or _is_torch_stage(stages) or not isinstance(stages, Sequence):
            raise TypeError(
                "stages must be a list of this rank's stages (nn.Module or PipelineStage); "
                f"got {type(stages).__name__}: wrap a single stage in a list"
            )
        if len(stages) == 0:
            raise ValueError(
                "PipelineOptimizer got an empty stage list; pass the stages this rank runs "
                "(at least one, nn.Module or PipelineStage)"
            )
        if not dist.is_initialized():
            raise RuntimeError(
                "PipelineOptimizer needs an initialised default process group; "
                "call torch.distributed.init_process_group() first"
            )
        self.base_optimizer = base_optimizer
        self.config = config
        self.pp_group = pp_group
        self.dp_group = dp_group
        self.current_rank = dist.get_rank(pp_group)
        if self.current_rank < 0:
            raise ValueError(
                f"rank {dist.get_rank()} is not a member of the pp_group given to PipelineOptimizer; "
                "pass the pipeline group this rank belongs to"
            )
        if dp_group is not None and dist.get_rank(dp_group) < 0:
            raise ValueError(
                f"rank {dist.get_rank()} is not a member of the dp_group given to PipelineOptimizer; "
                "pass the data-parallel group of this rank's stage"
            )
        self.pp_size = dist.get_world_size(pp_group)
        self.dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
        self._stage_ids, self.modules = _unwrap(stages)
        torch_counts = {s.num_stages for s in stages if _is_torch_stage(s)}
        if len(torch_counts) > 1:
            raise ValueError(
                f"this rank's PipelineStages disagree on the number of stages: {sorted(torch_counts)}; "
                "build every stage with the same num_stages"
            )
        self.num_stages = torch_counts.pop() if torch_counts else self.pp_size * len(self.modules)
        self._locals = _local_parameters(self.modules)
        _check_optimizer_holds(base_optimizer, self._locals, self._stage_label)
        self._timeout = timedelta(milliseconds=config.communication_timeout_ms)
        self._ties = self._make_ties(ties)
        self._checked: set[str] = set()  # groups whose layout matched (parameters are fixed at construction)
        self._closed = False

    # ------------------------------------------------------------------------------ public surface

    @property
    def learning_rate(self) -> float:
        """The learning rate of the base optimizer's first parameter group."""
        return self.base_optimizer.param_groups[0]["lr"]

    def set_learning_rate(self, lr: float) -> None:
        """Set the learning rate of every parameter group."""
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr >= 0:
            raise ValueError(f"learning rate must be a number >= 0; got {lr!r}")
        for group in self.base_optimizer.param_groups:
            group["lr"] = lr

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradient of every parameter of every local stage (None, or zeros in place)."""
        self._check_open("zero_grad")
        for module in self.modules:
            for param in module.parameters():
                if param.grad is None:
                    continue
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.detach_()
                    param.grad.zero_()

    def set_gradients(self, grads: Sequence[torch.Tensor]) -> None:
        """Set the gradients by position: local stages in order, each in ``named_parameters()`` order."""
        self._check_open("set_gradients")
        grads = list(grads)
        if len(grads) != len(self._locals):
            raise ValueError(
                f"set_gradients expects one gradient per trainable parameter of this rank's stages "
                f"({len(self._locals)}: {[p.name for p in self._locals]}); got {len(grads)}"
            )
        for index, (local, grad) in enumerate(zip(self._locals, grads)):
            if not isinstance(grad, torch.Tensor) or grad.shape != local.param.shape:
                found = tuple(grad.shape) if isinstance(grad, torch.Tensor) else type(grad).__name__
                raise ValueError(
                    f"set_gradients: gradient {index} is for {self._stage_label(local.stage)} "
                    f"{local.name!r} of shape {tuple(local.param.shape)}; got {found}"
                )
        for local, grad in zip(self._locals, grads):
            local.param.grad = grad.detach().to(dtype=local.param.dtype, device=local.param.device).clone()

    def step(self) -> None:
        """Reduce gradients per the sync mode, reduce tied gradients, step, then broadcast parameters."""
        self._check_open("step")
        mode = self.config.sync_mode
        if self.config.synchronize_gradients:
            if mode in (GradientSyncMode.AVERAGE, GradientSyncMode.SUM):
                self._check_layout("pipeline")
                divisor = self.pp_size if mode is GradientSyncMode.AVERAGE else 1
                self._reduce_gradients(self._locals, self.pp_group, divisor, "the pipeline group")
            elif mode is GradientSyncMode.STAGE_WISE and self.dp_size > 1:
                self._check_layout("data-parallel")
                self._reduce_gradients(self._locals, self.dp_group, self.dp_size, "dp_group")
            if mode is not GradientSyncMode.NONE:
                # after the dp reduction, so each holder adds its replicas' average (Megatron's embedding group)
                for group, local in self._ties:
                    self._reduce_gradients([local], group, 1, "the tie group")
        self.base_optimizer.step()
        if self.config.broadcast_parameters:
            if mode is GradientSyncMode.STAGE_WISE:
                if self.dp_size > 1:
                    self._check_layout("data-parallel")
                    self._broadcast_parameters(self.dp_group, "dp rank 0 over dp_group")
            elif self.pp_size > 1:
                self._check_layout("pipeline")
                self._broadcast_parameters(self.pp_group, "pipeline rank 0 over the pipeline group")

    def get_state(self) -> dict[str, Any]:
        """The base optimizer's state_dict plus the pipeline layout it was saved under."""
        return {"optimizer": self.base_optimizer.state_dict(), "pipeline": self._layout()}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Load a state from :meth:`get_state`; one saved under another layout is a ValueError."""
        if not isinstance(state, Mapping) or "optimizer" not in state or "pipeline" not in state:
            raise ValueError(
                "load_state expects the dict get_state() returns, with keys 'optimizer' and 'pipeline'; got "
                + (f"keys {sorted(state)}" if isinstance(state, Mapping) else type(state).__name__)
            )
        mine, saved = self._layout(), state["pipeline"]
        for field, value in mine.items():
            other = saved.get(field) if isinstance(saved, Mapping) else None
            if field == "parameters" and other is not None:
                other = [(str(name), tuple(shape)) for name, shape in other]
            if other != value:
                raise ValueError(
                    f"load_state on pipeline rank {self.current_rank}: the state was saved under another layout: "
                    f"{field} is {other!r} in the state and {value!r} here; load it with the layout it was "
                    "saved under (same stages, groups and sync mode)"
                )
        self.base_optimizer.load_state_dict(state["optimizer"])

    def close(self) -> None:
        """Stop using the optimizer (idempotent): step() and zero_grad() raise afterwards."""
        self._closed = True
        self._ties = []

    def __enter__(self) -> PipelineOptimizer:  # noqa: PYI034 (Python 3.10 has no typing.Self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------ mechanism

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"PipelineOptimizer.{what}() after close(); build a new PipelineOptimizer")

    def _stage_label(self, index: int) -> str:
        """How errors name local stage ``index``: its pipeline stage number where known."""
        stage_id = self._stage_ids[index]
        if stage_id is not None:
            return f"stage {stage_id}"
        if len(self.modules) == 1:
            return f"stage {self.current_rank}"
        return f"stage {index} of pipeline rank {self.current_rank}"

    def _where(self, index: int | None) -> str:
        """Where this rank sits, for error messages."""
        label = self._stage_label(index) if index is not None else (
            self._stage_label(0) if len(self.modules) == 1 else f"the stages of pipeline rank {self.current_rank}"
        )
        return f"{label} (pipeline rank {self.current_rank}, global rank {dist.get_rank()})"

    def _layout(self) -> dict[str, Any]:
        """What get_state records and load_state compares."""
        return {
            "num_stages": self.num_stages,
            "current_rank": self.current_rank,
            "pp_size": self.pp_size,
            "dp_size": self.dp_size,
            "sync_mode": self.config.sync_mode.value,
            "parameters": [(p.name, tuple(p.param.shape)) for p in self._locals],
        }

    def _make_ties(self, ties: Sequence[Mapping[int, str]]) -> list[tuple[dist.ProcessGroup, _Local]]:
        """One process group per tie (created on every rank: new_group is collective); this rank's holdings."""
        if isinstance(ties, Mapping) or not isinstance(ties, Sequence):
            raise TypeError(f"ties must be a list of {{global rank: parameter name}} dicts; got {ties!r}")
        world, me = dist.get_world_size(), dist.get_rank()
        mine = []
        for number, tie in enumerate(ties):
            if not isinstance(tie, Mapping) or len(tie) < 2:
                raise ValueError(
                    f"ties[{number}] must map at least two global ranks to the name of the tied parameter "
                    f"each holds, e.g. {{0: 'embed.weight', {world - 1}: 'head.weight'}}; got {tie!r}"
                )
            for rank, name in tie.items():
                if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
                    raise ValueError(f"ties[{number}]: {rank!r} is not a global rank (0..{world - 1})")
                if not isinstance(name, str):
                    raise TypeError(f"ties[{number}][{rank}] must be a parameter name; got {name!r}")
            group = dist.new_group(sorted(tie), timeout=self._timeout)
            if me in tie:
                mine.append((group, self._find(tie[me], number)))
        return mine

    def _find(self, name: str, number: int) -> _Local:
        """The local trainable parameter called ``name`` (ties[``number``] names it)."""
        found = [p for p in self._locals if p.name == name]
        if len(found) != 1:
            known = [p.name for p in self._locals]
            problem = "is not a trainable parameter of" if not found else "names a parameter in several of"
            raise ValueError(
                f"ties[{number}] on global rank {dist.get_rank()}: {name!r} {problem} this rank's stages "
                f"(parameters: {known}); name the tied parameter as named_parameters() of its stage gives it"
            )
        return found[0]

    def _wait(self, work: dist.Work | None, op: str, index: int | None) -> None:
        """Wait for ``work`` within the timeout; a timeout or backend error becomes PipelineTimeoutError."""
        if work is None:
            return
        try:
            work.wait(timeout=self._timeout)
        except RuntimeError as exc:  # DistBackendError and gloo's timeout are RuntimeErrors
            raise PipelineTimeoutError(
                f"{self._where(index)}: {op} did not complete within "
                f"{self.config.communication_timeout_ms} ms ({exc}); check that every rank of the group "
                "reaches PipelineOptimizer.step(), or raise communication_timeout_ms"
            ) from exc

    @contextlib.contextmanager
    def _issuing(self, op: str, index: int | None) -> Iterator[None]:
        """Around the call that issues a collective: an error there is reported like one while waiting."""
        try:
            yield
        except RuntimeError as exc:
            raise PipelineTimeoutError(f"{self._where(index)}: {op} failed ({exc})") from exc

    def _reduce_gradients(self, locals_: list[_Local], group: dist.ProcessGroup | None, divisor: int,
                          where: str) -> None:
        """SUM all-reduce each gradient over ``group`` (a missing one as zeros), then divide by ``divisor``."""
        pending = []
        for local in locals_:
            param = local.param
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            op = f"all_reduce of gradient {local.name!r} over {where}"
            with self._issuing(op, local.stage):
                work = dist.all_reduce(param.grad, group=group, async_op=True)
            pending.append((local, op, work))
        # every wait before any division: a gradient is not touched while its reduction is in flight
        for local, op, work in pending:
            self._wait(work, op, local.stage)
        if divisor != 1:
            for local in locals_:
                local.param.grad.div_(divisor)

    def _broadcast_parameters(self, group: dist.ProcessGroup | None, source: str) -> None:
        """Overwrite every local trainable parameter with its counterpart on the group's rank 0."""
        pending = []
        with torch.no_grad():
            for local in self._locals:
                op = f"broadcast of parameter {local.name!r} from {source}"
                tensor = local.param.detach()
                with self._issuing(op, local.stage):
                    work = dist.broadcast(tensor, group=group, group_src=0, async_op=True)
                pending.append((local, op, work))
            for local, op, work in pending:
                self._wait(work, op, local.stage)

    def _check_layout(self, role: str) -> None:
        """Raise PipelineShapeError on every rank unless all ranks of the group hold matching parameters.

        ``role`` is "pipeline" (pp_group) or "data-parallel" (dp_group). Checked once per group: the
        parameters are fixed at construction.
        """
        if role in self._checked:
            return
        group = self.pp_group if role == "pipeline" else self.dp_group
        mine = {
            "where": self._stage_label(0) if len(self.modules) == 1 else f"pipeline rank {self.current_rank}",
            "params": [
                [self._stage_label(p.stage), p.name, list(p.param.shape), str(p.param.dtype)] for p in self._locals
            ],
        }
        everyone = self._all_gather_json(mine, group, f"all_gather of parameter shapes over the {role} group")
        for other in everyone[1:]:
            problem = _mismatch(everyone[0], other)
            if problem is not None:
                advice = (
                    "AVERAGE, SUM and the parameter broadcast of AVERAGE/SUM/NONE match parameters by position "
                    "across the pipeline group, which is right only when every stage holds a replica of the same "
                    "model; for stages that hold different parts of one model use GradientSyncMode.STAGE_WISE "
                    "(with dp_group for their data-parallel replicas)"
                    if role == "pipeline"
                    else "replicas of a stage must hold the same parameters; check the dp_group passed"
                )
                raise PipelineShapeError(f"parameters do not match across the {role} group: {problem}; {advice}")
        self._checked.add(role)

    def _all_gather_json(self, value: Any, group: dist.ProcessGroup | None, op: str) -> list[Any]:
        """``value`` (JSON-able) of every rank of ``group``, in group rank order, through two tensor all-gathers.

        Not all_gather_object: it has no async form, so it could not honour the timeout.
        """
        size = dist.get_world_size(group)
        device = self._collective_device(group)
        data = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8, device=device)
        lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(size)]
        length = torch.tensor([data.numel()], dtype=torch.int64, device=device)
        with self._issuing(op, None):
            work = dist.all_gather(lengths, length, group=group, async_op=True)
        self._wait(work, op, None)
        longest = max(int(t.item()) for t in lengths)
        padded = torch.zeros(longest, dtype=torch.uint8, device=device)
        padded[: data.numel()] = data
        pieces = [torch.zeros(longest, dtype=torch.uint8, device=device) for _ in range(size)]
        with self._issuing(op, None):
            work = dist.all_gather(pieces, padded, group=group, async_op=True)
        self._wait(work, op, None)
        return [json.loads(bytes(p[: int(n.item())].tolist()).decode()) for p, n in zip(pieces, lengths)]

    def _collective_device(self, group: dist.ProcessGroup | None) -> torch.device:
        """Where this rank's tensors for a collective of its own on ``group`` live: with its parameters.

        NCCL reduces tensors on the GPU only (a CPU tensor fails there with "No backend type associated with
        device type cpu"), gloo accepts both; a rank without parameters asks torch which device the group's
        object collectives use.
        """
        if self._locals:
            return self._locals[0].param.device
        kind = dist.distributed_c10d._get_object_coll_device(group)
        return torch.device(kind, torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)


# ---------------------------------------------------------------------------------- helpers


def _is_torch_stage(stage: Any) -> bool:
    """Whether ``stage`` is one of torch's pipeline stages (``PipelineStage``, or what ``build_stage`` returns).

    Recognised by what they have, the module in ``.submod`` and their place in the pipeline, rather than by
    class: importing ``torch.distributed.pipelining`` costs half a second, which every user of
    ``simdist.strategies`` would pay.
    """
    return (not isinstance(stage, nn.Module) and isinstance(getattr(stage, "submod", None), nn.Module)
            and isinstance(getattr(stage, "stage_index", None), int) and isinstance(getattr(stage, "num_stages", None), int))


def _unwrap(stages: Sequence[nn.Module | Any]) -> tuple[list[int | None], list[nn.Module]]:
    """Each stage's pipeline stage number (None for a plain module) and its module."""
    ids: list[int | None] = []
    modules: list[nn.Module] = []
    for index, stage in enumerate(stages):
        if _is_torch_stage(stage):
            ids.append(stage.stage_index)
            modules.append(stage.submod)
        elif isinstance(stage, nn.Module):
            ids.append(None)
            modules.append(stage)
        else:
            raise TypeError(
                f"stages[{index}] must be an nn.Module or a torch PipelineStage; got {type(stage).__name__}"
            )
    return ids, modules


def _local_parameters(modules: list[nn.Module]) -> list[_Local]:
    """The trainable parameters of ``modules``, stage by stage in named_parameters() order, each once."""
    seen: set[int] = set()
    out = []
    for index, module in enumerate(modules):
        for name, param in module.named_parameters():
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                out.append(_Local(index, name, param))
    return out


def _check_optimizer_holds(optimizer: torch.optim.Optimizer, locals_: list[_Local], label: Any) -> None:
    """The optimizer must hold exactly the stages' trainable parameters."""
    held = [p for group in optimizer.param_groups for p in group["params"]]
    held_ids = {id(p) for p in held}
    local_ids = {id(p.param) for p in locals_}
    foreign = [tuple(p.shape) for p in held if id(p) not in local_ids]
    if foreign:
        raise ValueError(
            f"the base optimizer holds {len(foreign)} parameter(s) that are not trainable parameters of this rank's "
            f"stages (shapes {foreign[:5]}); build it over the stages' parameters, "
            "e.g. [p for stage in stages for p in stage.parameters()]"
        )
    missing = [f"{label(p.stage)} {p.name!r}" for p in locals_ if id(p.param) not in held_ids]
    if missing:
        raise ValueError(
            f"the base optimizer does not hold these trainable parameters of this rank's stages: "
            f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; build it over every stage's "
            "parameters, or set requires_grad=False on those that must not train"
        )


def _describe(entry: list[Any], dtype: bool = False) -> str:
    """``stage 0 'layers.0.weight' (8, 4)``, with the dtype when asked."""
    stage, name, shape, dt = entry
    return f"{stage} {name!r} {tuple(shape)}" + (f" {dt.removeprefix('torch.')}" if dtype else "")


def _mismatch(first: dict[str, Any], other: dict[str, Any]) -> str | None:
    """How ``other``'s parameter list differs from ``first``'s by position, or None when they match."""
    for a, b in zip(first["params"], other["params"]):
        if a[2] != b[2] or a[3] != b[3]:
            dtypes = a[2] == b[2]  # same shape: the dtypes differ
            return f"{_describe(a, dtypes)} vs {_describe(b, dtypes)}"
    if len(first["params"]) != len(other["params"]):
        longer, shorter = (first, other) if len(first["params"]) > len(other["params"]) else (other, first)
        n = len(shorter["params"])
        return (
            f"{longer['where']} has {len(longer['params'])} parameters to synchronise and {shorter['where']} "
            f"has {n}: {_describe(longer['params'][n])} has no counterpart"
        )
    return None
