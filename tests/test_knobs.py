"""Tuning knobs from the environment (kvstore.knobs): the default when unset, the value
when set, and a clear StoreConfigError naming the variable when it is not a value."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvstore.errors import StoreConfigError
from kvstore.knobs import count_from_env, mib_from_env, ms_from_env, switch_from_env

NAME = "KVSTORE_TEST_KNOB"


@pytest.fixture
def knob(monkeypatch):
    def set_(value):
        if value is None:
            monkeypatch.delenv(NAME, raising=False)
        else:
            monkeypatch.setenv(NAME, value)

    return set_


@pytest.mark.parametrize("value, want", [(None, 7), ("", 7), ("3", 3), (" 12 ", 12)])
def test_a_count_from_the_environment_or_the_default(knob, value, want):
    knob(value)
    assert count_from_env(NAME, 7) == want


@pytest.mark.parametrize(
    "value, on", [(None, True), ("1", True), ("", True), ("yes", True), (" 0", True), ("0", False)]
)
def test_a_switch_is_off_only_for_exactly_0(knob, value, on):
    knob(value)
    assert switch_from_env(NAME) is on


def refused(call, value: str, message: str) -> None:
    """``call()`` raises StoreConfigError matching ``message``, naming the knob and value."""
    with pytest.raises(StoreConfigError, match=message) as caught:
        call()
    assert (caught.value.variable, caught.value.found) == (NAME, value)
    assert isinstance(caught.value, ValueError)  # what callers caught before


@pytest.mark.parametrize("value", ["-1", "0", "2.5", "many"])
def test_a_count_that_is_not_positive_names_the_variable_and_what_it_counts(knob, value):
    knob(value)
    message = (
        rf"\[config\] {NAME}='{value}': expected a positive number of groups; "
        r"unset it for the default \(7\)\."
    )
    refused(lambda: count_from_env(NAME, 7, "groups"), value, message)


@pytest.mark.parametrize(
    "value, mib, ms",
    [(None, 2 << 20, 0.5e-3), ("0", 0, 0.0), ("1.5", 3 << 19, 1.5e-3), (" 64 ", 64 << 20, 0.064)],
)
def test_mib_and_ms_from_the_environment_or_the_default(knob, value, mib, ms):
    knob(value)
    assert mib_from_env(NAME, 2) == mib
    assert ms_from_env(NAME, 0.5) == pytest.approx(ms)


@pytest.mark.parametrize("value", ["-1", "2MiB", "nan", "inf"])
def test_an_amount_that_is_not_one_names_the_variable_and_its_unit(knob, value):
    knob(value)
    mib = rf"{NAME}='{value}': expected a number of MiB, 0 or more; unset it for the "
    mib += r"default \(2 MiB\)"
    refused(lambda: mib_from_env(NAME, 2), value, mib)
    refused(lambda: ms_from_env(NAME, 250), value, r"a number of ms, 0 or more.*\(250 ms\)")


def test_a_malformed_knob_read_at_import_says_which_and_how_to_fix_it():
    # cuda_pages.py reads KVSTORE_CUDA_GATHER_MIN_MIB when it loads (on any machine):
    # before, a bad value was Python's own "could not convert string to float" from
    # deep in the import.
    done = subprocess.run(
        [sys.executable, "-c", "import kvstore.codecs.cuda_pages"],
        env={"KVSTORE_CUDA_GATHER_MIN_MIB": "two", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert (
        "kvstore.errors.StoreConfigError: [config] KVSTORE_CUDA_GATHER_MIN_MIB='two': "
        "expected a number of MiB, 0 or more; unset it for the default (16 MiB)."
    ) in done.stderr
