"""Scripts run as ``python SCRIPT ARGS`` runs them, each in a fork of a warm interpreter that imported torch once.

Starting an interpreter and importing torch and simdist costs about two seconds of CPU, more than many scenario
scripts spend on their own work, and the suite runs each scenario under several CPU capabilities. So a test
asks :class:`WarmScripts` instead of ``subprocess.run``: a server interpreter, started with the environment the
script is to see, imports the modules named (what every such script imports first), then forks once per run. The
forked child is what a fresh ``python SCRIPT ARGS`` would be at its first line, but for those modules being
imported already:

- the server was started with the script's environment, so what torch reads from it when imported (the CPU
  capability ``ATEN_CPU_CAPABILITY`` names, the number of threads) is what a fresh interpreter reads; a server
  serves that environment only (``PYTEST_CURRENT_TEST`` aside, which pytest changes before each test and which
  the child gets as the caller has it);
- the child seeds torch's and NumPy's global generators afresh from the system's entropy, as a new interpreter
  seeds them (Python reseeds ``random`` in a forked child itself), and the server ran nothing that draws from them;
- the child runs the script as ``__main__`` with ``sys.argv`` and ``sys.path[0]`` as ``python`` sets them, in the
  caller's working directory, its standard output and error written to files of its own, and exits as the
  interpreter does (``SystemExit``'s code; 1 and a traceback for an exception; exit handlers run).

One difference remains: string hashing is seeded once per interpreter, so the children of one server share a
``PYTHONHASHSEED``, where fresh interpreters draw one each.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Any

#: variables a server serves whatever their value: pytest renames the current test in it before each test
PER_RUN = ("PYTEST_CURRENT_TEST",)


class WarmScripts:
    """Servers, one per environment, that run scripts in forks of themselves; :meth:`close` stops them."""

    def __init__(self, preload: tuple[str, ...], path: list[str]) -> None:
        """``preload``: modules every server imports, found on ``path`` (directories put first on its sys.path)."""
        self._preload = preload
        self._path = path
        self._servers: dict[tuple[tuple[str, str], ...], subprocess.Popen[str]] = {}
        #: each server's standard error (what it printed before it ended, if it ended)
        self._errors: dict[int, Any] = {}
        self._lock = threading.Lock()

    def run(self, script: Path, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        """``python script *args`` under ``env``, run in a fork of a warm server: its status and output."""
        with self._lock, tempfile.TemporaryDirectory() as folder:
            server = self._server(env)
            out, err = Path(folder) / "stdout", Path(folder) / "stderr"
            request = {
                "argv": [str(script), *args],
                "cwd": os.getcwd(),
                "env": env,
                "stdout": str(out),
                "stderr": str(err),
            }
            assert server.stdin is not None and server.stdout is not None
            server.stdin.write(json.dumps(request) + "\n")
            server.stdin.flush()
            reply = server.stdout.readline()
            if not reply:
                raise RuntimeError(
                    f"the warm interpreter for {script.name} ended: {self._server_error(server)}"
                )
            status = json.loads(reply)["status"]
            return subprocess.CompletedProcess(request["argv"], status, out.read_text(), err.read_text())

    def close(self) -> None:
        """Stop every server (each exits when its requests end)."""
        with self._lock:
            for server in self._servers.values():
                assert server.stdin is not None
                server.stdin.close()
                server.wait(timeout=60)
                self._errors.pop(server.pid).close()
            self._servers.clear()

    def _server(self, env: dict[str, str]) -> subprocess.Popen[str]:
        key = tuple(sorted((k, v) for k, v in env.items() if k not in PER_RUN))
        server = self._servers.get(key)
        if server is None or server.poll() is not None:
            errors = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
            server = subprocess.Popen(
                [sys.executable, __file__, json.dumps({"preload": self._preload, "path": self._path})],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=errors,
                text=True,
            )
            self._servers[key] = server
            self._errors[server.pid] = errors
        return server

    def _server_error(self, server: subprocess.Popen[str]) -> str:
        server.wait(timeout=60)
        errors = self._errors[server.pid]
        errors.seek(0)
        return f"exit status {server.returncode}\n{errors.read().decode(errors='replace')[-3000:]}"


# ------------------------------------------------------------------------------------------------ the server
def _serve(preload: list[str], path: list[str]) -> None:
    """Import ``preload``, then fork a child for each request line on standard input; reply with its status."""
    requests = os.fdopen(os.dup(0), "r")
    replies = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    sys.path[:0] = path
    for name in preload:
        importlib.import_module(name)
    del sys.path[: len(path)]
    sys.stdout.flush()
    sys.stderr.flush()
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            requests.close()
            replies.close()
            _child(request)  # ends the process
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()


def _child(request: dict[str, Any]) -> None:
    """Run the request's script as ``python`` runs a script, then exit as the interpreter exits."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, name in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    if "torch" in sys.modules:  # imported by the server: else the script's import seeds it
        sys.modules["torch"].seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    code: Any = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException:  # noqa: BLE001 - reported as the interpreter reports an uncaught exception
        traceback.print_exc()
        code = 1
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


if __name__ == "__main__":
    settings = json.loads(sys.argv[1])
    _serve(settings["preload"], settings["path"])
