"""Data-parallel training wrappers in plain torch.distributed: naive, flat, overlapped and bucketed.

Each wrapper is a ``torch.nn.Module`` around the user's model, used like torch's
``DistributedDataParallel`` except that the caller ends every synchronising backward with
``finish_gradient_synchronization()``, which leaves in each ``param.grad`` the average over the group::

    model = BucketedDDP(net, bucket_cap_mb=25.0)
    loss_fn(model(batch)).backward()
    model.finish_gradient_synchronization()
    optimizer.step()

| wrapper       | when gradients move                               | collectives per step            |
|---------------|---------------------------------------------------|---------------------------------|
| NaiveDDP      | after backward, one parameter at a time            | one all-reduce per parameter    |
| FlatDDP       | after backward, all gradients in one flat buffer   | one all-reduce per dtype        |
| OverlapDDP    | during backward, as each gradient is accumulated   | one async all-reduce per param  |
| BucketedDDP   | during backward, as each bucket fills              | one async all-reduce per bucket |

Two switches reproduce classic data-parallel bugs, for scenarios that show them (both default to the
correct behaviour): ``dedup=False`` reduces a tied (shared) parameter once per module that holds it,
and ``reduce_hook_tensor=True`` reduces the gradient a tensor hook receives instead of ``param.grad``.

This module imports nothing from the simulator: the same code runs under simdist and under ``real``.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

#: bytes in one MiB; ``bucket_cap_mb`` counts MiB, as torch's DistributedDataParallel does
MIB = 2**20

_TWICE = (
    "{what} received a second gradient before finish_gradient_synchronization(); call it after every "
    "synchronising backward, or run the extra forward and backward passes inside no_sync()"
)

# --------------------------------------------------------------------------------------- policy


def params_to_reduce(module: nn.Module, dedup: bool) -> list[tuple[str, nn.Parameter]]:
    """The (name, parameter) pairs a wrapper reduces, in parameter order; frozen parameters are left out.

    ``dedup=True`` lists every Parameter once: ``named_parameters()`` de-duplicates tied weights.
    ``dedup=False`` walks module by module, so a Parameter held by two modules (an embedding tied to the
    output projection) is listed twice: the classic double-reduction bug.
    """
    if dedup:
        pairs = list(module.named_parameters())
    else:
        pairs = [
            (f"{prefix}.{name}" if prefix else name, param)
            for prefix, sub in module.named_modules()
            for name, param in sub.named_parameters(recurse=False)
        ]
    return [(name, param) for name, param in pairs if param.requires_grad]


def attach_grad_hook(
    param: nn.Parameter, on_grad: Callable[[torch.Tensor], None], reduce_hook_tensor: bool
) -> RemovableHandle:
    """Call ``on_grad(gradient)`` once ``param``'s gradient of the current backward is known.

    Correct (``reduce_hook_tensor=False``): a post-accumulate-grad hook, which runs after autograd has
    added this backward's gradient into ``param.grad`` and hands over ``param.grad`` itself, the tensor
    the optimizer reads (with gradient accumulation, the accumulated sum).
    Bug (``reduce_hook_tensor=True``): a tensor hook, which runs *before* accumulation and hands over the
    incoming gradient. Autograd then copies that tensor into ``param.grad`` (it cannot take it over while
    the hook's user still holds it), so whatever is done to the hook's tensor never reaches the optimizer.
    """
    if reduce_hook_tensor:
        return param.register_hook(lambda grad: on_grad(grad))  # returns None: the gradient is unchanged
    return param.register_post_accumulate_grad_hook(lambda p: on_grad(p.grad))


def assign_buckets(params: list[nn.Parameter], cap_bytes: float) -> list[list[int]]:
    """Indices into ``params`` grouped into buckets, as torch DDP groups them.

    Parameters are taken in reverse order (roughly the order backward produces their gradients); each
    (dtype, device) fills its own open bucket, which closes once it holds ``cap_bytes`` bytes or more.
    Buckets come out in the order they closed, then the partly filled ones.
    """
    open_buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    open_bytes: dict[tuple[torch.dtype, torch.device], int] = {}
    closed: list[list[int]] = []
    for index in reversed(range(len(params))):
        param = params[index]
        key = (param.dtype, param.device)
        open_buckets.setdefault(key, []).append(index)
        open_bytes[key] = open_bytes.get(key, 0) + param.numel() * param.element_size()
        if open_bytes[key] >= cap_bytes:
            closed.append(open_buckets.pop(key))
            del open_bytes[key]
    return closed + list(open_buckets.values())


# ------------------------------------------------------------------------------------ mechanism


class FlatBuffer:
    """One contiguous tensor holding tensors shaped like ``like`` back to back, with a view per slot.

    With ``flags=True`` it ends with one more element per slot, reduced together with the data: each rank
    writes 1 where it has a gradient, so after a SUM all-reduce a slot's flag counts the ranks that had
    one (0: no rank did, the parameter keeps ``grad=None``, as in a single process).
    """

    def __init__(self, like: list[torch.Tensor], flags: bool = False) -> None:
        numels = [t.numel() for t in like]
        total = sum(numels)
        self.data = torch.zeros(total + (len(like) if flags else 0), dtype=like[0].dtype, device=like[0].device)
        self.views = [view.view_as(t) for view, t in zip(self.data[:total].split(numels), like)]
        self.flags = self.data[total:] if flags else None

    def copy_in(self, tensors: list[torch.Tensor]) -> None:
        """Copy ``tensors`` into their slots."""
        torch._foreach_copy_(self.views, tensors)

    def copy_out(self, tensors: list[torch.Tensor]) -> None:
        """Copy the slots into ``tensors``."""
        torch._foreach_copy_(tensors, self.views)

    def fill(self, grads: list[torch.Tensor | None]) -> None:
        """Copy the gradients in (zeros where None) and set the flags to which slots have one."""
        present = [(v, g) for v, g in zip(self.views, grads) if g is not None]
        if present:
            torch._foreach_copy_([v for v, _ in present], [g for _, g in present])
        for view, grad in zip(self.views, grads):
            if grad is None:
                view.zero_()
        if self.flags is not None:
            self.flags.copy_(torch.tensor([g is not None for g in grads], dtype=self.flags.dtype))

    def average_out(self, targets: list[torch.Tensor | None], params: list[nn.Parameter], count: int) -> None:
        """Write each slot divided by ``count`` into its target (``param.grad``, created if needed) where
        some rank had a gradient; leave the others alone."""
        had = self.flags.tolist() if self.flags is not None else [1] * len(self.views)
        for view, target, param, ranks in zip(self.views, targets, params, had):
            if ranks:
                # One pass over the memory: dividing the buffer first and copying after would read it twice.
                torch.div(view, count, out=target if target is not None else grad_or_zeros(param))


def by_dtype_and_device(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` split into runs of one dtype and device, each in its original order."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return list(groups.values())


def broadcast_from_first(tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Overwrite ``tensors`` with the values of the group's first rank: one broadcast per dtype."""
    with torch.no_grad():
        for same in by_dtype_and_device(tensors):
            flat = FlatBuffer(same)
            flat.copy_in(same)
            dist.broadcast(flat.data, group=group, group_src=0)
            flat.copy_out(same)


def grad_or_zeros(param: nn.Parameter) -> torch.Tensor:
    """``param.grad``, created as zeros first if this rank computed none (it still takes part)."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad


def refuse_sparse(module: nn.Module, wrapper: str) -> None:
    """A clear error for modules that produce sparse gradients, which flat buffers cannot hold."""
    if not isinstance(module, nn.Module):
        return  # the wrapper says what it needs
    sparse = [name or type(module).__name__ for name, m in module.named_modules() if getattr(m, "sparse", False) is True]
    if sparse:
        raise ValueError(
            f"{wrapper} copies gradients into flat buffers, which cannot hold the sparse gradients of "
            f"{', '.join(sparse)}; use NaiveDDP or OverlapDDP, or build the embedding with sparse=False"
        )


def _remove_hooks(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()


# ------------------------------------------------------------------------------------ wrappers


class _DataParallel(nn.Module):
    """What every wrapper shares: checks, the broadcast at wrap time and per forward, ``no_sync()``, hooks."""

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None = None,
        *,
        dedup: bool = True,
        broadcast_buffers: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"{type(self).__name__} wraps a torch.nn.Module; got {type(module).__name__}")
        if not dist.is_initialized():
            raise RuntimeError(
                f"{type(self).__name__} needs an initialised default process group; "
                "call torch.distributed.init_process_group() first"
            )
        if process_group is not None and dist.get_rank(process_group) < 0:
            raise ValueError(
                f"rank {dist.get_rank()} is not a member of the process_group given to "
                f"{type(self).__name__}; wrap only on the ranks passed to dist.new_group()"
            )
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.dedup = dedup
        self.broadcast_buffers = broadcast_buffers
        self._reduced = params_to_reduce(module, dedup)
        self._module_buffers = list(module.buffers())
        self._require_sync = True  # False inside no_sync()
        self._sync_this_backward = True  # fixed by the forward that builds the graph, as in torch DDP
        self._synchronized = False  # finish already ran for the last forward
        self._sync_buffers_next = True  # torch DDP skips it after a forward in no_sync() or no_grad
        # Hooks hold the wrapper weakly and go when it goes: a discarded wrapper must not keep reducing.
        self._hook_handles: list[RemovableHandle] = []
        weakref.finalize(self, _remove_hooks, self._hook_handles)
        # Every replica starts from the first rank's state, frozen parameters included.
        broadcast_from_first(list(module.parameters()) + self._module_buffers, process_group)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Refresh buffers from the first rank (as torch DDP does), then run the wrapped module."""
        if self.broadcast_buffers and self._module_buffers and self._sync_buffers_next:
            broadcast_from_first(self._module_buffers, self.process_group)
        self._sync_this_backward = self._require_sync
        self._sync_buffers_next = self._require_sync and torch.is_grad_enabled()
        self._synchronized = False
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside: backward only accumulates local gradients, no collective is issued.

        As in torch DDP the forward decides: the backward of a forward run inside ``no_sync()`` does not
        synchronise, and the next synchronising backward reduces the accumulated ``param.grad``.
        """
        previous = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = previous

    def _attach(self, param: nn.Parameter, key: Any, reduce_hook_tensor: bool) -> None:
        """Call ``self._on_grad(key, gradient)`` when ``param``'s gradient of a backward is known."""
        me = weakref.ref(self)

        def on_grad(grad: torch.Tensor) -> None:
            wrapper = me()
            if wrapper is not None and wrapper._sync_this_backward:
                wrapper._on_grad(key, grad)

        self._hook_handles.append(attach_grad_hook(param, on_grad, reduce_hook_tensor))

    def _on_grad(self, key: Any, grad: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} registers no gradient hooks")

    def finish_gradient_synchronization(self) -> None:
        """Wait for the gradient reductions and leave the group average in every ``param.grad``."""
        raise NotImplementedError(f"{type(self).__name__} must define finish_gradient_synchronization")


class NaiveDDP(_DataParallel):
    """After backward, one synchronous all-reduce per parameter gradient, then divide by the group size.

    First one small all-reduce counts, per parameter, the ranks that have a gradient: a parameter no rank
    used keeps ``grad=None`` (as in a single process; a zero gradient would still move it under weight
    decay), one used on some ranks only takes part with zeros elsewhere.

    ``dedup=False`` lists a tied parameter once per module holding it, so its gradient is reduced twice:
    numerically harmless here (the second all-reduce sums values already equal on every rank and the
    division undoes it) but one wasted all-reduce per tie, visible in the trace.
    """

    def finish_gradient_synchronization(self) -> None:
        """All-reduce and average every gradient some rank has, one parameter after the other."""
        if not self._sync_this_backward or self._synchronized or not self._reduced:
            return
        self._synchronized = True
        first = self._reduced[0][1]
        had = torch.tensor([p.grad is not None for _, p in self._reduced], dtype=torch.float32, device=first.device)
        dist.all_reduce(had, group=self.process_group)
        for (_, param), ranks in zip(self._reduced, had.tolist()):
            if ranks:
                grad = grad_or_zeros(param)
                dist.all_reduce(grad, group=self.process_group)
                grad.div_(self.world_size)


class FlatDDP(_DataParallel):
    """After backward, all gradients copied into one flat buffer (one per dtype), one all-reduce, copied back.

    The buffer carries one flag per parameter (see :class:`FlatBuffer`): a parameter no rank used keeps
    ``grad=None``; one used on some ranks only takes part with zeros elsewhere. ``dedup=False`` gives a
    tied parameter two slots in the buffer: the same average lands in both, so only the bytes of one
    extra copy are wasted. Sparse gradients are refused at wrap time.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None = None,
        *,
        dedup: bool = True,
        broadcast_buffers: bool = True,
    ) -> None:
        refuse_sparse(module, type(self).__name__)
        super().__init__(module, process_group, dedup=dedup, broadcast_buffers=broadcast_buffers)
        params = [param for _, param in self._reduced]
        # Allocated once: a step only copies into and out of these buffers.
        self._flats = [(group, FlatBuffer(group, flags=True)) for group in by_dtype_and_device(params)]

    def finish_gradient_synchronization(self) -> None:
        """Flatten, all-reduce, average, unflatten: one collective per dtype."""
        if not self._sync_this_backward or self._synchronized:
            return
        self._synchronized = True
        for params, flat in self._flats:
            grads = [p.grad for p in params]
            flat.fill(grads)
            dist.all_reduce(flat.data, group=self.process_group)
            flat.average_out(grads, params, self.world_size)


class OverlapDDP(_DataParallel):
    """During backward, each gradient is all-reduced asynchronously as soon as autograd has accumulated it.

    ``finish_gradient_synchronization()`` waits for every reduction, then divides each reduced tensor by
    the group size. A parameter whose gradient hook did not fire in this backward is reduced there if it
    has a ``param.grad`` (accumulated inside ``no_sync()``), else left with ``grad=None``. The all-reduces
    are issued in the order gradients arrive, so every rank must produce gradients for the same parameters
    in the same backward (as torch DDP without ``find_unused_parameters``); NaiveDDP, FlatDDP and
    BucketedDDP also handle parameters used on some ranks only.

    ``dedup=False`` registers one hook per (module, parameter) pair, so a tied weight gets two in-place
    all-reduces of the same ``param.grad`` in flight at once and is divided twice. On an NCCL-like
    backend the two run one after the other and the result is still the average (sum of sums / n / n);
    on a gloo-like backend both progress concurrently on one buffer and race: the result depends on timing.
    ``reduce_hook_tensor=True`` all-reduces the tensor a gradient hook receives instead of ``param.grad``
    (see :func:`attach_grad_hook`): the reduction runs, but ``param.grad`` is autograd's copy of that
    tensor, taken before the reduction finished, so the optimizer steps with unsynchronised gradients and
    the replicas drift apart from the first step on.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None = None,
        *,
        dedup: bool = True,
        reduce_hook_tensor: bool = False,
        broadcast_buffers: bool = True,
    ) -> None:
        super().__init__(module, process_group, dedup=dedup, broadcast_buffers=broadcast_buffers)
        self.reduce_hook_tensor = reduce_hook_tensor
        self._fired = [False] * len(self._reduced)
        self._handles: list[tuple[torch.Tensor, dist.Work]] = []
        for index, (_, param) in enumerate(self._reduced):
            self._attach(param, index, reduce_hook_tensor)

    def _on_grad(self, index: int, grad: torch.Tensor) -> None:
        if self._fired[index]:
            raise RuntimeError(_TWICE.format(what=f"parameter {self._reduced[index][0]!r}"))
        self._fired[index] = True
        self._reduce_async(grad)

    def _reduce_async(self, tensor: torch.Tensor) -> None:
        """Start an in-place SUM all-reduce of ``tensor`` and remember it for the finish."""
        self._handles.append((tensor, dist.all_reduce(tensor, group=self.process_group, async_op=True)))

    def finish_gradient_synchronization(self) -> None:
        """Reduce what no hook reduced, wait for everything, then divide each reduced tensor."""
        try:
            if not self._sync_this_backward or not any(self._fired):
                return
            for fired, (_, param) in zip(self._fired, self._reduced):
                if not fired and param.grad is not None:
                    self._reduce_async(param.grad)
            # Every wait comes before any division: a tensor is never touched while a reduction is in
            # flight on it (with dedup=False a tied gradient has two).
            for _, work in self._handles:
                work.wait()
            for tensor, _ in self._handles:
                tensor.div_(self.world_size)
        finally:
            self._fired = [False] * len(self._reduced)
            self._handles = []


