"""The README's examples, run as a reader runs them: their output against the output the README shows.

Every ```python block whose first line is ``# <name>.py`` is written to that file in an empty directory, and
every plain block whose first line is ``$ python3 <name>.py`` is a session: that script is run there and its
output compared verbatim with the rest of the block. Only the wall time of a real launch (``<n> s of wall
time``) cannot be the same twice; it is masked on both sides (docs/testing.md).
"""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

#: a fenced block: its language (empty for plain text) and its body
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
#: the first line of a block that is a file: ``# step.py``
FILE = re.compile(r"# (\w+\.py)")
#: the first line of a block that is a session: ``$ python3 tour.py``
SESSION = re.compile(r"\$ python3 (\w+\.py)")
#: the one part of a session's output that differs from run to run: a real launch's wall seconds
WALL_TIME = re.compile(r"\b\d+(\.\d+)? s of wall time\b")


def blocks(text: str) -> list[tuple[str, str, str]]:
    """(language, first line, the rest) of every fenced block of ``text``, in order."""
    return [(lang, *(body.split("\n", 1) + [""])[:2]) for lang, body in FENCE.findall(text)]


def mask(output: str) -> str:
    """``output`` with its wall times replaced by ``<seconds>``."""
    return WALL_TIME.sub("<seconds> s of wall time", output)


def test_the_readme_blocks_are_found() -> None:
    found = blocks(README.read_text())
    files = [
        FILE.fullmatch(first).group(1)
        for lang, first, _ in found
        if lang == "python" and FILE.fullmatch(first)
    ]
    sessions = [
        SESSION.fullmatch(first).group(1) for lang, first, _ in found if not lang and SESSION.fullmatch(first)
    ]
    # at least one session, and every script it runs is one of the README's files
    assert sessions and set(sessions) <= set(files), (files, sessions)


def test_mask_hides_only_the_wall_time() -> None:
    assert mask("tensor([0., 3.]) 6.9 s of wall time\n") == "tensor([0., 3.]) <seconds> s of wall time\n"
    assert mask("4.2092062089552246e-05\n6.9 s\n") == "4.2092062089552246e-05\n6.9 s\n"


# not cpu_kernels: what the tour prints cannot depend on torch's choice of SIMD kernels: its tensors hold whole
# numbers below 2**24, which float32 adds exactly in any order, and its simulated time and trace hash follow
# from shapes (docs/testing.md#expected-outputs-on-any-cpu)
@pytest.mark.real  # the tour launches real processes
def test_the_readme_tour_prints_what_the_readme_shows(tmp_path: Path) -> None:
    found = blocks(README.read_text())
    for lang, first, body in found:
        if lang == "python" and (name := FILE.fullmatch(first)):
            (tmp_path / name.group(1)).write_text(f"{first}\n{body}")
    sessions = [
        (SESSION.fullmatch(first).group(1), shown)
        for lang, first, shown in found
        if not lang and SESSION.fullmatch(first)
    ]
    assert sessions, "the README shows no session to check"
    # the checkout's simdist and real, as in a reader's environment after `pip install -e .`
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    for script, shown in sessions:
        done = subprocess.run(
            [sys.executable, script], cwd=tmp_path, env=env, capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stdout + done.stderr
        got, want = mask(done.stdout), mask(shown)
        if got != want:
            diff = difflib.unified_diff(
                want.splitlines(keepends=True),
                got.splitlines(keepends=True),
                f"README.md ($ python3 {script})",
                f"{script} (this run)",
            )
            pytest.fail(
                f"README.md shows output that {script} does not print:\n{''.join(diff)}", pytrace=False
            )
