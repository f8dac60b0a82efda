"""``python -m tests.integrations.vllm.deepseek_v4_engine STORE``: vLLM 0.32's engine started on a tiny random
DeepSeek-V4 with the connector on the file store ``STORE``, its forward stood in for, one prompt served; as JSON on
the last line, what each side of the connector made of the caches and what the engine holds for the prompt.

The engine is vLLM's own, in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so that its scheduler's connector
can be read; its worker answers through ``collective_rpc``): its config, its KV-cache planner, its model runner's
cache tensors registered with the connector, its scheduler, KV-cache manager, block tables and the slot mapping
it computes for each group, the connector's hooks around the forward.

vLLM's DeepSeek-V4 kernels cannot run on this CPU (AVX-512-BF16 and AMX; Triton's CPU backend for its metadata
kernels), so two things of its model runner are stood in for, and named as such: the attention metadata builders
(Triton kernels; the stand-in forward needs none of their output) and the model's forward and logits. The stand-in
forward writes, for every token of a step, known bytes (a function of the layer, the position and the token) where
vLLM's kernels write them: each token's window row and compressor-state row at its group's slot; a compressed row
(attention's, the indexer's keys) by the token that completes its ``r`` tokens, at row ``slot // r``; an
``fp8_ds_mla`` page as its rows' values, then all their scales. The token it samples is a checksum of what the last
token's attention reads (its window's 128 rows, every compressed row and indexer key before it), so that an engine
reading other bytes answers otherwise.

The report: both sides' fingerprints and the groups the scheduler side planned; the request's output tokens and
the tokens vLLM counted as cached; per layer and block index of the request, a SHA-256 of the block's page.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from tests.integrations.vllm.tiny_vllm_models import save_tokenizer
from tests.support.helpers import fixture

# Every kind of layer at the released head sizes (what the pages depend on), the rest of the model tiny.
TINY = {"num_hidden_layers": 5, "compress_ratios": [0, 0, 4, 128, 4, 0], "hidden_size": 256, "q_lora_rank": 64,
        "o_lora_rank": 64, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "vocab_size": 512, "num_hash_layers": 0, "num_nextn_predict_layers": 0}
PROMPT_TOKENS = 600
VOCAB = TINY["vocab_size"]
WINDOW = 128  # the config's sliding_window: a query reads its own row and the 127 before it


def prompt() -> list[int]:
    return [5 + (index * 37 + 11) % (VOCAB - 10) for index in range(PROMPT_TOKENS)]


def _ratio(layer: str, ratios: list[int]) -> int:
    return max(1, ratios[int(layer.split(".")[2])])


class Layout:
    """Where a layer's kernels put a row: ``rows`` rows per page, each ``data`` bytes of values, then (fp8 pages)
    each row's ``scale`` bytes after all the values; ``ratio`` tokens per row (1: a row per token)."""

    def __init__(self, name: str, pages: torch.Tensor, rows: int, ratios: list[int]) -> None:
        self.pages, self.rows = pages, rows  # pages: [blocks, page bytes] uint8, a view of vLLM's cache
        if name.endswith(".swa_cache"):
            self.data, self.scale, self.ratio = 576, 8, 1
        elif name.endswith(".indexer.k_cache"):
            self.data, self.scale, self.ratio = 128, 4, 4
        elif name.endswith(".attn"):
            self.data, self.scale, self.ratio = 576, 8, _ratio(name, ratios)
        else:  # a compressor's state: float32 rows, one per token
            self.data, self.scale, self.ratio = pages.shape[1] // self.rows, 0, 1
        self.salt = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")

    def known(self, positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The bytes a token's row holds: [tokens, data + scale] uint8."""
        width = torch.arange(self.data + self.scale, dtype=torch.int64)
        value = (self.salt + positions[:, None] * 7919 + tokens[:, None] * 104729 + width[None, :] * 31) % 251
        return value.to(torch.uint8)

    def write(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        block, index = rows // self.rows, rows % self.rows
        offsets = index[:, None] * self.data + torch.arange(self.data)[None, :]
        self.pages[block[:, None], offsets] = values[:, : self.data]
        if self.scale:
            offsets = self.rows * self.data + index[:, None] * self.scale + torch.arange(self.scale)[None, :]
            self.pages[block[:, None], offsets] = values[:, self.data:]

    def read(self, rows: torch.Tensor) -> torch.Tensor:
        block, index = rows // self.rows, rows % self.rows
        offsets = index[:, None] * self.data + torch.arange(self.data)[None, :]
        data = self.pages[block[:, None], offsets]
        if not self.scale:
            return data
        offsets = self.rows * self.data + index[:, None] * self.scale + torch.arange(self.scale)[None, :]
        return torch.cat([data, self.pages[block[:, None], offsets]], dim=1)


class StandIn:
    """The stand-ins, installed on vLLM's model runner (see the module's docstring)."""

    def __init__(self, runner: Any) -> None:
        from vllm.forward_context import get_forward_context

        self.runner, self.context = runner, get_forward_context
        config = runner.vllm_config.model_config.hf_config
        ratios = list(config.compress_ratios)
        self.layouts: dict[str, Layout] = {}
        self.group_of: dict[str, int] = {}
        self.group_blocks: list[int] = []
        for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups):
            self.group_blocks.append(group.kv_cache_spec.block_size)
            for name in group.layer_names:
                self.group_of[name] = gid
        forward_context = runner.vllm_config.compilation_config.static_forward_context
        for name in self.group_of:
            cache = forward_context[name].kv_cache
            cache = cache[0] if isinstance(cache, list) else cache
            blocks = cache.shape[0]
            rows = cache.shape[-2]  # [blocks, (1,) rows, row elements]
            pages = cache.view(torch.uint8).reshape(blocks, -1)
            assert pages.data_ptr() == cache.data_ptr(), name  # a view: writes land in vLLM's cache
            self.layouts[name] = Layout(name, pages, rows, ratios)
        self.block_ids: dict[str, tuple[list[int], ...]] = {}
        runner._build_attention_metadata = self.attention_metadata
        runner._model_forward = self.forward
        runner.model.compute_logits = self.compute_logits

    def attention_metadata(self, *args: Any, **kwargs: Any) -> tuple[dict[str, Any], None]:
        return {}, None  # stand-in: vLLM's DeepSeek-V4 builders run Triton kernels; the stand-in forward reads none

    def forward(self, input_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                **_: Any) -> torch.Tensor:
        assert input_ids is not None and positions is not None
        slot_mapping = self.context().slot_mapping
        assert isinstance(slot_mapping, dict)
        for name, layout in self.layouts.items():
            slots = slot_mapping[name][: input_ids.shape[0]].to(torch.int64)
            writes = slots >= 0
            if layout.ratio > 1:  # a compressed row, by the token completing its window
                writes &= (positions + 1) % layout.ratio == 0
            rows = slots[writes] // layout.ratio
            layout.write(rows, layout.known(positions[writes].to(torch.int64), input_ids[writes].to(torch.int64)))
        hidden = torch.zeros(input_ids.shape[0], 1, dtype=torch.float32)
        runner = self.runner
        starts = runner.query_start_loc.cpu[: runner.input_batch.num_reqs + 1].tolist()
        for index, request in enumerate(runner.input_batch.req_ids):
            self.block_ids[request] = tuple(list(ids) for ids in runner.requests[request].block_ids)
            last = starts[index + 1] - 1
            hidden[last, 0] = float(self.read_checksum(request, int(positions[last])))
        return hidden

    def read_checksum(self, request: str, position: int) -> int:
        """What a query at ``position`` reads (its window's rows, every compressed row and key before it), summed
        with weights: the token the stand-in samples."""
        total = 0
        for name, layout in self.layouts.items():
            if ".compressor." in name:
                continue
            block_ids = torch.tensor(self.block_ids[request][self.group_of[name]], dtype=torch.int64)
            block = self.group_blocks[self.group_of[name]]
            if layout.ratio == 1:  # the window
                read = torch.arange(max(0, position - WINDOW + 1), position + 1)
                rows = block_ids[read // block] * block + read % block
            else:
                per_block = block // layout.ratio
                read = torch.arange((position + 1) // layout.ratio)
                rows = block_ids[read // per_block] * per_block + read % per_block
            values = layout.read(rows).to(torch.int64)
            weights = torch.arange(1, values.numel() + 1, dtype=torch.int64).reshape(values.shape)
            total += int((values * weights).sum())
        return total % VOCAB

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(hidden.shape[0], VOCAB, dtype=torch.float32)
        logits[torch.arange(hidden.shape[0]), hidden[:, 0].to(torch.int64)] = 1.0
        return logits

    def report(self) -> dict[str, dict[str, str]]:
        """Per layer, per block index of the one request served: the SHA-256 of its page."""
        [request] = self.block_ids
        pages: dict[str, dict[str, str]] = {}
        for name, layout in self.layouts.items():
            ids = self.block_ids[request][self.group_of[name]]
            pages[name] = {str(index): hashlib.sha256(layout.pages[block].numpy().tobytes()).hexdigest()
                           for index, block in enumerate(ids) if block > 0}
        return pages


def _install(worker: Any) -> None:
    worker.kvgroups_stand_in = StandIn(worker.model_runner)


def _report(worker: Any) -> dict[str, dict[str, str]]:
    stand_in: StandIn = worker.kvgroups_stand_in
    return stand_in.report()


def _worker_side(worker: Any) -> tuple[str, str]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    side = get_kv_transfer_group()._worker
    return side.expected, side._bound


def main() -> None:
    store = Path(sys.argv[1])
    model = store.parent / "model"
    if not (model / "config.json").exists():
        model.mkdir(parents=True, exist_ok=True)
        config = {**fixture("deepseek-v4-flash"), **TINY}
        for name in ("quantization_config", "expert_dtype"):  # fp8 linears need AMX on vLLM's CPU build
            config.pop(name, None)
        (model / "config.json").write_text(json.dumps(config))
        save_tokenizer(model)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the stand-ins are installed in the worker, this process
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.config import KVTransferConfig

    llm = LLM(model=str(model), load_format="dummy", enforce_eager=True, max_model_len=2048, dtype="bfloat16",
              kv_transfer_config=KVTransferConfig(
                  kv_connector="KVGroupsConnector", kv_connector_module_path="kvgroups.integrations.vllm",
                  kv_role="kv_both", kv_connector_extra_config={"store": f"file://{store}"},
                  kv_load_failure_policy="recompute"))
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector.deployment
    [(worker_fingerprint, bound)] = llm.collective_rpc(_worker_side)
    llm.collective_rpc(_install)
    [output] = llm.generate(TokensPrompt(prompt_token_ids=prompt()), SamplingParams(max_tokens=4, temperature=0,
                                                                                     ignore_eos=True),
                            use_tqdm=False)
    [pages] = llm.collective_rpc(_report)
    print(json.dumps({
        "scheduler_fingerprint": scheduler.metadata(0, scheduler.groups, "worker").fingerprint(),
        "worker_fingerprint": worker_fingerprint, "worker_bound": bound,
        "groups": [{"spec": group.spec.to_dict(), "layers": list(group.layer_names), "shape": list(group.shape)}
                   for group in scheduler.groups],
        "engine_group_blocks": [group.block_size for group in scheduler.engine_groups],
        "chunk_size": scheduler.settings.chunk_size,
        "tokens": list(output.outputs[0].token_ids), "cached": output.num_cached_tokens, "pages": pages}))


if __name__ == "__main__":
    main()
