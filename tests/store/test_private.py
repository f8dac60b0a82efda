"""Stores that are private and credentials that stay secret: file modes, foreign or writable
directories, symlinks inside a store, passwords in URLs, TLS and password-protected servers."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgroups.cli import main
from kvgroups.errors import KVGroupsError
from kvgroups.store import FileStore, KVChunkStore, StoreError, open_store
from tests.support.servers import certificates, running_server
from tests.support.stored_chunks import build_metadata, saved_store

PASSWORD = "s3cret-Pa55word"
TOKENS = list(range(24))


@pytest.fixture
def umask_022() -> Iterator[None]:
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


def test_files_and_directories_are_private_whatever_the_umask(tmp_path: Path, umask_022: None) -> None:
    directory = tmp_path / "kv"
    store = saved_store(build_metadata([("full", 0), ("recurrent", 0)]), f"file://{directory}", TOKENS)
    store.close()
    modes = {path.relative_to(directory): stat.S_IMODE(path.stat().st_mode) for path in directory.rglob("*")}
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert modes and all(mode == (0o700 if (directory / path).is_dir() else 0o600) for path, mode in modes.items())


def test_a_readable_store_of_ours_is_made_private(tmp_path: Path) -> None:
    directory = tmp_path / "kv"
    directory.mkdir(mode=0o755)
    os.chmod(directory, 0o755)
    FileStore(directory)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_a_directory_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    directory = tmp_path / "kv"
    directory.mkdir()
    os.chmod(directory, mode)
    with pytest.raises(KVGroupsError, match=r"is writable by other users .* use a directory of mode 0700"):
        FileStore(directory)


def test_a_directory_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    directory = tmp_path / "kv"
    directory.mkdir(mode=0o700)
    os.chown(directory, 65534, 65534)  # nobody
    with pytest.raises(KVGroupsError, match=r"is owned by user 65534, not by this process's user"):
        FileStore(directory)


def test_no_symlink_inside_the_store_is_followed(tmp_path: Path) -> None:
    directory = tmp_path / "kv"
    store = saved_store(build_metadata([("full", 0)]), f"file://{directory}", TOKENS)
    key = store.entry_key(store.keys(TOKENS)[0], 0)
    path = Path(FileStore(directory)._path(key))
    outside = tmp_path / "outside"
    outside.mkdir()
    # An entry replaced by a symlink to a file elsewhere (a whole, valid entry): never read through.
    (outside / "planted").write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(outside / "planted")
    assert FileStore(directory).get(key) is None and not path.is_symlink()  # the link is removed
    assert (outside / "planted").exists()  # and what it pointed to is left alone
    # A shard replaced by a symlink to a directory elsewhere: refused, not followed.
    shard = path.parent
    moved = tmp_path / "moved-shard"
    shard.rename(moved)
    shard.symlink_to(moved)
    fresh = FileStore(directory)
    with pytest.raises(StoreError, match=r"is not a shard directory of this store .* not followed"):
        fresh.get(key)
    fresh.close()
    store.close()


def test_a_password_never_reaches_logs_errors_reprs_or_output(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    with running_server(tmp_path / "server", password=PASSWORD) as server, caplog.at_level(logging.DEBUG):
        assert PASSWORD in server.url
        store = open_store(server.url)
        assert PASSWORD not in store.url and PASSWORD not in repr(store) and ":***@" in store.url
        chunks = saved_store(build_metadata([("full", 0)]), store, TOKENS)
        assert chunks.lookup(TOKENS) == 24
        assert main(["store", "stats", server.url]) == 0
        assert main(["store", "stats", server.url, "--json"]) == 0
        assert main(["store", "clear", server.url]) == 0
        wrong = server.url.replace(PASSWORD, "wrong-password")
        assert main(["store", "stats", wrong]) == 2
        with pytest.raises(KVGroupsError) as refused:
            open_store(server.url + "&ttl=soon" if "?" in server.url else server.url + "?ttl=soon")
        server.stop()
        assert chunks.lookup(list(range(100, 124))) == 0  # a failure, logged
        chunks.close()
    captured = capsys.readouterr()
    everything = captured.out + captured.err + caplog.text + str(refused.value)
    assert PASSWORD not in everything and "wrong-password" not in everything
    assert "***" in captured.out


def test_a_tls_server_with_generated_certificates(tmp_path: Path) -> None:
    tls = certificates(tmp_path / "certificates")
    with running_server(tmp_path / "server", tls=tls, password=PASSWORD) as server:
        assert server.url.startswith("rediss://")
        store = saved_store(build_metadata([("full", 0)]), server.url, TOKENS)
        assert store.lookup(TOKENS) == 24 and store.load(TOKENS, 24).num_tokens == 24
        assert PASSWORD not in store.store.url
        store.close()
        # Without the client certificate the server refuses the connection: a miss, no exception.
        bare = server.url.split("&ssl_certfile")[0]
        without = KVChunkStore(build_metadata([("full", 0)]), bare)
        assert without.lookup(TOKENS) == 0 and without.stats.failed_reads == 1
        without.close()


def test_a_unix_socket_with_a_password(tmp_path: Path) -> None:
    with running_server(tmp_path / "server", unix=True, password=PASSWORD) as server:
        assert server.url.startswith("unix://:")
        store = saved_store(build_metadata([("full", 0)]), f"{server.url}?db=1", TOKENS)
        assert store.lookup(TOKENS) == 24 and PASSWORD not in store.store.url
        store.close()
        refused = KVChunkStore(build_metadata([("full", 0)]), server.url.replace(PASSWORD, "nope"))
        assert refused.lookup(TOKENS) == 0 and refused.stats.failed_reads == 1
        refused.close()


def test_store_clear_on_a_server_asks_first_and_takes_a_fingerprint(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with running_server(tmp_path / "server") as server:
        mine = saved_store(build_metadata([("full", 0)], model_name="mine"), server.url, TOKENS)
        theirs = saved_store(build_metadata([("full", 0)], model_name="theirs"), server.url, TOKENS)
        assert main(["store", "clear", server.url]) == 0
        assert "would delete (pass --yes to delete) 6 entries" in capsys.readouterr().out
        assert mine.lookup(TOKENS) == 24 and theirs.lookup(TOKENS) == 24  # nothing went
        assert main(["store", "clear", server.url, "--fingerprint", mine.fingerprint, "--yes"]) == 0
        assert f"deleted 3 entries of fingerprint {mine.fingerprint}" in capsys.readouterr().out
        assert mine.lookup(TOKENS) == 0 and theirs.lookup(TOKENS) == 24  # another tenant's entries stay
        assert main(["store", "clear", server.url, "--yes"]) == 0
        assert theirs.lookup(TOKENS) == 0
        mine.close()
        theirs.close()
