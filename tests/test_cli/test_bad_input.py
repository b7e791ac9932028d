"""Bad input: one line on stderr saying what was wrong and what to do, exit status 2,
no traceback (``--debug`` shows it). Every case of issue 6, in process and as a
subprocess."""

from __future__ import annotations

import lmdb
import pytest

from kvstore.cli import EXIT_USAGE, main
from kvstore.errors import KVStoreError

from .conftest import kvstore_cli
from .stores import NS


def check_one_line(capsys, argv: list[str], *fragments: str) -> str:
    assert main(argv) == EXIT_USAGE
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"kvstore {argv[0]}: error: ["), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert "Traceback" not in captured.err and not captured.out
    return lines[0]


def not_a_store_dir(tmp_path):
    d = tmp_path / "photos"
    d.mkdir()
    (d / "cat.jpg").write_bytes(b"\xff\xd8\xff")
    return d


def garbage_lmdb_dir(tmp_path):
    d = tmp_path / "garbage"
    d.mkdir()
    (d / "data.mdb").write_bytes(b"this is not an LMDB file" * 200)
    return d


def foreign_lmdb_dir(tmp_path):
    d = tmp_path / "foreign"
    with lmdb.open(str(d)) as env, env.begin(write=True) as txn:
        txn.put(b"user:1", b"alice")
    return d


def a_file(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("hello")
    return f


@pytest.mark.parametrize("command", ["ls", "stats", "verify", "gc", "delete"])
def test_a_missing_store(command, tmp_path, capsys):
    argv = [command, str(tmp_path / "nowhere")] + (["-n", NS] if command == "delete" else [])
    check_one_line(capsys, argv, "No store at", "does not exist", "Check the path")
    assert not (tmp_path / "nowhere").exists()  # and none was created


def test_a_missing_store_in_every_url_form(tmp_path, capsys):
    for url in (f"lmdb://{tmp_path}/x", f"lmdb:{tmp_path}/x"):
        check_one_line(capsys, ["ls", url], "No store at", "does not exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    check_one_line(capsys, ["ls", str(empty)], "is empty: no store")


def test_a_wrong_url_scheme(capsys):
    check_one_line(capsys, ["ls", "lmbd:///var/kv"], "Unknown store URL scheme 'lmbd'", "lmdb")
    check_one_line(capsys, ["stats", "lmdb://host/var/kv"], "an LMDB store is local")


def test_a_directory_that_is_not_a_store(tmp_path, capsys):
    d = not_a_store_dir(tmp_path)
    check_one_line(capsys, ["ls", str(d)], "no LMDB store", "Use an empty or new directory")
    assert sorted(p.name for p in d.iterdir()) == ["cat.jpg"]


def test_a_corrupt_or_foreign_file(tmp_path, capsys):
    check_one_line(capsys, ["ls", str(a_file(tmp_path))], "is a file")
    check_one_line(capsys, ["stats", str(garbage_lmdb_dir(tmp_path))], "not an LMDB store")
    check_one_line(
        capsys,
        ["verify", str(foreign_lmdb_dir(tmp_path))],
        "no kvstore/v1/__meta__",
        "not a kvstore",
    )


def test_a_corrupt_or_missing_tokens_file(make_store, tmp_path, capsys):
    path = str(make_store())
    bad = tmp_path / "tokens.bin"
    bad.write_bytes(b"\x00\x01 not tokens \xff")
    check_one_line(capsys, ["inspect", path, "--tokens", str(bad)], "is not a tokens file")
    words = tmp_path / "words.json"
    words.write_text('["a", "b"]')
    check_one_line(capsys, ["inspect", path, "--tokens", str(words)], "other than integers")
    negative = tmp_path / "neg.txt"
    negative.write_text("1 2 -3")
    check_one_line(capsys, ["inspect", path, "--tokens", str(negative)], "Token ids must be")
    check_one_line(
        capsys, ["delete", path, "-n", NS, "--tokens", str(tmp_path / "none")], "No tokens file"
    )


@pytest.mark.parametrize(
    ("signature", "fragment"),
    [
        ("kv:quant:7:64", "bits must be one of 2, 3, 4, 5, 6, 8; received 7"),
        ("kv:bogus", "Unknown signature kind 'kv:bogus'"),
        ("quant8", "Unknown signature kind"),
        ("kv:quant:8", "takes 2 parameter(s)"),
        ("batch:kv:plain", "is a wrapper signature; stored layers are families"),
    ],
)
def test_a_signature_that_does_not_parse(signature, fragment, make_store, tmp_path, capsys):
    line = check_one_line(
        capsys,
        ["migrate", str(make_store()), str(tmp_path / "dst"), "--to", signature],
        f"--to {signature!r}",
        fragment,
    )
    assert "kv:" in line.split(repr(signature), 1)[1]  # says what a signature looks like
    assert not (tmp_path / "dst").exists()


def test_a_namespace_that_does_not_exist(make_store, capsys):
    path = str(make_store())
    for argv in (
        ["ls", path, "-n", "nope"],
        ["delete", path, "--namespace", "nope"],
        ["gc", path, "--max-bytes", "1MiB", "-n", "nope"],
        ["inspect", path, "nope/abcdef"],
    ):
        check_one_line(capsys, argv, "nope", "kvstore ls")
    check_one_line(capsys, ["ls", path, "-n", "Bad_Name"], "A namespace is 1-32 characters")


def test_other_bad_options(make_store, tmp_path, capsys):
    path = str(make_store())
    dst = str(tmp_path / "dst")
    cases = [
        (["gc", path, "--max-bytes", "lots"], "takes a size such as 10GB"),
        (["migrate", path, dst, "--to", "kv:quant:8:64", "--layers", "3-1"], "--layers takes"),
        (["migrate", path, dst, "--to", "kv:quant:8:64", "--layers", "5"], "hold 2 layers"),
        (["migrate", path, dst, "--format-version", "2"], "known record formats: 1"),
        (["migrate", path, path, "--to", "kv:quant:8:64"], "same store"),
        (["migrate", "memory://m", "--in-place", "--to", "kv:quant:8:64"], "cannot be swapped"),
        (["inspect", path, "zz-not-a-key"], "is not a block key"),
    ]
    for argv, fragment in cases:
        check_one_line(capsys, argv, fragment)
    assert not (tmp_path / "dst").exists()


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(KVStoreError, match="No store at"):
        main(["--debug", "ls", str(tmp_path / "nowhere")])
    with pytest.raises(KVStoreError, match="No store at"):
        main(["ls", str(tmp_path / "nowhere"), "--debug"])


def test_bad_input_as_a_subprocess(tmp_path):
    done = kvstore_cli("ls", str(tmp_path / "nowhere"))
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "No store at" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    done = kvstore_cli("--debug", "ls", str(tmp_path / "nowhere"))
    assert done.returncode == 1 and "Traceback" in done.stderr and "StoreConfigError" in done.stderr
