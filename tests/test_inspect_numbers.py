"""Bytes per token and per sequence of every bundled config, recomputed here from the raw JSON.

The recomputation is deliberately plain and shares no code with the library.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvgroups.cli.report import inspect_model
from kvgroups.dtypes import dtype_from_name
from kvgroups.models.configs import model_spec_from_config
from kvgroups.models.engine import EngineParams
from kvgroups.models.presets import load_model_config, preset_names


def heads_per_rank(heads: int, tp: int) -> int:
    return heads // tp if heads % tp == 0 else 1


def recompute(config: dict[str, Any], tp: int, kv_bytes: int) -> tuple[int, int]:
    """(bytes per token per rank, recurrent-state bytes per sequence per rank)."""
    text = config.get("text_config") or config
    state_bytes = 2  # every hybrid preset is bfloat16 and states keep the model dtype
    layers = text["num_hidden_layers"]
    if "kv_lora_rank" in text:
        return layers * (text["kv_lora_rank"] + text["qk_rope_head_dim"]) * kv_bytes, 0
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    if text["model_type"] == "nemotron-nas":
        total = 0
        for block in text["block_configs"]:
            attention = block["attention"]
            if attention["no_op"] or attention["replace_with_linear"]:
                continue
            kv_heads = text["num_attention_heads"] // attention["n_heads_in_group"]
            total += 2 * heads_per_rank(kv_heads, tp) * head_dim * kv_bytes
        return total, 0
    kv_heads = text.get("num_key_value_heads") or text["num_attention_heads"]
    if text["model_type"] == "nemotron_h":
        pattern = text["hybrid_override_pattern"]
        attention = pattern.count("*") * 2 * heads_per_rank(kv_heads, tp) * text["attention_head_dim"] * kv_bytes
        heads, groups = text["mamba_num_heads"] // tp, text["n_groups"] // tp
        conv = (heads * text["mamba_head_dim"] + 2 * groups * text["ssm_state_size"]) * (text["conv_kernel"] - 1)
        ssm = heads * text["mamba_head_dim"] * text["ssm_state_size"]
        return attention, pattern.count("M") * (conv + ssm) * state_bytes
    if text["model_type"] == "qwen3_next":
        full = layers // text["full_attention_interval"]
        key_heads, value_heads = text["linear_num_key_heads"] // tp, text["linear_num_value_heads"] // tp
        conv = (2 * key_heads * text["linear_key_head_dim"] + value_heads * text["linear_value_head_dim"]) * (
            text["linear_conv_kernel_dim"] - 1
        )
        recurrent = value_heads * text["linear_key_head_dim"] * text["linear_value_head_dim"]
        attention = full * 2 * heads_per_rank(kv_heads, tp) * head_dim * kv_bytes
        return attention, (layers - full) * (conv + recurrent) * state_bytes
    return layers * 2 * heads_per_rank(kv_heads, tp) * head_dim * kv_bytes, 0


def inspect(name: str, tp: int, kv_dtype: str) -> dict[str, Any]:
    spec = model_spec_from_config(load_model_config(name).config)
    params = EngineParams(tp=tp, kv_dtype=dtype_from_name(kv_dtype))
    return inspect_model(spec, name, params).to_dict()


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("tp", [1, 2, 8])
@pytest.mark.parametrize("name", preset_names())
def test_bytes_match_the_independent_recomputation(name: str, tp: int, kv_dtype: str) -> None:
    report = inspect(name, tp, kv_dtype)
    per_token, per_sequence = recompute(load_model_config(name).config, tp, 2 if kv_dtype == "bfloat16" else 1)
    totals = report["totals"]
    assert totals["bytes_per_token_per_rank"] == per_token
    assert totals["bytes_per_token_all_ranks"] == per_token * tp
    assert totals["state_bytes_per_sequence_per_rank"] == per_sequence
    assert sum(group["bytes_per_token"] for group in report["groups"]) == per_token


def test_anchors() -> None:
    assert inspect("llama-3.1-8b", 1, "bfloat16")["totals"]["bytes_per_token_per_rank"] == 32 * 2 * 8 * 128 * 2
    assert inspect("deepseek-v3", 1, "bfloat16")["totals"]["bytes_per_token_per_rank"] == 61 * (512 + 64) * 2
    assert inspect("deepseek-v3", 8, "bfloat16")["totals"]["bytes_per_token_per_rank"] == 70272  # replicated


def test_chunk_shapes_and_bytes_come_from_the_metadata() -> None:
    report = inspect("gpt-oss-20b", 2, "bfloat16")
    assert [group["kind"] for group in report["groups"]] == ["sliding_window", "full_attention"]
    assert [group["chunk_shape"] for group in report["groups"]] == [[2, 12, 256, 256], [2, 12, 256, 256]]
    assert [group["chunk_bytes"] for group in report["groups"]] == [2 * 12 * 256 * 256 * 2] * 2
    assert report["totals"]["bytes_per_chunk_per_rank"] == 2 * 2 * 12 * 256 * 256 * 2
    groups = report["metadata"]["kv_layer_groups_manager"]["groups"]
    assert [group["layer_indices"][:3] for group in groups] == [[0, 2, 4], [1, 3, 5]]


def test_layouts_change_shapes_not_bytes() -> None:
    spec = model_spec_from_config(load_model_config("llama-3.1-8b").config)
    from kvgroups.layouts import KVLayout

    rows = {}
    for layout in (KVLayout.FLASH_ATTN, KVLayout.FLASHINFER, KVLayout.FLASHINFER_HND, KVLayout.KV_SPLIT):
        report = inspect_model(spec, "l", EngineParams(layout=layout, tokens=160)).to_dict()
        rows[layout] = (report["groups"][0]["tensor_shape"], report["totals"]["bytes_per_token_per_rank"])
    assert rows == {
        KVLayout.FLASH_ATTN: ([2, 10, 16, 8, 128], 131072),
        KVLayout.FLASHINFER: ([10, 2, 16, 8, 128], 131072),
        KVLayout.FLASHINFER_HND: ([10, 2, 8, 16, 128], 131072),
        KVLayout.KV_SPLIT: ([10, 16, 8, 128], 131072),
    }