class _Bucket:
    """One bucket: its flat buffer, which slots this backward filled, its all-reduce once issued."""

    def __init__(self, entries: list[int], params: list[nn.Parameter]) -> None:
        self.entries = entries  # indices into the wrapper's reduction list, one per slot
        self.params = params
        self.flat = FlatBuffer(params, flags=True)
        self.targets: list[torch.Tensor | None] = [None] * len(params)  # where each slot's average goes
        self.filled = 0
        self.work: dist.Work | None = None

    @property
    def ready(self) -> bool:
        """Whether every slot has this backward's gradient."""
        return self.filled == len(self.params)

    def reset(self) -> None:
        """Forget this backward's state (the buffer is overwritten next time)."""
        self.targets = [None] * len(self.params)
        self.filled = 0
        self.work = None


class BucketedDDP(_DataParallel):
    """During backward, gradients are copied into buckets of about ``bucket_cap_mb`` MiB; a full bucket is
    all-reduced asynchronously, as torch's DistributedDataParallel does.

    Buckets hold parameters in reverse order, one dtype each (see :func:`assign_buckets`), and are issued
    strictly in bucket order so every rank issues the same sequence. ``finish_gradient_synchronization()``
    issues the buckets still open, waits for each, divides by the group size and copies every slot back
    into the gradient it came from. A parameter whose hook did not fire in this backward (unused on this
    rank) contributes its ``param.grad`` as it stands, zeros if None; one no rank used keeps ``grad=None``
    (each bucket carries a flag per slot, see :class:`FlatBuffer`). Unlike torch DDP, buckets are not
    rebuilt in the order gradients arrived in the first iteration, and there is no smaller first bucket.
    Sparse gradients are refused at wrap time.

    ``dedup=False`` gives a tied weight two slots: both receive the same gradient and the same average,
    so the only cost is the extra bytes on the wire. ``reduce_hook_tensor=True`` copies the tensor a
    gradient hook receives into the bucket and the average back into that tensor, not into
    ``param.grad``: the collectives run, the optimizer never sees their result, replicas drift apart.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None = None,
        *,
        bucket_cap_mb: float = 25.0,
        dedup: bool = True,
        reduce_hook_tensor: bool = False,
        broadcast_buffers: bool = True,
    ) -> None:
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)):
            raise TypeError(f"bucket_cap_mb must be a number of MiB; got {bucket_cap_mb!r}")
        if not (math.isfinite(bucket_cap_mb) and bucket_cap_mb > 0):
            raise ValueError(f"bucket_cap_mb must be a finite number of MiB > 0; got {bucket_cap_mb!r}")
        refuse_sparse(module, type(self).__name__)
        super().__init__(module, process_group, dedup=dedup, broadcast_buffers=broadcast_buffers)
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.reduce_hook_tensor = reduce_hook_tensor
        params = [param for _, param in self._reduced]
        self._buckets = [
            _Bucket(entries, [params[i] for i in entries])
            for entries in assign_buckets(params, self.bucket_cap_mb * MIB)
        ]
        self._next_to_issue = 0
        for b, bucket in enumerate(self._buckets):
            for slot, entry in enumerate(bucket.entries):
                self._attach(params[entry], (b, slot), reduce_hook_tensor)

    def _on_grad(self, key: tuple[int, int], grad: torch.Tensor) -> None:
        bucket, slot = self._buckets[key[0]], key[1]
        if bucket.targets[slot] is not None:
            raise RuntimeError(_TWICE.format(what=f"parameter {self._reduced[bucket.entries[slot]][0]!r}"))
        bucket.flat.views[slot].copy_(grad)
        bucket.targets[slot] = grad
        bucket.filled += 1
        self._issue_ready()

    def _issue_ready(self) -> None:
        """Start the all-reduce of every full bucket whose predecessors have all started."""
        while self._next_to_issue < len(self._buckets) and self._buckets[self._next_to_issue].ready:
            self._issue(self._buckets[self._next_to_issue])

    def _issue(self, bucket: _Bucket) -> None:
        """Start ``bucket``'s in-place SUM all-reduce (it must be the next one in bucket order)."""
        flags = bucket.flat.flags
        flags.copy_(torch.tensor([t is not None for t in bucket.targets], dtype=flags.dtype))
        bucket.work = dist.all_reduce(bucket.flat.data, group=self.process_group, async_op=True)
        self._next_to_issue += 1

    def finish_gradient_synchronization(self) -> None:
        """Issue the open buckets, wait for each in order, average and copy the slots back."""
        try:
            if not self._sync_this_backward or not any(b.filled for b in self._buckets):
                return
            for bucket in self._buckets[self._next_to_issue :]:
                for slot, param in enumerate(bucket.params):
                    if bucket.targets[slot] is None:  # no gradient in this backward
                        if param.grad is not None:  # accumulated inside no_sync()
                            bucket.targets[slot] = param.grad
                            bucket.flat.views[slot].copy_(param.grad)
                        else:
                            bucket.flat.views[slot].zero_()
                self._issue(bucket)
            for bucket in self._buckets:
                bucket.work.wait()
                bucket.flat.average_out(bucket.targets, bucket.params, self.world_size)
        finally:
            for bucket in self._buckets:
                bucket.reset()
            self._next_to_issue = 0
