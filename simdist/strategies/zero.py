"""ZeRO stage 1 in plain torch.distributed: an optimizer whose state is split over the ranks of a group.

Every rank holds every parameter and its (already averaged) gradient, as under DDP; the optimizer state is
what is sharded. Each rank owns a contiguous run of the parameters, keeps the inner optimizer's state for
those only, steps them, and then broadcasts each updated parameter from its owner::

    model = DistributedDataParallel(net)
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    loss_fn(model(batch)).backward()
    opt.step()                  # steps this rank's share, then one broadcast per parameter from its owner
    opt.zero_grad()

With mixed-precision Adam this takes the per-rank bytes of the model states from 16 Psi (DDP) to
4 Psi + 12 Psi / N (Rajbhandari et al., "ZeRO", 2020, section 5.1); the results equal the unsharded
optimizer's, bitwise, because each parameter is stepped by the same optimizer code on the same gradient.

This module imports nothing from the simulator: the same code runs under simdist and under ``real``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

#: key of a state dict that holds one rank's share only (``state_dict(consolidate_to=None)``)
SHARD_KEY = "zero_shard"


def partition_parameters(numels: list[int], world_size: int) -> list[int]:
    """The owning rank of each parameter: contiguous runs in parameter order, balanced by element count.

    Parameter ``i`` goes to the rank whose equal slice ``[r T / N, (r + 1) T / N)`` of the running element
    count (``T`` elements in all, ``N`` ranks) holds its middle element. Owners never decrease, so each
    rank's share is a contiguous run (possibly empty when there are fewer parameters than ranks), and a
    share exceeds ``T / N`` by at most half of its largest parameter on each side. Integer arithmetic only:
    every rank computes the same partition.
    """
    if world_size < 1:
        raise ValueError(f"partition_parameters needs a world size of at least 1; got {world_size}")
    total = sum(numels)
    if total == 0:
        # nothing to balance: spread by count, still contiguous
        return [i * world_size // max(len(numels), 1) for i in range(len(numels))]
    owners, before = [], 0
    for n in numels:
        owners.append(min(world_size - 1, (2 * before + n) * world_size // (2 * total)))
        before += n
    return owners


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's settings without its parameters."""
    return {k: v for k, v in group.items() if k != "params"}


#: what torch's optimizers say of a set of parameters (torch/optim/optimizer.py, ``add_param_group``)
UNORDERED = (
    "optimizer parameters need to be organized in ordered collections, but the ordering of tensors in sets will "
    "change between runs. Please use a list instead."
)


def _refuse_unordered(params: object) -> None:
    """Raise torch's TypeError for a set of parameters (a frozenset too: its order differs between processes).

    torch refuses a set only inside a param group and takes a bare set as a list; here every rank must list
    the parameters in one order, and a set of tensors is ordered by their ids, which differ on every rank.
    """
    if isinstance(params, (set, frozenset)):
        raise TypeError(UNORDERED)


def _describe(groups: list[dict[str, Any]], first: int = 0) -> list[tuple[str, str]]:
    """Each parameter as (``param group g, position i``, ``(shape) dtype[, frozen][, 'name']``), in param-group
    order (``groups`` numbered from ``first``)."""
    out = []
    for g, group in enumerate(groups, first):
        names = group.get("param_names")
        for i, p in enumerate(group["params"]):
            frozen = "" if p.requires_grad else " frozen"
            what = f"{tuple(p.shape)} {str(p.dtype).removeprefix('torch.')}{frozen}"
            out.append((f"param group {g}, position {i}", what + (f" {names[i]!r}" if names else "")))
    return out


