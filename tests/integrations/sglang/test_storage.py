"""KVGroupsHiCacheStorage through SGLang's own storage code: its backend factory loads it from the extra config
as `--hicache-storage-backend dynamic` does, its host memory pools (MHA in three layouts, MLA) hold the pages,
and its fault injection wraps it. Pages one backend stores are read back byte for byte by another (another
pool, another process), on both of SGLang's data paths, on a file store and a real Valkey/Redis server;
another rank, model or page size never hits, and damage, forgery and a store going away are misses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from kvgroups.integrations.sglang import KVGroupsHiCacheStorage
from kvgroups.integrations.sglang.pools import UnsupportedPoolError
from kvgroups.integrations.sglang.settings import BackendConfigError
from kvgroups.store.backends.mooncake.settings import parse_mooncake_url
from tests.integrations.sglang.stores import KINDS, fresh_store
from tests.support.paths import ROOT
from tests.support.servers import running_server

PAGE = 4
LAYOUTS = ("layer_first", "page_first", "page_first_direct")
HASHES = [f"{index:064x}" for index in range(1, 7)]  # SGLang's page hashes are hex SHA-256 digests


def host_pool(layout: str = "layer_first", *, page_size: int = PAGE, seed: int | None = None) -> Any:
    """An SGLang MHA host pool of 3 layers, 2 heads of 8 dims on the CPU; ``seed``: filled with random values."""
    device_pool = MHATokenToKVPool(size=128, page_size=page_size, dtype=torch.bfloat16, head_num=2, head_dim=8,
                                   layer_num=3, device="cpu", enable_memory_saver=False)
    pool = MHATokenToKVPoolHost(device_pool.get_device_pool_infos()[0].buffer_info, 2, 0, page_size, layout,
                                pin_memory=False, device_capacity_tokens=device_pool.size, start_layer=0, end_layer=3,
                                write_back_staging=device_pool.hicache_write_back_staging)
    if seed is not None:
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=torch.Generator().manual_seed(seed)))
    return pool


def mla_host_pool(layout: str = "layer_first", *, seed: int | None = None) -> Any:
    """An SGLang MLA host pool of 3 layers, a 16-dim latent and 4 rope dims on the CPU."""
    device_pool = MLATokenToKVPool(size=128, page_size=PAGE, dtype=torch.bfloat16, kv_lora_rank=16,
                                   qk_rope_head_dim=4, layer_num=3, device="cpu", enable_memory_saver=False)
    pool = MLATokenToKVPoolHost(device_pool.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, layout,
                                pin_memory=False, device_capacity_tokens=device_pool.size, start_layer=0, end_layer=3,
                                target_layer_num=3, override_kv_cache_dim=device_pool.kv_cache_dim)
    if seed is not None:
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=torch.Generator().manual_seed(seed)))
    return pool


def storage_config(store: str | list[str], *, tp_rank: int = 0, tp_size: int = 1, model: str = "org/tiny",
                   interface_v1: bool = False, mla: bool = False, **options: Any) -> HiCacheStorageConfig:
    extra = {"backend_name": "kvgroups", "module_path": "kvgroups.integrations.sglang",
             "class_name": "KVGroupsHiCacheStorage", "store": store, **options}
    if interface_v1:
        extra["interface_v1"] = 1
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=True,
                                is_page_first_layout=False, model_name=model, extra_config=extra)


def backend(config: HiCacheStorageConfig, pool: Any) -> Any:
    """The backend as SGLang builds it: the dynamic factory, then the host pool registered."""
    created = StorageBackendFactory.create_backend("dynamic", config, pool)
    created.register_mem_pool_host(pool)
    return created


def pages(pool: Any, first_page: int, count: int) -> list[torch.Tensor]:
    return [pool.get_data_page((first_page + index) * pool.page_size, flat=True).clone() for index in range(count)]


def host_indices(pool: Any, first_page: int, count: int) -> torch.Tensor:
    return torch.arange(first_page * pool.page_size, (first_page + count) * pool.page_size)


def store_with_v1(writer: Any, pool: Any, first_page: int, keys: list[str]) -> list[bool]:
    result: list[bool] = writer.batch_set_v1(keys, host_indices(pool, first_page, len(keys)))
    return result


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("write_v1", "read_v1"), [(False, False), (True, True), (False, True), (True, False)],
                         ids=["generic", "v1", "generic-then-v1", "v1-then-generic"])
def test_pages_one_backend_stores_another_reads_byte_for_byte(kind: str, layout: str, write_v1: bool,
                                                               read_v1: bool, tmp_path: Path,
                                                               request: pytest.FixtureRequest) -> None:
    url = fresh_store(kind, tmp_path, request)
    source, target = host_pool(layout, seed=1), host_pool(layout)
    writer = backend(storage_config(url, interface_v1=write_v1), source)
    if write_v1:
        assert store_with_v1(writer, source, 2, HASHES[:4]) == [True] * 4
    else:
        assert writer.batch_set(HASHES[:4], pages(source, 2, 4)) is True
    reader = backend(storage_config(url, interface_v1=read_v1), target)
    assert reader.batch_exists(HASHES) == 4
    if read_v1:
        assert reader.batch_get_v1(HASHES[:5], host_indices(target, 7, 5)) == [True] * 4 + [False]
        assert [torch.equal(got, want) for got, want in zip(pages(target, 7, 4), pages(source, 2, 4), strict=True)] \
            == [True] * 4
    else:
        flat = [target.get_dummy_flat_data_page() for _ in range(5)]
        got = reader.batch_get(HASHES[:5], flat)
        assert [page is not None for page in got] == [True] * 4 + [False]
        assert all(torch.equal(page, want) for page, want in zip(got[:4], pages(source, 2, 4), strict=False))
    assert reader.stats.corrupt_entries == 0 and reader.stats.loaded_tokens == 4 * PAGE


def test_a_batch_of_pages_is_read_in_one_store_call_on_a_real_server(tmp_path: Path,
                                                                      request: pytest.FixtureRequest) -> None:
    """SGLang's batch of pages is asked of the store at once (on Redis: every page's read sent before the first
    reply is read), not page after page, and stops serving at the first miss."""
    url = fresh_store("redis", tmp_path, request)
    source, target = host_pool(seed=3), host_pool()
    writer = backend(storage_config(url, interface_v1=True), source)
    assert store_with_v1(writer, source, 0, HASHES[:4]) == [True] * 4
    reader = backend(storage_config(url, interface_v1=True), target)
    calls: list[int] = []
    asked = reader.store.get_many
    reader.store.get_many = lambda keys, max_bytes=None: calls.append(len(keys)) or asked(keys, max_bytes)
    assert reader.batch_get_v1([*HASHES[:2], HASHES[5], HASHES[2]], host_indices(target, 0, 4)) == \
        [True, True, False, False]
    assert calls == [4]
    assert [torch.equal(got, want) for got, want in zip(pages(target, 0, 2), pages(source, 0, 2), strict=True)] \
        == [True, True]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("interface_v1", [False, True], ids=["generic", "v1"])
def test_mla_pages_are_written_by_one_rank_and_read_by_every_rank(layout: str, interface_v1: bool,
                                                                 tmp_path: Path) -> None:
    """MLA's latent rows are the same on every tensor-parallel rank: SGLang lets one rank write them, and every
    rank reads that rank's pages; a rank that is not the writer writes nothing."""
    url = f"file://{tmp_path}/kv"
    source = mla_host_pool(layout, seed=11)
    writer = backend(storage_config(url, tp_size=2, mla=True, interface_v1=interface_v1), source)
    idle = backend(storage_config(url, tp_rank=1, tp_size=2, mla=True, interface_v1=interface_v1),
                   mla_host_pool(layout, seed=12))
    if interface_v1:
        assert store_with_v1(writer, source, 1, HASHES[:3]) == [True] * 3
        assert store_with_v1(idle, idle.pools["kv"].host_pool, 1, HASHES[:3]) == [True] * 3
    else:
        assert writer.batch_set(HASHES[:3], pages(source, 1, 3)) is True
        assert idle.batch_set(HASHES[:3], pages(idle.pools["kv"].host_pool, 1, 3)) is True
    assert idle.stats.saved_chunks == 0 and writer.stats.saved_chunks == 3
    target = mla_host_pool(layout)
    reader = backend(storage_config(url, tp_rank=1, tp_size=2, mla=True, interface_v1=True), target)
    assert reader.batch_exists(HASHES) == 3
    assert reader.batch_get_v1(HASHES[:3], host_indices(target, 4, 3)) == [True] * 3
    assert all(torch.equal(got, want) for got, want in zip(pages(target, 4, 3), pages(source, 1, 3), strict=True))
    mha = backend(storage_config(url, tp_size=2), host_pool(layout))
    assert mha.batch_exists(HASHES) == 0  # another page format under the same page hashes


