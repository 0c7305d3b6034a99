"""The verdict table every scenario ends with, and the exit status it implies."""

from __future__ import annotations

#: (expectation, whether it held, detail)
Verdict = tuple[str, bool, str]


def report(verdicts: list[Verdict]) -> int:
    """Print one line per expectation (PASS/FAIL and detail); 0 if all held, else 1 (the script's exit status)."""
    width = max([len("expectation"), *(len(name) for name, _, _ in verdicts)])
    print(f"{'expectation':{width}s} {'verdict':8s} detail")
    for name, ok, detail in verdicts:
        print(f"{name:{width}s} {'PASS' if ok else 'FAIL':8s} {detail}")
    return 0 if all(ok for _, ok, _ in verdicts) else 1
