"""The file tier under what users fear: other processes, kill -9 mid-write, flipped bytes, two writers at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from kvgroups import KVGroupsError
from kvgroups.cli.main import main
from kvgroups.store import FileStore, KVChunkStore, open_store
from kvgroups.store.backends.files import store as files_module
from tests.support.paths import ROOT
from tests.support.stored_chunks import build_metadata, chunk_tensors, saved_store


def python(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finished(process: subprocess.Popen[str]) -> str:
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    return out


WRITE_CHUNKS = """
    import sys
    from tests.support.stored_chunks import build_metadata, saved_store
    store = saved_store(build_metadata([("full", 0), ("sliding", 12), ("recurrent", 0)]), sys.argv[1],
                        list(range(int(sys.argv[2]))))
    store.close()
"""
READ_CHUNKS = """
    import json, sys
    from kvgroups.store import KVChunkStore
    from tests.support.stored_chunks import build_metadata
    tokens = list(range(int(sys.argv[2])))
    store = KVChunkStore(build_metadata([("full", 0), ("sliding", 12), ("recurrent", 0)]), sys.argv[1])
    boundary = store.lookup(tokens)
    loaded = store.load(tokens, boundary)
    print(json.dumps([boundary, loaded.num_tokens, [float(part.tensor.float().sum()) for part in loaded.groups]]))
