"""Process-wide hooks that concurrent oracle calls share: installed by the first user, removed by the last.

torch's hook registries, ``torch.autograd.backward`` and the process group's observers are one per process,
while ``check_equivalence`` and localisation may run in several Python threads at once. Each of their hook
sets is installed once however many calls hold it, and the hooks route every event to the capture or recorder
of the thread it happens in; installing a set per call instead would deliver every event twice and, removed in
a different order than installed, leave a patch behind.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator


class SharedHooks:
    """A set of process-wide hooks held by any number of callers at once."""

    def __init__(self, install: Callable[[], Callable[[], None]]) -> None:
        #: installs the hooks and returns what removes them (it must leave nothing behind if it raises)
        self._install = install
        self._lock = threading.Lock()
        self._users = 0
        self._remove: Callable[[], None] | None = None

    @property
    def users(self) -> int:
        """How many callers hold the hooks now."""
        return self._users

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold the hooks for the duration of the block (installing them if no one else holds them)."""
        with self._lock:
            if self._users == 0:
                self._remove = self._install()
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0 and self._remove is not None:
                    remove, self._remove = self._remove, None
                    remove()