def _first_difference(everyone: list[list[tuple[str, str]]], ranks: list[int]) -> str:
    """Where the first rank whose parameter list differs from the group's first rank's differs from it."""
    first = everyone[0]
    for index in range(max(len(d) for d in everyone)):
        for r, theirs in enumerate(everyone[1:], 1):
            where = (first if index < len(first) else theirs)[index][0]
            a = first[index][1] if index < len(first) else "nothing"
            b = theirs[index][1] if index < len(theirs) else "nothing"
            if a != b:
                return (
                    f"at {where}: rank {ranks[0]} has {a} and rank {ranks[r]} has {b} "
                    f"(rank {ranks[0]} lists {len(first)} parameters, rank {ranks[r]} {len(theirs)})"
                )
    return "the lists agree"  # not reached: equal lists have equal hashes


def _digest(descriptions: list[tuple[str, str]]) -> int:
    """A 63-bit hash of ``descriptions`` that is the same in every process (unlike ``hash()``)."""
    data = "\n".join(f"{where}: {what}" for where, what in descriptions).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1: ``optimizer_cls`` stepped on this rank's share of ``params``, updates broadcast from the owners.

    ``param_groups`` lists every parameter, as the unsharded optimizer's would, so learning-rate schedulers
    and ``zero_grad`` work unchanged; ``optim`` is the inner optimizer over this rank's share and ``state``
    is its state (this rank's share only). Parameters without a gradient are skipped by the inner optimizer,
    as torch optimizers skip them; frozen parameters (``requires_grad=False``) are never broadcast.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_cls: type[torch.optim.Optimizer],
        *,
        group: dist.ProcessGroup | None = None,
        **kwargs: Any,
    ) -> None:
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(
                "ShardedOptimizer's optimizer_cls must be a torch.optim.Optimizer subclass, the class itself "
                f"(for example torch.optim.AdamW, with its settings as keyword arguments); got {optimizer_cls!r}"
            )
        if isinstance(optimizer_cls, type) and issubclass(optimizer_cls, ShardedOptimizer):
            raise TypeError("ShardedOptimizer cannot shard another ShardedOptimizer; pass the inner optimizer class")
        if not dist.is_initialized():
            raise RuntimeError(
                "ShardedOptimizer needs an initialised default process group; "
                "call torch.distributed.init_process_group() first"
            )
        if group is not None and dist.get_rank(group) < 0:
            raise ValueError(
                f"rank {dist.get_rank()} is not a member of the group given to ShardedOptimizer; "
                "build it only on the ranks passed to dist.new_group()"
            )
        if isinstance(params, torch.Tensor):
            raise TypeError(
                "params argument given to the optimizer should be an iterable of Tensors or dicts, but got "
                + torch.typename(params)
            )
        _refuse_unordered(params)
        params = list(params)
        empty = ValueError(
            "ShardedOptimizer got an empty parameter list; pass the model's parameters "
            "(model.parameters()) or param groups that hold at least one parameter"
        )
        if not params:
            raise empty
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._optimizer_cls = optimizer_cls
        self._owners: list[int] = []  # per parameter in param-group order: its owning rank (in the group)
        self.optim: torch.optim.Optimizer | None = None
        super().__init__(params, dict(kwargs))  # calls add_param_group per group
        if not self._flat_params():
            raise empty
        self._check_same_parameters(self.param_groups)
        self._build_inner(kwargs)

    # ------------------------------------------------------------------------------ the shares

    def _flat_params(self) -> list[torch.Tensor]:
        """Every parameter in param-group order (the order of the unsharded optimizer's state dict)."""
        return [p for g in self.param_groups for p in g["params"]]

    def _owned(self, group: dict[str, Any], owners: list[int]) -> list[torch.Tensor]:
        return [p for p, owner in zip(group["params"], owners) if owner == self.rank]

    def _build_inner(self, kwargs: dict[str, Any]) -> None:
        """Partition the parameters and build the inner optimizer over this rank's share."""
        self._owners = partition_parameters([p.numel() for p in self._flat_params()], self.world_size)
        inner_groups, start = [], 0
        for g in self.param_groups:
            owners = self._owners[start : start + len(g["params"])]
            start += len(g["params"])
            # one inner group per group, empty where this rank owns none of it, so indices line up
            inner_groups.append({**_hyperparameters(g), "params": self._owned(g, owners)})
        self.optim = self._optimizer_cls(inner_groups, **kwargs)
        # the inner optimizer fills in its defaults (betas, eps, ...): show them as torch's own optimizer would
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            for key, value in _hyperparameters(inner).items():
                outer.setdefault(key, value)
        self.defaults = {**self.optim.defaults, **self.defaults}
        self.state = self.optim.state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group: its parameters are partitioned over the ranks on their own, by the same rule.

        Once the optimizer is built this is a collective: every rank of the group adds the same parameters.
        """
        if isinstance(param_group, dict):
            _refuse_unordered(param_group.get("params"))
        super().add_param_group(param_group)
        if self.optim is None:
            return  # still in __init__: the shares are built once every group is in
        added = self.param_groups[-1]
        self._check_same_parameters([added], len(self.param_groups) - 1)
        owners = partition_parameters([p.numel() for p in added["params"]], self.world_size)
        self._owners += owners
        self.optim.add_param_group({**_hyperparameters(added), "params": self._owned(added, owners)})

    def _check_same_parameters(self, groups: list[dict[str, Any]], first: int = 0) -> None:
        """Raise ValueError on every rank unless every rank of the group lists the same parameters in one order.

        The shares are cut by position, so a rank that orders its parameters differently would step and
        broadcast the wrong tensors without a word. Compared by shape, dtype, ``requires_grad`` and name (where
        given): one all-gather of a hash; the descriptions travel only when the hashes differ, to name the first
        parameter that differs.
        """
        if self.world_size == 1:
            return
        mine = _describe(groups, first)
        device = self._flat_params()[0].device
        digest = torch.tensor([_digest(mine)], dtype=torch.int64, device=device)
        hashes = [torch.zeros_like(digest) for _ in range(self.world_size)]
        dist.all_gather(hashes, digest, group=self.group)
        if all(int(h.item()) == int(hashes[0].item()) for h in hashes):
            return
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.group)
        ranks = dist.get_process_group_ranks(self.group if self.group is not None else dist.group.WORLD)
        raise ValueError(
            f"ShardedOptimizer got different parameters on the ranks of its group: {_first_difference(everyone, ranks)}. "
            "The shares are cut by position, so every rank must pass the same parameters in the same order: "
            "model.parameters() or a list of them, never a set"
        )

    def owned_parameters(self) -> list[torch.Tensor]:
        """The parameters whose optimizer state this rank keeps, in param-group order."""
        return [p for p, owner in zip(self._flat_params(), self._owners) if owner == self.rank]

    def owner_of(self, param: torch.Tensor) -> int:
        """The rank (in the group) that steps ``param`` and broadcasts it."""
        for p, owner in zip(self._flat_params(), self._owners):
            if p is param:
                return owner
        raise KeyError(
            f"owner_of got a tensor of shape {tuple(param.shape)} that is none of this ShardedOptimizer's "
            "parameters; pass one of the parameters it was built with (opt.param_groups[i]['params'])"
        )

    # ------------------------------------------------------------------------------ stepping

    def _sync_hyperparameters(self) -> None:
        """Copy the groups' settings (a scheduler may have changed ``lr``) into the inner optimizer."""
        assert self.optim is not None
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            inner.update(_hyperparameters(outer))

    @torch.no_grad()
    def _broadcast_updates(self) -> None:
        """Every trainable parameter from its owner to the other ranks: all issued, then all waited."""
        if self.world_size == 1:
            return
        works = [
            dist.broadcast(p.detach(), group_src=owner, group=self.group, async_op=True)
            for p, owner in zip(self._flat_params(), self._owners)
            if p.requires_grad
        ]
        for work in works:
            work.wait()

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Call ``closure`` (with grad enabled) if given, step this rank's share, broadcast the updates."""
        assert self.optim is not None
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_hyperparameters()
        self.optim.step()
        self._broadcast_updates()
        return loss

    # ------------------------------------------------------------------------------ state dicts

    def _local_state_dict(self) -> dict[str, Any]:
        """This rank's share in the unsharded optimizer's format: state keyed by global parameter index."""
        assert self.optim is not None
        self._sync_hyperparameters()
        inner = self.optim.state_dict()
        index = {id(p): i for i, p in enumerate(self._flat_params())}
        local_to_global = [index[id(p)] for g in self.optim.param_groups for p in g["params"]]
        groups, start = [], 0
        for g in self.param_groups:
            groups.append({**_hyperparameters(g), "params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        return {"state": {local_to_global[i]: s for i, s in inner["state"].items()}, "param_groups": groups}

    def state_dict(self, *, consolidate_to: int | None = 0) -> dict[str, Any]:  # type: ignore[override]
        """The optimizer state, consolidated on rank ``consolidate_to`` of the group (a collective), or None.

        On ``consolidate_to`` the result is what the unsharded optimizer's ``state_dict()`` would be (state
        keyed by parameter index over all param groups), loadable here or into that optimizer. Every other
        rank, and every rank when ``consolidate_to`` is None (no collective), gets its own share, marked
        with ``"zero_shard": {"rank", "world_size"}``.
        """
        local = self._local_state_dict()
        shard = {**local, SHARD_KEY: {"rank": self.rank, "world_size": self.world_size}}
        if consolidate_to is None:
            return shard
        if not 0 <= consolidate_to < self.world_size:
            raise ValueError(
                f"state_dict(consolidate_to={consolidate_to}) names no rank of a group of {self.world_size}; "
                f"pass a rank in 0..{self.world_size - 1}, or None for this rank's share"
            )
        gathered: list[Any] | None = [None] * self.world_size if self.rank == consolidate_to else None
        dist.gather_object(local["state"], gathered, group=self.group, group_dst=consolidate_to)
        if gathered is None:
            return shard
        state: dict[int, Any] = {}
        for part in gathered:
            state.update(part)
        return {"state": dict(sorted(state.items())), "param_groups": local["param_groups"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a consolidated state dict (or an unsharded optimizer's), or this rank's own share."""
        assert self.optim is not None
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if groups is None or "state" not in state_dict:
            raise ValueError(
                "ShardedOptimizer.load_state_dict expects a dict with 'state' and 'param_groups' (from "
                f"state_dict() or a torch optimizer's state_dict()); got {type(state_dict).__name__} "
                f"with keys {sorted(state_dict) if isinstance(state_dict, dict) else None}"
            )
        want = [len(g["params"]) for g in self.param_groups]
        found = [len(g["params"]) for g in groups]
        if want != found:
            raise ValueError(
                f"the state dict's param groups hold {found} parameters, this optimizer's hold {want}; "
                "load a state dict saved from an optimizer over the same parameters and groups"
            )
        shard = state_dict.get(SHARD_KEY)
        if shard is not None and (shard["rank"], shard["world_size"]) != (self.rank, self.world_size):
            raise ValueError(
                f"this state dict is rank {shard['rank']}'s share of a group of {shard['world_size']}; rank "
                f"{self.rank} of {self.world_size} cannot load it. Load each share on the rank that saved it, or "
                "save with state_dict(consolidate_to=0) and load the consolidated dict on every rank"
            )
        index = {id(p): i for i, p in enumerate(self._flat_params())}
        saved = state_dict["state"]
        inner_state, local = {}, 0
        inner_groups = []
        for g, saved_group in zip(self.optim.param_groups, groups):
            ids = []
            for p in g["params"]:
                g_index = index[id(p)]
                if g_index in saved:
                    inner_state[local] = saved[g_index]
                ids.append(local)
                local += 1
            inner_groups.append({**_hyperparameters(saved_group), "params": ids})
        self.optim.load_state_dict({"state": inner_state, "param_groups": inner_groups})
        for outer, saved_group in zip(self.param_groups, groups):
            outer.update(_hyperparameters(saved_group))
        self.state = self.optim.state  # torch's load_state_dict replaced the inner state dict


__all__ = ["SHARD_KEY", "ShardedOptimizer", "partition_parameters"]
