"""One tensor-parallel rank of a two-rank SGLang server, as a process of its own (test_controller.py starts
two): SGLang's radix cache, HybridCacheController and storage threads on kvgroups, with a gloo group of both
ranks as the cache's tensor-parallel group, so that SGLang's controller agrees on hits across ranks (the
all-reduce of each prefetch's progress) as a real server's does.

The rank computes a prompt's K/V shard (its own random heads), stores it through ``write_store``, then a
fresh cache of the same rank prefetches the prompt from ``read_store``: what it stored, what it read and
how many tokens it hit go to ``out``.

Usage: python -m tests.integrations.sglang.tp_rank RANK INIT_FILE WRITE_STORE READ_STORE OUT
"""

from __future__ import annotations

import json
import sys

from tests.integrations.sglang import torchvision_stand_in

torchvision_stand_in.install()

import sglang.test.kits.unified_radix_cache.fixtures as kit  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

from tests.integrations.sglang import gpu_stand_ins  # noqa: E402
from tests.integrations.sglang.test_controller import PROMPT, close, computed_and_stored, hicache, prefetched  # noqa: E402


def main(rank: int, init_file: str, write_store: str, read_store: str, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    gpu_stand_ins.install()
    kit.get_device = lambda: "cpu"
    group = torch.distributed.group.WORLD
    with get_parallel().override(tp_rank=rank, tp_size=2, attn_tp_rank=rank, attn_tp_size=2, moe_tp_size=2, pp_rank=0,
                                 pp_size=1):
        producer = hicache(write_store, interface_v1=True, tp_group=group)
        stored, _ = computed_and_stored(producer, PROMPT, seed=rank)
        close(producer)
        consumer = hicache(read_store, interface_v1=True, tp_group=group)
        hit, rows = prefetched(consumer, PROMPT)
        close(consumer)
    tensors = {"stored": stored.contiguous()} | ({"read": rows.contiguous()} if rows is not None else {})
    save_file(tensors, out, metadata={"hit": json.dumps(hit)})
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), *sys.argv[2:6])
