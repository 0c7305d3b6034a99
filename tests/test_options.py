"""Every option of ``simdist.run`` and of the equivalence oracle is checked for its type and range where it is
given: a wrong value is refused with a message naming the option, never taken for another (``memory="off"``)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import real.oracle
import simdist
from simdist.options import (
    BACKEND_NAMES,
    PROGRESS_MODES,
    RACE_MODES,
    TENSOR_MODES,
    TRACE_LEVELS,
    OracleOptions,
    RunOptions,
)

RING2 = simdist.Cluster.ring(2)

#: values of every kind, most of which some option must refuse
ODD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(["off", "False", "0", "true", "NCCL", "yes"]),
    st.lists(st.integers(), max_size=2),
    st.just(object()),
)


def _accepted(name: str, value: object) -> bool:
    """The oracle: what each option of simdist.run accepts, written from its documentation."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if name == "seed":
        return is_int and -(2**63) <= value < 2**64
    if name == "progress":
        return isinstance(value, str) and value in PROGRESS_MODES
    if name == "gloo_threads":
        return is_int and 1 <= value <= 1024
    if name == "races":
        return value is None or isinstance(value, str) and value in RACE_MODES
    if name == "race_waivers":
        return value is None or isinstance(value, list) and all(isinstance(v, str) for v in value)
    if name == "trace":
        return isinstance(value, str) and value in TRACE_LEVELS
    if name in ("compute", "copy_args", "memory", "default_group", "prefix_output", "symmetric"):
        return isinstance(value, bool)
    if name == "argv":
        return value is None or isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
    if name == "local_ranks_filter":
        return value is None or (
            isinstance(value, (list, tuple, set, frozenset))  # an empty list shows no rank's output
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
        )
    if name == "watchdog":
        if value is None:
            return True
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            return False
        try:
            return float(value) > 0
        except ValueError:
            return False
    if name == "backend_name":
        return isinstance(value, str) and value in BACKEND_NAMES
    if name == "tensors":
        return isinstance(value, str) and value in TENSOR_MODES
    if name == "faults":
        # a list of simdist.faults records (or their JSON mappings), None for none; no value drawn here is a record
        return value is None or isinstance(value, (list, tuple)) and not value
    raise AssertionError(name)


OPTIONS = [f.name for f in dataclasses.fields(RunOptions)]


def test_the_options_are_simdist_runs_keywords() -> None:
    import inspect

    # perturbation is not a run option: it is what an exploration varies between runs (checked in test_explore)
    keywords = [
        p
        for p in inspect.signature(simdist.run).parameters
        if p not in ("fn", "cluster", "args", "kwargs", "perturbation")
    ]
    assert keywords == OPTIONS


@given(name=st.sampled_from(OPTIONS), value=ODD)
def test_each_option_is_refused_unless_its_documentation_admits_the_value(name: str, value: object) -> None:
    if name == "race_waivers" and isinstance(value, list) and value:
        value = [str(v) for v in value]  # a list of strings: accepted (its patterns are parsed at the run)
    if _accepted(name, value):
        RunOptions.from_keywords(**{name: value})
    else:
        # a fault's own checks raise FaultSpecError, as simdist.faults' records do where they are made
        error = simdist.FaultSpecError if name == "faults" else simdist.RunArgumentError
        with pytest.raises(error, match=name):
            RunOptions.from_keywords(**{name: value})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"memory": "off"}, r"memory must be True or False, got str 'off'"),
        ({"compute": 0}, r"compute must be True, False or simdist.profile\(PATH\), got int 0"),
        ({"copy_args": "False"}, r"copy_args must be True or False"),
        ({"progress": True}, r"progress must be one of"),
        ({"races": 1}, r"races must be one of"),
        ({"race_waivers": "torch/x.py"}, r"race_waivers must be a list"),
        ({"trace": "all"}, r"trace must be one of"),
        ({"watchdog": -1}, r"watchdog=-1: expected a positive number"),
        ({"gloo_threads": 2.0}, r"gloo_threads must be an int"),
        ({"argv": "train.py --lr 1"}, r"argv must be a list of strings"),
        ({"argv": ["train.py", 1]}, r"argv\[1\] must be a string"),
        ({"default_group": "no"}, r"default_group must be True or False"),
        ({"prefix_output": 1}, r"prefix_output must be True or False"),
        ({"local_ranks_filter": [0, -1]}, r"local_ranks_filter must name local ranks, each a whole number >= 0"),
        ({"local_ranks_filter": "0,1"}, r"local_ranks_filter must be a list of local ranks"),
        ({"tensors": "meta"}, r"tensors must be one of \('real', 'fake'\), got 'meta'"),
        ({"tensors": "fake", "races": "error"}, r"races='error' with tensors=\"fake\""),
    ],
)
def test_simdist_run_refuses_a_wrong_option_before_any_rank_runs(kwargs: dict, match: str) -> None:
    ran: list[int] = []
    with pytest.raises(simdist.RunArgumentError, match=match):
        simdist.run(lambda: ran.append(1), RING2, **kwargs)
    assert ran == []


def test_resolved_options_fill_the_environment_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SIMDIST_RACES", "off")
    monkeypatch.setenv("SIMDIST_WATCHDOG", "12.5")
    opts = RunOptions().resolved()
    assert (opts.races, opts.watchdog) == ("off", 12.5)
    assert RunOptions(races="warn", watchdog=math.inf).resolved().races == "warn"
    monkeypatch.setenv("SIMDIST_RACES", "loud")
    with pytest.raises(simdist.RunArgumentError, match=r"\$SIMDIST_RACES must be one of"):
        RunOptions().resolved()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"steps": 0}, r"steps must be a positive int"),
        ({"steps": True}, r"steps must be a positive int"),
        ({"loss": "avg"}, r"loss must be one of"),
        ({"exact": "yes"}, r"exact must be True or False"),
        ({"localize": 1}, r"localize must be True or False"),
        ({"ignore": "bias"}, r"ignore must be a list of fnmatch patterns"),
        ({"names": 3}, r"names must map parallel names"),
        ({"shards": {"w": "0"}}, r"shards\['w'\] must be a dim"),
        ({"tolerances": {"float32": 1}}, r"tolerances must map torch dtypes"),
    ],
)
def test_the_oracles_refuse_a_wrong_option_alike(kwargs: dict, match: str) -> None:
    with pytest.raises(simdist.RunArgumentError, match=match):
        OracleOptions(**kwargs)
    with pytest.raises(simdist.RunArgumentError, match=match):
        simdist.check_equivalence(lambda: None, lambda: None, RING2, **kwargs)
    if "steps" not in kwargs and "localize" not in kwargs:  # options of the simulated oracle alone
        with pytest.raises(simdist.RunArgumentError, match=match):
            real.oracle.check_final_state(lambda: None, lambda: None, 2, **kwargs)


def test_oracle_options_normalise_shards_and_copy_tolerances() -> None:
    tol = {torch.float32: simdist.oracle.Tolerance(1e-3, 1e-4)}
    opts = OracleOptions(shards={"a": 0, "b": (1, 2)}, tolerances=tol, ignore=["x*"])
    assert opts.shards == {"a": (0, None), "b": (1, 2)} and opts.ignore == ("x*",)
    assert opts.tolerances == tol and opts.tolerances is not tol
