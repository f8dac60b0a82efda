"""A hybrid (mamba / gated-DeltaNet) through SGLang's v2 pool calls: its KV pool and its recurrent-state pool
(SGLang's own MambaPoolHost, on the CPU) stored side by side, the states only where a node of SGLang's tree
ended; a lookup restores exactly the prefixes whose state was stored, as SGLang's own file backend decides
them, and the states come back byte for byte."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
from sglang.srt.environ import envs
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

from kvgroups.integrations.sglang.prefix_hits import ALL_PAGES, TRAILING_PAGES, PoolPresence, prefix_hits
from tests.integrations.sglang.test_storage import HASHES, backend, host_indices, host_pool, storage_config


def mamba_host_pool(*, seed: int | None = None, ssm_dtype: str = "float32") -> Any:
    """SGLang's recurrent-state host pool for 2 gated-DeltaNet-like layers (conv and SSM states), on the CPU."""
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=4))
    with envs.SGLANG_MAMBA_SSM_DTYPE.override(ssm_dtype):
        shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=32, n_groups=1, num_heads=2, head_dim=16,
                                        state_size=8, conv_kernel=4)
        params = Mamba2CacheParams(shape=shape, layers=[0, 1])
    requests = HybridReqToTokenPool(size=4, mamba_size=8, mamba_spec_state_size=4, max_context_len=64, device="cpu",
                                    enable_memory_saver=False, cache_params=params, mamba_layer_ids=[0, 1],
                                    enable_mamba_extra_buffer=False, speculative_num_draft_tokens=3)
    (info,) = requests.mamba_pool.get_device_pool_infos()
    pool = MambaPoolHost(info.buffer_info, 2, 0, device_capacity=requests.mamba_pool.size, pin_memory=False,
                         layout="page_first")
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        for buffer in (pool.temporal_buffer, *pool.conv_buffer):
            buffer.copy_(torch.randn(buffer.shape, generator=generator))
    return pool


def hybrid_backend(url: str, kv: Any, states: Any, **config: Any) -> Any:
    """The backend as SGLang's hybrid controller attaches it: the anchor pool, then every pool by name."""
    storage = backend(storage_config(url, **config), kv)
    storage.register_mem_host_pool_v2(kv, PoolName.KV)
    storage.register_mem_host_pool_v2(states, PoolName.MAMBA)
    storage.on_host_pools_registered()
    return storage


def state_transfer(slot: int | None, page: int) -> PoolTransfer:
    """The state at the end of page ``page`` (a node of SGLang's tree ended there), in host slot ``slot``."""
    return PoolTransfer(name=PoolName.MAMBA, host_indices=None if slot is None else torch.tensor([slot]),
                        keys=[HASHES[page]], hit_policy=PoolHitPolicy.TRAILING_PAGES)


