"""Shared pytest configuration: hypothesis profiles and the ``--update-golden`` option.

``HYPOTHESIS_PROFILE=ci`` (used by ``.ci/run``) keeps example counts small so the whole suite stays fast;
``dev`` explores more. Both are deterministic (derandomized) so a failure reproduces on the next run.
``--update-golden`` rewrites ``scenarios/expected/*.txt`` from this run's scenario output (see scenarios/README.md).
``session_results`` computes an expensive launch once per session for every test (and xdist worker) reading it.
"""

import os
import signal
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings
from session_results import SessionResults, shared_dir

# One intra-op thread in every process of the suite (this one, and every process it starts, which inherit the
# variable): two pytest workers on two cores keep both cores busy already, and a kernel split over two threads
# then waits for the thread another process holds off its core (a 64x128 layer norm took 12 ms instead of 15 us
# with both cores busy). A count the environment sets is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if os.environ["OMP_NUM_THREADS"].isdigit():
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register ``--update-golden``."""
    parser.addoption(
        "--update-golden",
        action="store_true",
        help="rewrite scenarios/expected/<name>.txt from the scenarios' output in this run (after an intended change)",
    )


@pytest.fixture
def threads_other_than_the_suites() -> Iterator[None]:
    """The test starts with 3 intra-op threads, not the suite's 1 (set above): a run that leaves its own 1 behind
    then changes the process's state, as the tests of what a run restores must see."""
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    yield
    torch.set_num_threads(threads)


#: the signals whose Python handlers every test must leave as it found them: a test that left its own SIGINT handler
#: (torch's elastic agent installs one that raises ``SignalException``) would turn every later Ctrl-C test on its
#: worker into a wait for the watchdog
_HANDLED = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)


@pytest.fixture(autouse=True)
def _signal_handlers_left_as_found(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the test that changed a signal's Python handler (and put the handler back, for the tests after it)."""
    before = {s: signal.getsignal(s) for s in _HANDLED}
    yield
    changed = {s.name: (before[s], now) for s in _HANDLED if (now := signal.getsignal(s)) != before[s]}
    for name in changed:
        signal.signal(signal.Signals[name], before[signal.Signals[name]])
    assert not changed, f"{request.node.nodeid} left signal handlers changed (before, after): {changed}"


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    """Whether this run rewrites the scenarios' expected output instead of only comparing with it."""
    return bool(request.config.getoption("--update-golden"))


@pytest.fixture(scope="session")
def session_results(tmp_path_factory: pytest.TempPathFactory) -> SessionResults:
    """Named results computed once in this session, whichever worker runs the tests that read them."""
    return SessionResults(shared_dir(tmp_path_factory.getbasetemp()))


settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
