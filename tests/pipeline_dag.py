"""The step time of a pipeline schedule as its dependency graph gives it: an oracle for the tests and benchmarks.

Each stage runs its actions in the schedule's order, one at a time; a forward of microbatch ``i`` on stage ``s``
also needs stage ``s - 1``'s forward of ``i`` to have arrived (its end plus one hop), a backward needs stage
``s + 1``'s backward of ``i`` (the last stage: its own forward). This is what a device that never waits for
its host achieves, with every transfer leaving as soon as it is produced. Kept apart from simdist's own code so
that a test compares the simulation with the schedule's arithmetic, not with the code under test.
"""

from __future__ import annotations

Action = tuple[str, int]  # ("F" or "B", microbatch)


def gpipe(p: int, m: int) -> list[list[Action]]:
    """Every stage: all forwards, then all backwards, in microbatch order (torch's ``ScheduleGPipe``)."""
    return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)] for _ in range(p)]


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    """Stage ``s``: p - s warm-up forwards, then one backward and one forward in turn, then the remaining
    backwards (torch's ``Schedule1F1B``, which names its steady state "1B1F")."""
    orders = []
    for s in range(p):
        warm = min(p - s, m)
        order: list[Action] = [("F", i) for i in range(warm)]
        f, b = warm, 0
        while f < m:
            order += [("B", b), ("F", f)]
            f, b = f + 1, b + 1
        order += [("B", i) for i in range(b, m)]
        orders.append(order)
    return orders


SCHEDULES = {"GPipe": gpipe, "1F1B": one_f_one_b}


def step_end(orders: list[list[Action]], forward: float, backward: float, hop: float, starts: list[float]) -> float:
    """When the last stage finishes (seconds), stage ``s`` starting at ``starts[s]``; ``hop``: one transfer."""
    p = len(orders)
    end: dict[tuple[int, str, int], float] = {}
    clock = list(starts)
    pos = [0] * p
    left = sum(len(o) for o in orders)
    while left:
        moved = False
        for s in range(p):
            if pos[s] == len(orders[s]):
                continue
            kind, i = orders[s][pos[s]]
            if kind == "F":
                dep = (s - 1, "F", i) if s > 0 else None
            else:
                dep = (s + 1, "B", i) if s < p - 1 else (s, "F", i)
            if dep is not None and dep not in end:
                continue
            ready = 0.0 if dep is None else end[dep] + (hop if dep[0] != s else 0.0)
            clock[s] = max(clock[s], ready) + (forward if kind == "F" else backward)
            end[(s, kind, i)] = clock[s]
            pos[s] += 1
            left -= 1
            moved = True
        if not moved:
            raise ValueError("the schedule deadlocks: no stage can run its next action")
    return max(clock)