def test_a_hybrid_prefix_is_restored_only_where_its_state_was_stored(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/kv"
    kv, states = host_pool(seed=21), mamba_host_pool(seed=22)
    writer = hybrid_backend(url, kv, states)
    assert writer.batch_set_v1(HASHES, host_indices(kv, 0, len(HASHES))) == [True] * len(HASHES)
    # Two nodes ended on pages 1 and 3 (prefixes of 2 and 4 pages): their states, from slots 5 and 6.
    assert writer.batch_set_v2([state_transfer(5, 1), state_transfer(6, 3)]) == {"mamba": [True, True]}

    target_kv, target_states = host_pool(), mamba_host_pool()
    reader = hybrid_backend(url, target_kv, target_states)
    result = reader.batch_exists_v2(HASHES, [state_transfer(None, 0)])
    assert (result.kv_hit_pages, result.restorable_prefix_pages) == (4, [2, 4])
    assert result.extra_pool_hit_pages == {"kv": len(HASHES), "mamba": 4}

    assert reader.batch_get_v2([state_transfer(2, 3)]) == {"mamba": [True]}
    assert torch.equal(target_states.get_data_page(2), states.get_data_page(6))
    assert reader.batch_get_v2([state_transfer(3, 2)]) == {"mamba": [False]}  # no node ended on page 2
    assert torch.equal(target_states.get_data_page(3), torch.zeros_like(states.get_data_page(3)))
    assert reader.batch_get_v1(HASHES[:4], host_indices(target_kv, 0, 4)) == [True] * 4
    assert torch.equal(target_kv.kv_buffer[:, :, :16], kv.kv_buffer[:, :, :16])


def test_every_rank_stores_its_own_states_and_reads_no_other_ranks(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/kv"
    kv, states = host_pool(seed=23), mamba_host_pool(seed=24)
    rank0 = hybrid_backend(url, kv, states, tp_size=2)
    assert rank0.batch_set_v1(HASHES[:2], host_indices(kv, 0, 2)) == [True, True]
    assert rank0.batch_set_v2([state_transfer(1, 1)]) == {"mamba": [True]}
    rank1 = hybrid_backend(url, host_pool(), mamba_host_pool(), tp_rank=1, tp_size=2)
    assert rank1.batch_exists_v2(HASHES[:2], [state_transfer(None, 0)]).kv_hit_pages == 0
    assert rank1.batch_get_v2([state_transfer(0, 1)]) == {"mamba": [False]}


def test_bad_transfers_are_failures_not_exceptions(tmp_path: Path) -> None:
    storage = hybrid_backend(f"file://{tmp_path}/kv", host_pool(seed=25), mamba_host_pool(seed=26))
    missing_indices = state_transfer(None, 0)
    assert storage.batch_set_v2([missing_indices]) == {"mamba": [False]}
    assert storage.batch_get_v2([missing_indices]) == {"mamba": [False]}
    unknown = PoolTransfer(name=PoolName.SWA, host_indices=torch.tensor([0]), keys=[HASHES[0]],
                           hit_policy=PoolHitPolicy.TRAILING_PAGES)
    assert storage.batch_get_v2([unknown]) == {"swa": [False]}
    assert storage.batch_exists_v2(HASHES[:1], [unknown]).extra_pool_hit_pages == {}


def test_states_in_float32_beside_bfloat16_conv_states_round_trip(tmp_path: Path) -> None:
    """SGLang keeps the SSM state in float32 by default, the conv state in the model's dtype: each is described
    as a state of its own, and the page holds both."""
    url = f"file://{tmp_path}/kv"
    states = mamba_host_pool(seed=27, ssm_dtype="float32")
    assert states.temporal_buffer.dtype == torch.float32 and states.conv_buffer[0].dtype == torch.bfloat16
    writer = hybrid_backend(url, host_pool(seed=28), states)
    assert writer.batch_set_v2([state_transfer(4, 0)]) == {"mamba": [True]}
    target = mamba_host_pool()
    reader = hybrid_backend(url, host_pool(), target)
    assert reader.batch_get_v2([state_transfer(1, 0)]) == {"mamba": [True]}
    assert torch.equal(target.temporal_buffer[1], states.temporal_buffer[4])
    assert torch.equal(target.conv_buffer[0][1], states.conv_buffer[0][4])
    other_dtype = hybrid_backend(url, host_pool(), mamba_host_pool(ssm_dtype="bfloat16"))
    assert other_dtype.batch_get_v2([state_transfer(1, 0)]) == {"mamba": [False]}  # another page format


def sglangs_own_verdict(tmp_path: Path, kv_present: list[bool], pools: list[PoolPresence]) -> Any:
    """What SGLang's file backend answers for the same presence (its batch_exists_v2 over a directory listing
    that holds exactly those pages)."""
    config = storage_config("unused")
    config.extra_config = {"file_storage_path": str(tmp_path / "hicache-file")}
    reference = HiCacheFile(config)
    names = {f"{reference._get_component_key(key)}.bin" for key, there in zip(HASHES, kv_present, strict=False)
             if there}
    transfers = []
    for pool in pools:
        names |= {f"{reference._get_component_key(key, pool.name)}.bin"
                  for key, there in zip(HASHES, pool.present, strict=False) if there}
        transfers.append(PoolTransfer(name=PoolName(pool.name), keys=HASHES[: pool.trailing_pages],
                                      hit_policy=PoolHitPolicy(pool.policy)))
    reference._collect_existing_component_keys = lambda keys, pool_transfers=None: names
    return reference.batch_exists_v2(HASHES, transfers)


presences = st.lists(st.booleans(), min_size=len(HASHES), max_size=len(HASHES))


@settings(max_examples=60, deadline=None)
@given(kv_present=presences, states_present=presences, dsa_present=presences, trailing=st.integers(1, 3),
       with_dsa=st.booleans())
def test_the_restorable_prefixes_are_sglangs_own(kv_present: list[bool], states_present: list[bool],
                                                 dsa_present: list[bool], trailing: int, with_dsa: bool,
                                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    pools = [PoolPresence("mamba", TRAILING_PAGES, trailing, states_present)]
    if with_dsa:
        pools.append(PoolPresence("indexer", ALL_PAGES, 0, dsa_present))
    ours = prefix_hits(kv_present, pools)
    theirs = sglangs_own_verdict(tmp_path_factory.mktemp("reference"), kv_present, pools)
    assert (ours.pages, ours.per_pool, ours.restorable) == (
        theirs.kv_hit_pages, {str(name): pages for name, pages in theirs.extra_pool_hit_pages.items()},
        theirs.restorable_prefix_pages)