def test_a_page_written_twice_is_stored_once_and_reads_stop_at_the_first_miss(tmp_path: Path) -> None:
    source = host_pool(seed=2)
    writer = backend(storage_config(f"file://{tmp_path}/kv"), source)
    assert writer.batch_set([HASHES[0], HASHES[2]], pages(source, 0, 2))
    assert writer.batch_set([HASHES[0], HASHES[2]], pages(source, 0, 2))
    assert writer.stats.saved_chunks == 2
    assert writer.batch_exists(HASHES) == 1
    got = writer.batch_get(HASHES[:3], [source.get_dummy_flat_data_page() for _ in range(3)])
    assert [page is not None for page in got] == [True, False, False]  # page 2 exists, but after a miss


@pytest.mark.parametrize(("change", "hits"), [
    ({}, 3),
    ({"tp_rank": 1, "tp_size": 2}, 0),
    ({"model": "org/other"}, 0),
    ({"salt": "tenant-b"}, 0),
    ({"page_size": 8}, 0),
    ({"layout": "page_first"}, 0),
], ids=["same", "another-rank", "another-model", "another-salt", "another-page-size", "another-layout"])
def test_another_rank_model_salt_page_size_or_layout_never_hits(change: dict[str, Any], hits: int,
                                                                tmp_path: Path) -> None:
    url = f"file://{tmp_path}/kv"
    source = host_pool(seed=3)
    writer = backend(storage_config(url, tp_size=2), source)
    assert writer.batch_set(HASHES[:3], pages(source, 0, 3))
    pool_change = {name: change.pop(name) for name in ("page_size", "layout") if name in change}
    config = {"tp_size": 2, **change}
    salt = config.pop("salt", None)
    reader = backend(storage_config(url, **config, **({"salt": salt} if salt else {})), host_pool(**pool_change))
    assert reader.batch_exists(HASHES[:3]) == hits


