"""``python -m tests.integrations.vllm.deepseek_v4_engine FOLDER``: vLLM's engine started on a tiny random
DeepSeek-V4 with the connector, and what each side of it made of the caches, as JSON on the last line.

The engine is vLLM's own (in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so that its scheduler's
connector can be read; its worker answers through ``collective_rpc``): its config, its KV-cache planner,
its model runner's cache tensors, registered with the connector. No token is produced (vLLM's DeepSeek-V4
kernels need AVX-512-BF16 and AMX on a CPU).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from tests.integrations.vllm.tiny_vllm_models import save_tokenizer
from tests.support.helpers import fixture

# Every kind of layer at the released head sizes (what the pages depend on), the rest of the model tiny.
TINY = {"num_hidden_layers": 5, "compress_ratios": [0, 0, 4, 128, 4, 0], "hidden_size": 256, "q_lora_rank": 64,
        "o_lora_rank": 64, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "vocab_size": 512, "num_hash_layers": 0, "num_nextn_predict_layers": 0}


def _worker_side(worker: Any) -> tuple[str, str]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    side = get_kv_transfer_group()._worker
    return side.expected, side._bound


def main() -> None:
    folder = Path(sys.argv[1])
    model = folder / "model"
    model.mkdir(parents=True, exist_ok=True)
    config = {**fixture("deepseek-v4-flash"), **TINY}
    for name in ("quantization_config", "expert_dtype"):  # fp8 linears need AMX on vLLM's CPU build
        config.pop(name, None)
    (model / "config.json").write_text(json.dumps(config))
    save_tokenizer(model)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(model=str(model), load_format="dummy", enforce_eager=True, max_model_len=2048, dtype="bfloat16",
              kv_transfer_config=KVTransferConfig(
                  kv_connector="KVGroupsConnector", kv_connector_module_path="kvgroups.integrations.vllm",
                  kv_role="kv_both", kv_connector_extra_config={"store": f"file://{folder}/kv"},
                  kv_load_failure_policy="recompute"))
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector.deployment
    [(worker_fingerprint, bound)] = llm.collective_rpc(_worker_side)
    print(json.dumps({
        "scheduler_fingerprint": scheduler.metadata(0, scheduler.groups, "worker").fingerprint(),
        "worker_fingerprint": worker_fingerprint, "worker_bound": bound,
        "groups": [{"spec": group.spec.to_dict(), "layers": list(group.layer_names), "shape": list(group.shape)}
                   for group in scheduler.groups],
        "engine_group_blocks": [group.block_size for group in scheduler.engine_groups],
        "chunk_size": scheduler.settings.chunk_size,
    }))


if __name__ == "__main__":
    main()
