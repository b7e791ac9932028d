"""Tuning knobs from the environment (kvstore.knobs): the default when unset, the value
when set, and a clear StoreConfigError naming the variable when it is not a value."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvstore
from kvstore.errors import StoreConfigError
from kvstore.knobs import (
    choice_from_env,
    count_from_env,
    mib_from_env,
    ms_from_env,
    switch_from_env,
)

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


@pytest.mark.parametrize(
    "value, want", [(None, "lock"), ("", "lock"), ("copy", "copy"), (" LOCK ", "lock")]
)
def test_a_choice_from_the_environment_or_the_default(knob, value, want):
    knob(value)
    assert choice_from_env(NAME, ("lock", "copy"), "lock") == want


@pytest.mark.parametrize("value, want", [(None, ""), ("auto", "auto"), ("0", "0"), ("12", "12")])
def test_a_choice_that_may_be_a_count(knob, value, want):
    knob(value)
    assert choice_from_env(NAME, ("auto",), "", counting="calls") == want


@pytest.mark.parametrize(
    "choices, default, counting, value, expected",
    [
        (
            ("lock", "copy"),
            "lock",
            None,
            "locked",
            r"'lock' or 'copy'; unset it for the default \('lock'\)",
        ),
        (("keep", "os"), "keep", None, "1", r"'keep' or 'os'; unset it for the default \('keep'\)"),
        (
            ("auto",),
            "",
            "calls",
            "-1",
            r"a number of calls or 'auto'; unset it for the default \(unset\)",
        ),
        (("auto",), "", "calls", "few", r"a number of calls or 'auto'"),
    ],
)
def test_a_choice_not_offered_names_the_variable_and_the_choices(
    knob, choices, default, counting, value, expected
):
    knob(value)
    message = rf"\[config\] {NAME}='{value}': expected {expected}"
    refused(lambda: choice_from_env(NAME, choices, default, counting=counting), value, message)


@pytest.mark.parametrize(
    "variable, module, expected",
    [
        ("KVSTORE_CUDA_PAGES_ROUTE", "kvstore.codecs.cuda_pages", "'lock' or 'copy'"),
        ("KVSTORE_CUDA_LOCK_SPANS", "kvstore.codecs.cuda_pages", "a number of calls or 'auto'"),
        ("KVSTORE_HOST_MALLOC", "kvstore.codecs.host_memory", "'keep' or 'os'"),
        ("KVSTORE_PINNED_PAGES", "kvstore.codecs.cuda", "'shared' or 'huge'"),
        ("KVSTORE_HUGE_PAGES", "kvstore.codecs.host_memory", "'0' or '1'"),
    ],
)
def test_a_choice_knob_not_offered_stops_the_import_by_name(variable, module, expected):
    # Before, KVSTORE_HOST_MALLOC=oss kept freed memory without a word, and the CUDA
    # choices raised a bare ValueError.
    done = subprocess.run(
        [sys.executable, "-c", f"import {module}"],
        env={variable: "oss", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert f"StoreConfigError: [config] {variable}='oss': expected {expected};" in done.stderr


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


def test_every_variable_kvstore_reads_is_named_in_the_readme():
    # A knob a user cannot find is one they cannot turn, nor know that it is turned.
    root = Path(kvstore.__file__).parent
    names: set[str] = set()
    for path in root.rglob("*.py"):
        names |= set(re.findall(r"\bKVSTORE_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    readme = (root.parent / "README.md").read_text()
    assert len(names) > 30  # the scan found them
    assert sorted(name for name in names if name not in readme) == []