def test_a_flipped_byte_is_a_counted_miss_and_the_entry_is_deleted(tmp_path: Path) -> None:
    source = host_pool(seed=4)
    writer = backend(storage_config(f"file://{tmp_path}/kv"), source)
    assert writer.batch_set(HASHES[:2], pages(source, 0, 2))
    files = sorted(path for path in (tmp_path / "kv").rglob("*") if path.is_file() and path.stat().st_size > 1000)
    assert len(files) == 2
    for victim in files:
        data = bytearray(victim.read_bytes())
        data[-7] ^= 0x10
        victim.write_bytes(bytes(data))
    reader = backend(storage_config(f"file://{tmp_path}/kv"), host_pool())
    got = reader.batch_get(HASHES[:2], [source.get_dummy_flat_data_page() for _ in range(2)])
    assert got == [None, None]
    assert reader.stats.corrupt_entries == 1  # the second page is not read after the first missed
    assert reader.batch_exists(HASHES[:2]) == 0


def test_a_damaged_copy_in_a_tier_list_is_served_from_the_next_tier_that_holds_it_intact(tmp_path: Path) -> None:
    tiers = [f"file://{tmp_path}/front", f"file://{tmp_path}/back"]
    source = host_pool(seed=14)
    assert backend(storage_config(tiers), source).batch_set(HASHES[:2], pages(source, 0, 2))
    for victim in (path for path in (tmp_path / "front").rglob("*") if path.is_file() and path.stat().st_size > 1000):
        data = bytearray(victim.read_bytes())
        data[-7] ^= 0x10
        victim.write_bytes(bytes(data))
    target = host_pool()
    reader = backend(storage_config(tiers, interface_v1=True), target)
    assert reader.batch_get_v1(HASHES[:2], host_indices(target, 0, 2)) == [True, True]
    assert all(torch.equal(got, want) for got, want in zip(pages(target, 0, 2), pages(source, 0, 2), strict=True))
    assert reader.stats.corrupt_entries == 2


