"""Whether a process has ended or is ending: how a failing rank tells that a peer failed before it did.

A rank that dies by ``os._exit`` or a signal records nothing, and its peers then fail in their next collective
("Connection closed by peer"), which they do record. Clocks cannot order the two reliably (the dead rank wrote
no time), but causality can: the kernel closes a process's sockets only after its every thread has started
exiting (``PF_EXITING``) or become a zombie, so a peer that sees the connection drop and then looks at the
process finds it ending or gone.
"""

from __future__ import annotations

import os

# include/linux/sched.h: set on a task when it starts exiting, before its files (and sockets) are closed.
_PF_EXITING = 0x4
# Task states of a process that has exited (zombie, dead) as /proc/PID/stat shows them.
_ENDED_STATES = frozenset({b"Z", b"X", b"x"})


def ended(pid: int) -> bool:
    """Whether process ``pid`` has exited, is exiting, or no longer exists."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            stat = file.read()
    except FileNotFoundError:
        return True  # reaped already
    except OSError:
        return _gone(pid)  # no procfs (not Linux): a zombie looks alive here, an ended one does not
    # The command name in parentheses may hold spaces and parentheses: the fields start after the last ")".
    fields = stat[stat.rindex(b")") + 2 :].split()
    state, flags = fields[0], int(fields[6])
    return state in _ENDED_STATES or bool(flags & _PF_EXITING)


def _gone(pid: int) -> bool:
    """Whether no process ``pid`` exists (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
