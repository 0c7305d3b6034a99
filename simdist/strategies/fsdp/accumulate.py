"""GradientAccumulator: collect gradients of several micro-batches by name and hand back their sums."""

from __future__ import annotations

from collections.abc import Mapping

import torch


class GradientAccumulator:
    """Keeps a copy of each micro-batch's gradients by name; complete once every name has ``accumulation_steps``."""

    def __init__(self, accumulation_steps: int = 1) -> None:
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps <= 0:
            raise ValueError(
                f"accumulation_steps must be a positive int (micro-batches per optimizer step); got {accumulation_steps!r}"
            )
        self.accumulation_steps = accumulation_steps
        self._grads: dict[str, list[torch.Tensor]] = {}

    def add_gradients(self, grads: Mapping[str, torch.Tensor | None]) -> None:
        """Record a copy of one micro-batch's gradients (``None`` entries are skipped)."""
        for name, grad in grads.items():
            if grad is not None:
                self._grads.setdefault(name, []).append(grad.detach().clone())

    def get_and_clear_gradients(self) -> dict[str, torch.Tensor]:
        """The sum of the recorded gradients per name, in the order they were added; the accumulator is emptied."""
        out: dict[str, torch.Tensor] = {}
        for name, grads in self._grads.items():
            if not grads:
                continue
            total = grads[0].clone()
            for g in grads[1:]:
                if g.shape != total.shape:
                    raise ValueError(
                        f"gradients of {name!r} have shapes {tuple(total.shape)} and {tuple(g.shape)}; every "
                        "micro-batch must give each name a gradient of one shape"
                    )
                total.add_(g)
            out[name] = total
        self._grads = {}
        return out

    @property
    def is_complete(self) -> bool:
        """Whether every recorded name has at least ``accumulation_steps`` gradients (False when empty)."""
        return bool(self._grads) and all(len(g) >= self.accumulation_steps for g in self._grads.values())

    def reset(self) -> None:
        """Forget every recorded gradient."""
        self._grads = {}