def test_with_a_secret_an_entry_written_without_it_is_a_miss(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/kv"
    secret_file = tmp_path / "secret"
    secret_file.write_text("a deployment secret of enough bytes")
    secret_file.chmod(0o600)
    source = host_pool(seed=5)
    keyed = backend(storage_config(url, secret_file=str(secret_file)), source)
    plain = backend(storage_config(url), source)
    assert plain.batch_set(HASHES[:2], pages(source, 0, 2))
    assert keyed.batch_exists(HASHES[:2]) == 0  # keys under the secret are other keys
    # A forger who can write the store, without the secret: the entry under the keyed name is re-encoded
    # from a plain one (the name is all they could learn, from listing the store).
    forged_name = keyed.store_key(HASHES[0])
    plain_entry = plain.store.get(plain.store_key(HASHES[0]))
    assert plain_entry is not None
    keyed.store.put(forged_name, plain_entry)
    assert keyed.batch_exists(HASHES[:1]) == 1
    got = keyed.batch_get(HASHES[:1], [source.get_dummy_flat_data_page()])
    assert got == [None] and keyed.stats.corrupt_entries == 1
    assert keyed.batch_set(HASHES[:2], pages(source, 0, 2))
    assert all(page is not None for page in keyed.batch_get(HASHES[:2], [source.get_dummy_flat_data_page()] * 2))


def test_a_server_stopped_mid_run_costs_misses_and_failed_writes_never_an_exception(tmp_path: Path) -> None:
    source = host_pool(seed=6)
    with running_server(tmp_path / "valkey") as server:
        storage = backend(storage_config(server.url + "?timeout=0.5"), source)
        assert storage.batch_set(HASHES[:2], pages(source, 0, 2))
        assert storage.batch_exists(HASHES[:2]) == 2
        server.stop()
        assert storage.batch_exists(HASHES[:2]) == 0
        assert storage.batch_get(HASHES[:2], [source.get_dummy_flat_data_page()] * 2) == [None, None]
        assert storage.batch_set(HASHES[2:4], pages(source, 2, 2)) is False
        assert storage.batch_get_v1(HASHES[:2], host_indices(source, 0, 2)) == [False, False]
    assert storage.stats.failed_reads >= 1


@pytest.mark.parametrize("failure", ["1.0", "0.5"])
def test_sglangs_fault_injection_passes_through_cleanly(failure: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's own injector wraps the backend (its factory does, as on a server): a call it fails is a miss
    or a failed write, never an exception and never a wrong page."""
    url = f"file://{tmp_path}/kv"
    source = host_pool(seed=7)
    assert backend(storage_config(url), source).batch_set(HASHES, pages(source, 0, len(HASHES)))
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", failure)
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.001")
    target = host_pool()
    wrapped = backend(storage_config(url, interface_v1=True), target)
    assert type(wrapped).__name__ == "HiCacheStorageFailureInjector"
    for _ in range(20):
        hits = wrapped.batch_exists(HASHES)
        assert 0 <= hits <= len(HASHES)
        read = wrapped.batch_get_v1(HASHES, host_indices(target, 0, len(HASHES)))
        expected = pages(source, 0, len(HASHES))
        assert all(torch.equal(got, want) for got, want, ok in zip(pages(target, 0, len(HASHES)), expected, read,
                                                                   strict=True) if ok)
        if failure == "1.0":
            assert hits == 0 and read == [False] * len(HASHES)
    wrapped.close()


WRITER = """
import sys, torch
from tests.integrations.sglang import torchvision_stand_in
torchvision_stand_in.install()
from tests.integrations.sglang.test_storage import HASHES, backend, host_pool, pages, storage_config
source = host_pool(sys.argv[2], seed=8)
print(backend(storage_config(sys.argv[1]), source).batch_set(HASHES[:3], pages(source, 1, 3)))
"""


def test_another_process_reads_what_one_process_wrote(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/kv"
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    written = subprocess.run([sys.executable, "-c", textwrap.dedent(WRITER), url, "page_first"],
                             capture_output=True, text=True, env=environment, timeout=300, check=False)
    assert written.returncode == 0, written.stderr
    assert written.stdout.strip().splitlines()[-1] == "True"
    target = host_pool("page_first")
    reader = backend(storage_config(url, interface_v1=True), target)
    assert reader.batch_get_v1(HASHES[:3], host_indices(target, 0, 3)) == [True] * 3
    assert all(torch.equal(got, want) for got, want in zip(pages(target, 0, 3),
                                                           pages(host_pool("page_first", seed=8), 1, 3), strict=True))


@pytest.mark.parametrize(("extra", "message"), [
    ({"store": None}, "'store' must be a store URL"),
    ({"stor": "file:///x"}, "unknown keys ['stor']"),
    ({"encrypt": True}, "'encrypt' needs a secret"),
    ({"salt": 3}, "'salt' must be a str"),
])
def test_bad_extra_config_is_refused_naming_every_field(extra: dict[str, Any], message: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVGROUPS_STORE_SECRET", raising=False)
    config = storage_config("file:///tmp/unused")
    config.extra_config = {**{k: v for k, v in config.extra_config.items() if k != "store"},
                           "store": "file:///tmp/unused", **extra}
    if extra.get("store", "") is None:
        del config.extra_config["store"]
    with pytest.raises(BackendConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        KVGroupsHiCacheStorage(config, {})


def test_a_password_never_reaches_the_settings_repr_or_errors() -> None:
    config = storage_config("redis://user:hunter2secret@127.0.0.1:1/0", bogus=1)
    with pytest.raises(BackendConfigError) as raised:
        KVGroupsHiCacheStorage(config, {})
    assert "hunter2secret" not in str(raised.value)


def test_get_stats_reports_pages_and_bandwidth_in_sglangs_metrics(tmp_path: Path) -> None:
    source = host_pool(seed=9)
    storage = backend(storage_config(f"file://{tmp_path}/kv"), source)
    assert storage.batch_set(HASHES[:3], pages(source, 0, 3))
    storage.batch_get(HASHES[:3], [source.get_dummy_flat_data_page() for _ in range(3)])
    stats = storage.get_stats()
    assert type(stats).__name__ == "StorageMetrics"
    assert stats.backup_pgs == [3] and stats.prefetch_pgs == [3]
    assert all(value > 0 for value in stats.backup_bandwidth + stats.prefetch_bandwidth)
    again = storage.get_stats()
    assert again.backup_pgs == [] and again.prefetch_pgs == []
    assert json.dumps(storage.stats.summary())  # the kvgroups counters are plain values


def test_a_pool_kvgroups_does_not_describe_is_refused_by_name(tmp_path: Path) -> None:
    """A pool of a kind kvgroups does not describe (a sliding window's, say) fails SGLang's attach, naming it,
    rather than have a prefix served without what that pool holds."""

    class SlidingWindowPoolHost:  # stands in for a pool class kvgroups has no describer for
        page_size = 4

    storage = backend(storage_config(f"file://{tmp_path}/kv"), host_pool())
    with pytest.raises(UnsupportedPoolError, match="'swa' of type SlidingWindowPoolHost"):
        storage.register_mem_host_pool_v2(SlidingWindowPoolHost(), "swa")


@pytest.mark.parametrize("document", ["docs/sglang.md", "README.md"])
def test_the_documented_command_line_loads_the_backend(document: str, tmp_path: Path) -> None:
    """The launch command docs/sglang.md and the README show: its extra config, as SGLang parses it, builds the
    backend through SGLang's factory, which then stores and reads pages (in a file store here; the URL shown
    is checked as a store URL)."""
    text = (ROOT / document).read_text(encoding="utf-8")
    block = text.split("test_the_documented_command_line_loads_the_backend -->", 1)[1].split("```")[1]
    extra = json.loads(block.split("--hicache-storage-backend-extra-config '", 1)[1].split("'", 1)[0])
    assert "--hicache-storage-backend dynamic" in block and "--enable-hierarchical-cache" in block
    if extra["store"].startswith("mooncake://"):
        assert parse_mooncake_url(extra["store"]).segment_bytes == 4 << 30
    extra["store"] = f"file://{tmp_path}/kv"
    config = storage_config("unused")
    config.extra_config = extra
    source, target = host_pool(seed=13), host_pool()
    writer, reader = backend(config, source), backend(config, target)
    assert isinstance(writer, KVGroupsHiCacheStorage) and writer.settings.interface_v1
    assert store_with_v1(writer, source, 0, HASHES[:2]) == [True, True]
    assert reader.batch_get_v1(HASHES[:2], host_indices(target, 0, 2)) == [True, True]
    assert torch.equal(target.kv_buffer[:, :, : 2 * PAGE], source.kv_buffer[:, :, : 2 * PAGE])
