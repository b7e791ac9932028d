"""``kvstore ls``, ``stats``, ``inspect``, ``verify``, ``gc`` and ``delete`` on stores of
real records: what they print, their JSON, what they change (only when asked)."""

from __future__ import annotations

import json

import numpy as np

from kvstore.cli import main
from kvstore.codecs.record import read_header
from kvstore.store import keys as K
from kvstore.store import open_backend, open_store
from kvstore.store.blocks.index import decode_use
from kvstore.store.maintenance.inventory import list_blocks, open_existing

from .conftest import content, kvstore_cli, raw_items
from .stores import NS, prompts


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    status = main([*argv, "--json"])
    return status, json.loads(capsys.readouterr().out)


def record_keys(path) -> list[bytes]:
    return sorted(k for k in raw_items(path) if K.split_record_key(k))


def flip_bit(path, key: bytes, byte: int) -> None:
    backend = open_backend(f"lmdb://{path}")
    try:
        with backend.reader() as view:
            value = bytearray(view.get(key))
        value[byte] ^= 1
        backend.put_many([(key, bytes(value))])
    finally:
        backend.close()


def test_ls_lists_namespaces_with_exact_totals(make_store, capsys):
    path = make_store()
    status, out = run_json(capsys, "ls", str(path))
    assert status == 0
    blocks = len(record_keys(path))
    nbytes = sum(len(raw_items(path)[k]) for k in record_keys(path))
    assert out["namespaces"] == [
        {"namespace": NS, "blocks": blocks, "bytes": nbytes, "max_bytes": None}
    ]
    assert out["block_size"] == 16
    assert main(["ls", str(path)]) == 0
    text = capsys.readouterr().out
    assert NS in text and str(blocks) in text and "block size  16 tokens" in text


def test_ls_namespace_lists_prompts_and_blocks(make_store, capsys):
    path = make_store()
    status, out = run_json(capsys, "ls", f"lmdb://{path}", "--namespace", NS)
    assert status == 0
    # 3 prompts of 70 tokens sharing 35: 2 shared full blocks, then 3 x (2 full + a tail).
    assert [p["tokens"] for p in out["prompts"]] == [70, 70, 70]
    assert [p["blocks"] for p in out["prompts"]] == [5, 5, 5]
    assert len(out["blocks"]) == 2 + 3 * 3
    tails = [b for b in out["blocks"] if not b["full"]]
    assert [(b["start"], b["tokens"]) for b in tails] == [(64, 6)] * 3
    assert {b["family"] for b in out["blocks"]} == {"kv:plain"}
    assert sum(b["leaf"] for b in out["blocks"]) == 3
    assert main(["ls", str(path), "-n", NS]) == 0
    text = capsys.readouterr().out
    assert "3 prompts in 11 blocks" in text and "tail" in text


def test_stats_reports_bytes_by_family_and_namespace_and_no_invented_activity(make_store, capsys):
    path = make_store("gemma")
    status, out = run_json(capsys, "stats", str(path))
    assert status == 0
    assert out["by_family"] == {"kv:rotating-plain+kv:plain": out["bytes"]}
    assert out["namespaces"][NS]["blocks"] == out["blocks"] == len(record_keys(path))
    assert out["activity"] is None and "not persisted" in out["activity_note"]
    assert out["settings"]["block_size"] == 16
    assert main(["stats", str(path)]) == 0
    text = capsys.readouterr().out
    assert "storage policy  lossless" in text and "misses by reason: cold" in text
    assert "large values    1.0 MiB or more: in values.kv beside LMDB" in text


def test_stats_of_stores_without_one_backend_or_value_file(capsys):
    # A tiered store has no single backend, a memory store no value file: no "large
    # values" line, and stats of either still work.
    for url in ("tiered://?tiers=memory://a,memory://b", "memory://m"):
        assert main(["stats", url]) == 0
        text = capsys.readouterr().out
        assert text.startswith(f"store           {url}") and "large values" not in text


def test_inspect_key_shows_header_layers_and_verified_checksum(make_store, capsys):
    path = make_store("gemma")
    key = record_keys(path)[0]
    record = raw_items(path)[key]
    header = read_header(record)
    digest = key.decode().rsplit("/", 1)[1]
    for name in (key.decode(), f"{NS}/{digest}", digest[:10]):
        status, out = run_json(capsys, "inspect", str(path), name)
        assert status == 0
        assert out["key"] == key.decode() and out["check"] == "verified"
        assert out["bytes"] == len(record) == out["index_bytes"]
        layers = out["header"]["layers"]
        assert [ly["signature"] for ly in layers] == [ly.signature for ly in header.layers]
        assert layers[0]["tensors"][0] == {
            "name": "keys",
            "dtype": "float16",
            "shape": list(header.layers[0].tensors[0].shape),
            "bytes": header.layers[0].tensors[0].nbytes,
        }
    assert main(["inspect", str(path), digest]) == 0
    text = capsys.readouterr().out
    assert "verified (xxh3-64" in text and "kv:rotating-plain" in text and "RotatingKVCodec" in text


def test_inspect_reports_a_corrupt_record_and_exits_1(make_store, capsys):
    path = make_store()
    key = record_keys(path)[0]
    flip_bit(path, key, len(raw_items(path)[key]) - 3)  # in the payload
    status, out = run_json(capsys, "inspect", str(path), key.decode())
    assert status == 1
    assert out["check"] == "corrupt" and "Payload checksum mismatch" in out["check_error"]
    assert out["header"] is not None  # the header itself is intact