"""


def test_a_new_process_serves_what_another_wrote(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/kv"
    finished(python(WRITE_CHUNKS, url, "40"))
    metadata = build_metadata([("full", 0), ("sliding", 12), ("recurrent", 0)])
    store = KVChunkStore(metadata, url)
    tokens = list(range(40))
    assert store.lookup(tokens) == 40
    loaded = store.load(tokens, 40)
    expected = [chunk_tensors(store, tokens, chunk) for chunk in range(5)]
    assert torch.equal(loaded.groups[0].tensor, torch.cat([chunk[0] for chunk in expected], dim=2))
    assert torch.equal(loaded.groups[2].tensor, expected[4][2])
    saved_store(metadata, url, list(range(64)))  # and the other way round
    boundary, loaded_tokens, sums = json.loads(finished(python(READ_CHUNKS, url, "64")))
    assert boundary == loaded_tokens == 64 and len(sums) == 3


KEEP_WRITING = """
    import sys
    from kvgroups.store import FileStore
    store = FileStore(sys.argv[1])
    size = 24 << 20
    # Two values built once, alternating by round (a file mixing them would not be whole), so that
    # the writer's time goes to the store's writes rather than to building values.
    values = [round_.to_bytes(8, "little") * (size // 8) for round_ in (1, 2)]
    round_ = 0
    while True:
        for key in ("k0", "k1", "k2"):
            store.put(key, values[round_ % 2])
            if round_ == 0 and key == "k2":
                print("ready", flush=True)
        round_ += 1
"""


def whole(value: bytes) -> bool:
    return len(value) == 24 << 20 and value == value[:8] * (len(value) // 8)


def test_kill_9_mid_write_leaves_no_partial_value(tmp_path: Path) -> None:
    directory = tmp_path / "kv"
    # Much of a put is the rename over the old entry (freeing 24 MiB; a kill waits for it), after
    # which no temporary file is left: kill at least three times, and on until a kill has landed
    # mid-write (its temporary file is left behind); one kill in three or so does.
    for attempt, delay in enumerate((0.05, 0.13, 0.31) * 8):
        if attempt >= 3 and list(directory.glob("*/.tmp-*")):
            break
        writer = python(KEEP_WRITING, str(directory))
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        time.sleep(delay)
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
        store = FileStore(directory)
        for key in ("k0", "k1", "k2"):
            value = store.get(key)
            assert value is not None and whole(value), key
        assert sorted(store.iter_keys()) == ["k0", "k1", "k2"]
    leftovers = list(directory.glob("*/.tmp-*"))
    assert leftovers  # the writers were killed mid-write (their temporary files are left behind)
    for path in leftovers:  # what killed writers left behind is removed once it is old
        os.utime(path, (time.time() - 3600, time.time() - 3600))
    FileStore(directory)
    assert list(directory.glob("*/.tmp-*")) == []


def test_two_processes_writing_the_same_keys_leave_only_whole_values(tmp_path: Path) -> None:
    directory = tmp_path / "kv"
    FileStore(directory)
    writers = [python(KEEP_WRITING, str(directory)) for _ in range(2)]
    for writer in writers:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
    reader = FileStore(directory)
    deadline = time.monotonic() + 1.5
    reads = 0
    while time.monotonic() < deadline:
        for key in ("k0", "k1", "k2"):
            value = reader.get(key)
            assert value is not None and whole(value)
            reads += 1
    for writer in writers:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    assert reads > 3
    assert all(whole(reader.get(key) or b"") for key in ("k0", "k1", "k2"))


def test_a_flipped_byte_makes_its_entry_a_miss_and_verify_reports_it(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    url = f"file://{tmp_path}/kv"
    metadata = build_metadata([("full", 0), ("recurrent", 0)])
    tokens = list(range(32))
    store = saved_store(metadata, url, tokens)
    assert main(["store", "verify", url]) == 0
    assert "checked 8 entries" in capsys.readouterr().out
    victim = Path(FileStore(f"{tmp_path}/kv")._path(store.entry_key(store.keys(tokens)[2], 0)))
    data = bytearray(victim.read_bytes())
    data[-7] ^= 0x01  # one bit of the tensor payload
    victim.write_bytes(bytes(data))
    fresh = KVChunkStore(metadata, url)
    assert fresh.lookup(tokens) == 32  # the file is there...
    loaded = fresh.load(tokens, 32)
    assert loaded.num_tokens == 16  # ...but its checksum fails: a shorter prefix, exact
    assert torch.equal(loaded.groups[0].tensor, torch.cat(
        [chunk_tensors(fresh, tokens, chunk)[0] for chunk in range(2)], dim=2))
    saved_store(metadata, url, tokens)  # write it again, then break its header instead
    data = bytearray(victim.read_bytes())
    data[data.index(b'"chunk":"2"') + 9] = ord("3")
    victim.write_bytes(bytes(data))
    assert fresh.load(tokens, 32).num_tokens == 16  # asked as chunk 2, it says chunk 3: refused
    saved_store(metadata, url, tokens)
    data = bytearray(victim.read_bytes())
    data[data.index(b'"chunk":"2"') + 9] = ord("3")
    victim.write_bytes(bytes(data))
    assert main(["store", "verify", url]) == 1
    out = capsys.readouterr().out
    assert "1 bad" in out and "does not match its header and bytes" in out
    assert main(["store", "verify", url, "--delete", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["checked"] == 8 and len(report["bad"]) == 1 and report["deleted"] == 1
    assert main(["store", "verify", url]) == 0
    capsys.readouterr()


def test_store_stats_and_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"file://{tmp_path}/kv"
    began = int(time.time())
    first = saved_store(build_metadata([("full", 0)]), url, list(range(24)))
    second = saved_store(build_metadata([("full", 0)], model_name="other"), url, list(range(16)))
    FileStore(f"{tmp_path}/kv").put("stray", b"not an entry")
    assert main(["store", "stats", url, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    by_fingerprint = {row["fingerprint"]: row["entries"] for row in report["by_fingerprint"]}
    assert by_fingerprint == {first.fingerprint: 3, second.fingerprint: 2, "(not an entry)": 1}
    store = FileStore(f"{tmp_path}/kv")
    assert report["entries"] == 6 and report["bytes"] == sum(store.size_of(key) or 0 for key in store.iter_keys())
    # When the oldest and newest entries were written (from their headers; the stray file says nothing).
    written = {row["fingerprint"]: (row["oldest"], row["newest"]) for row in report["by_fingerprint"]}
    assert written["(not an entry)"] == (None, None)
    window = [time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(second)) for second in range(began, int(time.time()) + 1)]
    assert all(oldest in window and newest in window and oldest <= newest
               for oldest, newest in (written[first.fingerprint], written[second.fingerprint]))
    assert (report["oldest"], report["newest"]) == (min(w[0] for w in written.values() if w[0]),
                                                    max(w[1] for w in written.values() if w[1]))
    assert main(["store", "stats", url]) == 0
    table = capsys.readouterr().out
    assert first.fingerprint in table and "6 entries" in table and f"written {report['oldest']} to" in table
    assert main(["store", "clear", url]) == 0
    assert capsys.readouterr().out.strip().startswith("deleted 6 entries")
    assert open_store(url).stats().entries == 0


def test_a_directory_that_is_not_a_store_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(KVGroupsError, match=r"is not empty and not a kvgroups store \(it holds \['notes.txt'\]\)"):
        FileStore(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / files_module.MARKER).write_text('{"format": "someone-else/9"}')
    with pytest.raises(KVGroupsError, match=r"holds a store of format .*someone-else/9"):
        FileStore(tmp_path / "other")


def test_the_budget_holds_across_processes(tmp_path: Path) -> None:
    directory = tmp_path / "kv"
    store = FileStore(directory, max_bytes=8 << 20)
    code = """
        import sys
        from kvgroups.store import FileStore
        store = FileStore(sys.argv[1], max_bytes=8 << 20)
        for index in range(12):
            store.put(f"{sys.argv[2]}-{index}", bytes(1 << 20))
    """
    finished(python(code, str(directory), "a"))
    finished(python(code, str(directory), "b"))
    store.put("last", bytes(1 << 20))
    store._enforce_budget()
    assert store.stats().bytes <= 8 << 20
    assert store.contains("last") and store.contains("b-11") and not store.contains("a-0")


@pytest.mark.parametrize("tier", ["memory", "file"])
def test_a_tier_tells_its_eviction_listener_every_key_it_evicts(tier: str, tmp_path: Path) -> None:
    """What a tier drops on its own (its budget) is told, key by key, to whoever listens (the vLLM
    connector announces those blocks removed); the keys it keeps are not."""
    from kvgroups.store import MemoryStore

    store = MemoryStore(4096) if tier == "memory" else FileStore(tmp_path / "files", max_bytes=4096)
    heard: list[str] = []
    store.eviction_listener = heard.extend
    for index in range(12):
        store.put(f"key-{index}", bytes(1000))
    kept = set(store.iter_keys())
    assert heard and len(heard) == len(set(heard)) == store.evictions == 12 - len(kept)
    assert set(heard) | kept == {f"key-{index}" for index in range(12)} and not set(heard) & kept
    if tier == "memory":
        assert heard[0] == "key-0"  # least recently used first (the file tier's recency is a file time)


def test_shard_directories_removed_behind_its_back_are_made_again(tmp_path: Path) -> None:
    """An operator emptying the store (``rm -rf dir/*``) while a server runs: the server's store, which
    keeps its shard directories open, writes again and sees what another process writes after."""
    store, other = FileStore(tmp_path / "kv"), FileStore(tmp_path / "kv")
    keys = [f"key-{index}" for index in range(64)]
    for key in keys:
        store.put(key, key.encode())
    for shard in (tmp_path / "kv").iterdir():
        if shard.is_dir():
            for entry in shard.iterdir():
                entry.unlink()
            shard.rmdir()
    assert [store.get(key) for key in keys] == [None] * len(keys)
    assert not any(store.contains(key) for key in keys)
    for key in keys[:32]:
        store.put(key, key.encode())  # ENOENT in a directory that is gone: made again, written
    for key in keys[32:]:
        other.put(key, key.encode())  # into directories the first store had open before they went
    assert [bytes(store.get(key) or b"") for key in keys] == [key.encode() for key in keys]
    assert all(store.contains(key) and store.size_of(key) == len(key) for key in keys)
    assert sum(store.delete(key) for key in keys) == len(keys)
    assert [other.get(key) for key in keys] == [None] * len(keys)
    store.close()
    other.close()
