"""Swapping the data behind two tensor objects while each object keeps what is its own: its attributes and hooks.

On a GPU, ``Module.to("cuda")`` moves a parameter by ``param.data = moved``: the parameter's C++ tensor takes the
new data and stays, and so does everything its Python object holds (attributes, the hooks of ``register_hook``
and ``register_post_accumulate_grad_hook``). A tensor on a simulated GPU is a wrapper subclass, whose data a
plain tensor cannot take, so torch moves it with ``torch.utils.swap_tensors`` instead (``Module._apply`` does so
for every wrapper subclass). That swap exchanges the C++ tensors and the ``__dict__`` of the two
objects, but not all that autograd reads: a tensor's hook dicts are fields of its Python object and stay, while
the autograd hooks that call them belong to its C++ tensor and leave. Left so, a hook registered before the move
would never fire again, nor would one registered after it where the object already had a dict (the memory
accounting puts a post-accumulate-grad hook on every parameter): a data-parallel program written with such hooks
would never reduce a gradient. Its attributes (``param.my_flag = ...``) would leave with the ``__dict__`` too.

:func:`swap_keeping_own` makes such a swap what ``param.data = moved`` is on a GPU.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection

import torch


def swap_keeping_own(
    swap: Callable[[torch.Tensor, torch.Tensor], None],
    t1: torch.Tensor,
    t2: torch.Tensor,
    data_state: Collection[str],
) -> None:
    """``swap(t1, t2)`` (torch's ``swap_tensors``), after which each object keeps its own attributes (all but
    ``data_state``, which belong to the data and move with it) and its own hooks, called by the C++ tensor it
    now holds."""
    objects = (t1, t2)
    attributes = [{k: v for k, v in vars(t).items() if k not in data_state} for t in objects]
    hooked = any(t._backward_hooks is not None for t in objects)
    posted = [t._post_accumulate_grad_hooks is not None for t in objects]
    swap(t1, t2)
    for t, own in zip(objects, attributes):
        state = {k: v for k, v in vars(t).items() if k in data_state}
        vars(t).clear()
        vars(t).update(state)
        vars(t).update(own)
    if hooked or any(posted):
        for t, partner_posted in zip(objects, reversed(posted)):
            _bind_hooks(t, partner_posted)


def _bind_hooks(t: torch.Tensor, partner_posted: bool) -> None:
    """Make ``t``'s C++ tensor call ``t``'s hook dicts, and only those (it may carry hooks of the other object)."""
    if t.grad_fn is not None:
        # a non-leaf's hooks live on its grad_fn, which the swap leaves alone (swap_tensors refuses one in use)
        return
    # the setter drops the C++ tensor's hooks and binds the dict given (None: none)
    t._backward_hooks = t._backward_hooks
    post = t._post_accumulate_grad_hooks
    if post is not None:
        t._post_accumulate_grad_hooks = post
    elif partner_posted:
        # setting None leaves the C++ tensor's post-accumulate-grad hooks in place: an empty dict replaces them
        t._post_accumulate_grad_hooks = OrderedDict()
