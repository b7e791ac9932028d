"""``kvstore serve``'s own options and checks, in process: what mlx_lm.server gets, the
tested mlx-lm range, the extra it needs, and that other subcommands still refuse strays."""

from __future__ import annotations

import sys

import pytest

from kvstore.cli import EXIT_USAGE, main
from tests.markers import needs_tested_mlx_lm

pytest.importorskip("mlx_lm")


@needs_tested_mlx_lm
def test_options_kvstore_does_not_know_go_to_mlx_lm_server(capsys, tmp_path):
    with pytest.raises(SystemExit) as exited:  # mlx_lm.server's own parser refuses it
        main(["serve", "--store", f"lmdb://{tmp_path / 's'}", "--model", "x", "--bogus-flag"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvstore serve") and "--bogus-flag" in err


def test_other_subcommands_still_refuse_unknown_options(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["ls", "memory://", "--bogus-flag"])
    assert (
        exited.value.code == 2 and "unrecognized arguments: --bogus-flag" in capsys.readouterr().err
    )


def test_an_untested_mlx_lm_is_refused_at_start_with_a_clear_message(capsys, monkeypatch):
    from kvstore.mlx_lm import version

    monkeypatch.setattr(version, "mlx_lm_version", lambda: "0.40.0")
    monkeypatch.setattr(version, "TESTED_MLX_LM_PYTHON", (3, 0))  # this Python runs them
    assert main(["serve", "--store", "memory://", "--model", "x"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("kvstore serve: error: [kvstore serve] mlx-lm 0.40.0 is installed")
    assert "pip install 'mlx-lm>=0.32.2,<0.33.0'" in err


def test_a_missing_extra_names_the_one_to_install(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import now raises
    assert main(["serve", "--model", "x"]) == 1
    assert "pip install 'mlx-kvstore[serve]'" in capsys.readouterr().err
