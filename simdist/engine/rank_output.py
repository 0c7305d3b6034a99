"""Each rank's ``sys.stdout`` and ``sys.stderr`` told apart: line by line, each line prefixed with
``[rankN]:`` and only for the local ranks chosen (torchrun's ``--local-ranks-filter``).

A rank's text is kept until it ends a line, so the lines of ranks never mix; what a rank leaves unfinished is
written when its program ends. Code outside rank threads writes straight through.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TextIO

from simdist.clock.baton import current_rank_state


class RankStream:
    """A text stream in place of ``sys.stdout`` or ``sys.stderr`` that writes each rank's lines to ``target``.

    ``shown(rank)`` says whether a rank's lines are written at all; ``prefix`` puts ``[rankN]:`` before each.
    Anything else (``fileno``, ``encoding``, ``isatty``, ``buffer``) is ``target``'s: bytes written to its file
    descriptor or its buffer bypass the prefix, as they bypass Python's text layer.
    """

    def __init__(self, target: TextIO, prefix: bool, shown: Callable[[int], bool]) -> None:
        self._target = target
        self._prefix = prefix
        self._shown = shown
        self._partial: dict[int, str] = {}

    def write(self, text: str) -> int:
        """Write ``text``: straight through outside rank code; a rank's complete lines, prefixed, in rank code."""
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        state = current_rank_state()
        if state is None:
            return self._target.write(text)
        rank = state.rank
        pending = self._partial.pop(rank, "") + text
        head, newline, tail = pending.rpartition("\n")
        if tail:
            self._partial[rank] = tail
        if newline:
            self._emit(rank, head.split("\n"))
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        """Write each of ``lines`` (no newline is added, as ``io.TextIOBase.writelines``)."""
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        """Flush ``target``; a rank's unfinished line waits for its end (torchrun shows whole lines too)."""
        self._target.flush()

    def end_rank(self, rank: int) -> None:
        """Write what ``rank`` left unfinished, as its process's exit flushes it."""
        tail = self._partial.pop(rank, "")
        if tail:
            self._emit(rank, [tail])
        self._target.flush()

    def end(self) -> None:
        """Write every rank's unfinished line (the run is over)."""
        for rank in sorted(self._partial):
            self.end_rank(rank)

    def _emit(self, rank: int, lines: list[str]) -> None:
        if not self._shown(rank):
            return
        start = f"[rank{rank}]:" if self._prefix else ""
        self._target.write("".join(f"{start}{line}\n" for line in lines))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)