def test_inspect_tokens_shows_the_lookup_and_blocks_read(make_store, tmp_path, capsys):
    path = make_store()
    prompt = prompts(3, 70, shared=35)[1]
    tokens = tmp_path / "prompt.json"
    tokens.write_text(json.dumps(prompt[:50]))
    status, out = run_json(capsys, "inspect", str(path), "--tokens", str(tokens))
    assert status == 0
    assert (out["prompt_tokens"], out["reused_tokens"], out["to_prefill"]) == (50, 49, 1)
    assert [(b["tokens"], b["rows"], b["stored_rows"]) for b in out["blocks"]] == [
        ([0, 16], 16, 16),
        ([16, 32], 16, 16),
        ([32, 48], 16, 16),
        ([48, 49], 1, 16),
    ]
    assert out["readable_blocks"] == 4 and out["miss_reason"] is None
    # a prompt nothing shares: a cold miss, in whitespace-separated form
    cold = tmp_path / "cold.txt"
    cold.write_text("300 301 302\n303")
    status, out = run_json(capsys, "inspect", str(path), "--tokens", str(cold), "-n", NS)
    assert (status, out["reused_tokens"], out["miss_reason"], out["blocks"]) == (0, 0, "cold", [])


def test_inspection_never_writes(make_store, tmp_path, capsys):
    path = make_store()
    before = raw_items(path)
    tokens = tmp_path / "t.npy"
    np.save(tokens, np.array(prompts(3, 70, shared=35)[0], dtype=np.int64))
    for argv in (
        ["ls", str(path)],
        ["ls", str(path), "-n", NS],
        ["stats", str(path)],
        ["verify", str(path)],
        ["inspect", str(path), record_keys(path)[0].decode()],
        ["inspect", str(path), "--tokens", str(tokens)],
    ):
        assert main(argv) == 0, argv
    capsys.readouterr()
    assert raw_items(path) == before  # not even a last-use update


def test_verify_reports_problems_and_fixes_only_with_fix(make_store, capsys):
    path = make_store()
    keys = record_keys(path)
    with open_existing(str(path)) as store:
        blocks = {b.key.encode(): b for b in list_blocks(store, NS.encode())}
    # corrupt a first block: it and everything after it are bad
    first = next(k for k in keys if blocks[k].index == 0)
    flip_bit(path, first, 100)
    status, out = run_json(capsys, "verify", str(path))
    assert status == 1
    assert out["found"]["corrupt"] == [first.decode()] and not out["found"]["repaired"]
    assert raw_items(path)[first]  # still there: no --fix
    status, out = run_json(capsys, "verify", str(path), "--fix")
    assert status == 0 and out["found"]["repaired"] and out["clean"]
    assert record_keys(path) == []  # every block descends from the corrupt first block
    assert main(["verify", str(path)]) == 0
    assert "clean." in capsys.readouterr().out


def test_verify_finds_orphans_and_dangling_keys(make_store, capsys):
    path = make_store()
    with open_existing(str(path)) as store:
        blocks = list_blocks(store, NS.encode())
    middle = next(b for b in blocks if b.index == 1)
    backend = open_backend(f"lmdb://{path}")
    try:  # drop the block's index entry (its last use names it): its children orphan
        use = backend.get_many([K.use_key(NS.encode(), bytes.fromhex(middle.digest))])[0]
        backend.delete_many([decode_use(use)[1]])
    finally:
        backend.close()
    status, out = run_json(capsys, "verify", str(path))
    assert status == 1
    assert middle.key in out["found"]["dangling"]  # a record without its entry
    assert len(out["found"]["orphans"]) == 3  # the three blocks at index 2
    assert out["found"]["totals_mismatch"]
    status, out = run_json(capsys, "verify", str(path), "--fix")
    assert status == 0 and out["after"]["blocks"] == 1  # only the first block is reachable


def test_gc_evicts_down_to_a_size(make_store, capsys):
    path = make_store()
    total = sum(len(v) for k, v in raw_items(path).items() if K.split_record_key(k))
    status, out = run_json(capsys, "gc", str(path), "--max-bytes", f"{total // 2}B")
    assert status == 0
    assert out["bytes_after"] <= total // 2 < out["bytes_before"] == total
    assert out["freed_bytes"] == total - out["bytes_after"]
    with open_existing(str(path)) as store:
        assert store.verify().clean  # leaves went first: chains are whole
    assert main(["gc", str(path), "--max-bytes", "1KiB"]) == 0
    assert "evicted" in capsys.readouterr().out


def test_delete_a_prompt_then_the_namespace(make_store, tmp_path, capsys):
    path = make_store()
    prompt = prompts(3, 70, shared=35)[2]
    tokens = tmp_path / "p.txt"
    tokens.write_text(",".join(map(str, prompt[:40])))
    status, out = run_json(capsys, "delete", str(path), "-n", NS, "--tokens", str(tokens))
    assert status == 0 and out["blocks"] == 3  # the prompt's own blocks, not the shared two
    with open_store(f"lmdb://{path}", readonly=True) as store:
        assert store.lookup(NS, prompt).tokens == 35  # the shared 35, from a sibling
        assert store.verify().clean
    status, out = run_json(capsys, "delete", str(path), "--namespace", NS)
    assert status == 0 and out["blocks"] == 8
    assert content(path) == {}


def test_commands_run_as_subprocesses(make_store):
    path = make_store()
    done = kvstore_cli("ls", str(path), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["namespaces"][0]["namespace"] == NS
    done = kvstore_cli("verify", str(path))
    assert done.returncode == 0 and "clean." in done.stdout
