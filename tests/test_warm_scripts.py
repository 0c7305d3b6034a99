"""tests/warm_scripts.py: a script run in a fork of a warm interpreter sees and does what it would in a fresh one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from warm_scripts import WarmScripts

PROBE = """
import atexit, json, os, sys

atexit.register(lambda: print("exit handler ran", flush=True))
print(json.dumps({
    "name": __name__,
    "file": __file__,
    "argv": sys.argv,
    "path0": sys.path[0],
    "cwd": os.getcwd(),
    "probe": os.environ.get("WARM_PROBE"),
    "test": os.environ.get("PYTEST_CURRENT_TEST"),
    "main": sys.modules["__main__"].__dict__ is globals(),
}))
print("to stderr", file=sys.stderr)
how = sys.argv[1]
if how == "raise":
    raise ValueError("the probe raised")
if how == "exit":
    sys.exit(3)
if how == "seed":  # torch imported by the server: seeded afresh in each run, as in each new interpreter
    import torch

    print(json.dumps({"seed": torch.initial_seed()}))
"""


@pytest.fixture
def warm():
    scripts = WarmScripts((), [])
    yield scripts
    scripts.close()


def _fresh(script: Path, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script), *args], env=env, capture_output=True, text=True, check=False
    )


def test_a_warm_run_is_a_fresh_interpreters_run(
    warm: WarmScripts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    monkeypatch.chdir(tmp_path)
    env = {**os.environ, "WARM_PROBE": "one"}
    for how in ("plain", "raise", "exit"):
        mine, theirs = warm.run(script, [how], env), _fresh(script, [how], env)
        assert mine.returncode == theirs.returncode == {"plain": 0, "raise": 1, "exit": 3}[how]
        seen = [json.loads(out.stdout.splitlines()[0]) for out in (mine, theirs)]
        assert seen[0] == seen[1] and seen[0]["argv"] == [str(script), how] and seen[0]["name"] == "__main__"
        assert mine.stdout.splitlines()[-1] == theirs.stdout.splitlines()[-1] == "exit handler ran"
        assert (
            mine.stderr.splitlines()[0] == "to stderr"
            and mine.stderr.splitlines()[-1:] == (theirs.stderr.splitlines()[-1:])
        )
    # the server serves its environment; another one gets a server of its own, and the test's name is the
    # caller's in either
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test")
    again = json.loads(
        warm.run(script, ["plain"], {**os.environ, "WARM_PROBE": "one"}).stdout.splitlines()[0]
    )
    other = json.loads(
        warm.run(script, ["plain"], {**os.environ, "WARM_PROBE": "two"}).stdout.splitlines()[0]
    )
    assert (again["probe"], again["test"], other["probe"], other["test"]) == (
        "one",
        "another test",
        "two",
        "another test",
    )
    assert len(warm._servers) == 2


def test_each_warm_run_seeds_torch_afresh(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    warm = WarmScripts(("torch",), [])
    try:
        runs = [warm.run(script, ["seed"], dict(os.environ)).stdout.splitlines() for _ in range(3)]
    finally:
        warm.close()
    assert len({json.loads(lines[1])["seed"] for lines in runs}) == 3
