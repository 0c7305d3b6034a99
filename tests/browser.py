"""Headless Chromium for the report tests: where it is, the skip mark without it, and a DOM dump of a page."""

from __future__ import annotations

import shutil
import subprocess

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on PATH (apt-get install chromium; .ci/run installs it)"
)


def chromium(*args: str) -> str:
    """Run headless Chromium on a page; its stdout (the DOM with --dump-dom)."""
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=3000", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
