"""Bytes per token and per sequence of every bundled config and every family's fixture, recomputed
from the raw JSON by :mod:`recompute` (which shares no code with the library)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvgroups import ModelConfigError
from kvgroups.cli.report import inspect_model
from kvgroups.core.dtypes import dtype_from_name
from kvgroups.core.layouts import KVLayout
from kvgroups.models.configs import model_spec_from_config
from kvgroups.models.engine import EngineParams
from kvgroups.models.presets import load_model_config
from tests.support.helpers import every_config
from tests.support.recompute import NoSplitError, recompute, tokens_per_image

CONFIGS = every_config()


def inspect(config: dict[str, Any], tp: int, kv_dtype: str, **params: Any) -> dict[str, Any]:
    spec = model_spec_from_config(config)
    return inspect_model(spec, "m", EngineParams(tp=tp, kv_dtype=dtype_from_name(kv_dtype), **params)).to_dict()


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("tp", [1, 2, 8])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_bytes_match_the_independent_recomputation(name: str, tp: int, kv_dtype: str) -> None:
    config = CONFIGS[name]
    try:
        per_token, per_sequence = recompute(config, tp, 2 if kv_dtype == "bfloat16" else 1)
    except NoSplitError:
        with pytest.raises(ModelConfigError, match=f"over --tp {tp}"):
            inspect(config, tp, kv_dtype)
        return
    report = inspect(config, tp, kv_dtype)
    totals = report["totals"]
    assert totals["bytes_per_token_per_rank"] == per_token
    assert totals["bytes_per_token_all_ranks"] == per_token * tp
    assert totals["state_bytes_per_sequence_per_rank"] == per_sequence
    assert sum(group["bytes_per_token"] for group in report["groups"]) == per_token
    assert sum(group["bytes_per_sequence"] for group in report["groups"]) == per_sequence


def test_anchors() -> None:
    def per_token(name: str, tp: int = 1) -> int:
        return int(inspect(CONFIGS[name], tp, "bfloat16")["totals"]["bytes_per_token_per_rank"])

    def per_sequence(name: str, tp: int = 1) -> int:
        return int(inspect(CONFIGS[name], tp, "bfloat16")["totals"]["state_bytes_per_sequence_per_rank"])

    assert per_token("llama-3.1-8b") == 32 * 2 * 8 * 128 * 2
    assert per_token("deepseek-v3") == 61 * (512 + 64) * 2
    assert per_token("deepseek-v3", 8) == 70272  # replicated
    # Measured by hand from the configs and vLLM's formulas (the numbers a serving engine reserves).
    assert (per_token("jamba-1.5-mini"), per_sequence("jamba-1.5-mini")) == (16384, 8716288)
    assert (per_token("falcon-mamba-7b"), per_sequence("falcon-mamba-7b")) == (0, 19922944)
    assert (per_token("qwen3.5-35b-a3b"), per_sequence("qwen3.5-35b-a3b")) == (20480, 64389120)
    assert per_token("gemma-4-26b-a4b") == 5 * 2 * 2 * 512 * 2 + 25 * 2 * 8 * 256 * 2
    assert per_token("deepseek-v3.2") == 61 * (1152 + 132) == 78324
    assert per_token("glm-5-fp8") == 78 * (1152 + 132) == 100152
    assert (per_token("nemotron-3-nano-30b-a3b"), per_sequence("nemotron-3-nano-30b-a3b")) == (6144, 49082368)
    assert (per_token("minimax-m1"), per_sequence("minimax-m1")) == (40960, 146800640)
    assert (per_token("fixture:zamba2-7b"), per_sequence("fixture:zamba2-7b")) == (372736, 77925888)
    assert (per_token("fixture:falcon-h1-7b"), per_sequence("fixture:falcon-h1-7b")) == (45056, 70152192)
    assert (per_token("fixture:granite-4.0-h-tiny", 2)) == 4096  # 4 kv heads: 2 per rank
    assert per_sequence("fixture:granite-4.0-h-tiny", 2) == 36 * ((3 * 1792 + 24 * 64 * 128) * 2)  # groups replicated
    assert (per_token("fixture:lfm2-1.2b"), per_sequence("fixture:lfm2-1.2b")) == (12288, 81920)


def test_mixed_state_dtypes_are_separate_groups() -> None:
    report = inspect(CONFIGS["nemotron-3-nano-30b-a3b"], 1, "bfloat16")
    states = [(group["holds"], group["dtype"], group["spec"]["state_shapes"]) for group in report["groups"]
              if group["kind"] == "recurrent"]
    assert states == [("mamba2 conv", "bfloat16", [[4096 + 2 * 8 * 128, 3]]),
                      ("mamba2 ssm", "float32", [[64, 64, 128]])]
    assert report["engine"]["ssm_state_dtype"] == "float32" and report["engine"]["conv_state_dtype"] == "bfloat16"
    # One dtype for both: one cache (and one group) per layer again.
    both = inspect(CONFIGS["nemotron-3-nano-30b-a3b"], 1, "bfloat16", ssm_state_dtype=dtype_from_name("bfloat16"))
    assert [group["holds"] for group in both["groups"]] == ["mamba2 conv+ssm", "attention k/v"]
    assert both["totals"]["state_bytes_per_sequence_per_rank"] == 23 * (6144 * 3 + 64 * 64 * 128) * 2


def test_state_dtype_options() -> None:
    config = CONFIGS["qwen3.5-27b"]

    def states(**options: str) -> list[tuple[str, str]]:
        params = {key: dtype_from_name(value) for key, value in options.items()}
        report = inspect(config, 1, "bfloat16", **params)
        return [(group["holds"], group["dtype"]) for group in report["groups"] if group["kind"] == "recurrent"]

    assert states() == [("deltanet conv", "bfloat16"), ("deltanet state", "float32")]  # mamba_ssm_dtype
    assert states(state_dtype="float16") == [("deltanet conv", "float16"), ("deltanet state", "float32")]
    assert states(ssm_state_dtype="bfloat16") == [("deltanet conv+state", "bfloat16")]
    assert states(conv_state_dtype="float32") == [("deltanet conv+state", "float32")]
    # A lightning state follows --state-dtype only, as vLLM keeps it in its mamba cache dtype.
    minimax = inspect(CONFIGS["minimax-m1"], 1, "bfloat16", ssm_state_dtype=dtype_from_name("float32"))
    assert [group["dtype"] for group in minimax["groups"]] == ["bfloat16", "bfloat16"]


def test_cross_attention_is_a_cost_per_image() -> None:
    config = CONFIGS["llama-3.2-11b-vision"]
    tokens = tokens_per_image(config)
    assert tokens == 4 * (40 * 40 + 1)
    for tp in (1, 2, 8):
        report = inspect(config, tp, "bfloat16", images=3, tokens=4096)
        cross = report["cross_attention"]
        per_image = 8 * tokens * 2 * (8 // tp) * 128 * 2
        assert (cross["tokens_per_image"], cross["bytes_per_image"], cross["images"]) == (tokens, per_image, 3)
        assert cross["model_layers"] == [3, 8, 13, 18, 23, 28, 33, 38]
        text = 32 * 2 * (8 // tp) * 128 * 2
        assert report["totals"]["bytes_per_token_per_rank"] == text  # not counted per text token
        assert report["capacity"]["tokens"]["bytes_per_rank"] == 4096 * text + 3 * per_image
    chosen = inspect(config, 1, "bfloat16", images=1, image_tokens=1601)["cross_attention"]
    assert chosen["bytes_per_image"] == 8 * 1601 * 4096


def test_indexer_keys_are_their_own_group_in_any_kv_dtype() -> None:
    for kv_dtype, latent in (("bfloat16", 1152), ("float8_e4m3fn", 576)):
        groups = inspect(CONFIGS["deepseek-v3.2"], 8, kv_dtype)["groups"]
        assert [(g["holds"], g["dtype"], g["bytes_per_token"]) for g in groups] == [
            ("mla latent", "bfloat16" if latent == 1152 else "float8_e4m3fn", 61 * latent),
            ("indexer keys", "uint8", 61 * 132),
        ]


def test_chunk_shapes_and_bytes_come_from_the_metadata() -> None:
    report = inspect(CONFIGS["gpt-oss-20b"], 2, "bfloat16")
    assert [group["kind"] for group in report["groups"]] == ["sliding_window", "full_attention"]
    assert [group["chunk_shape"] for group in report["groups"]] == [[2, 12, 256, 256], [2, 12, 256, 256]]
    assert [group["chunk_bytes"] for group in report["groups"]] == [2 * 12 * 256 * 256 * 2] * 2
    assert report["totals"]["bytes_per_chunk_per_rank"] == 2 * 2 * 12 * 256 * 256 * 2
    groups = report["metadata"]["kv_layer_groups_manager"]["groups"]
    assert [group["layer_indices"][:3] for group in groups] == [[0, 2, 4], [1, 3, 5]]


def test_layouts_change_shapes_not_bytes() -> None:
    spec = model_spec_from_config(load_model_config("llama-3.1-8b").config)
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


def test_anchors_of_the_families_the_sweep_verified() -> None:
    """Real published configs of families verified against transformers' caches (tests/models/test_model_type_sweep.py),
    worked out by hand from vLLM's formulas: 2 * kv heads * head size * 2 bytes per attention layer, the MLA
    latent (kv_lora_rank + qk_rope_head_dim) * 2, and a KDA layer's (kernel - 1) * 3 * heads * head_dim * 2
    conv state plus its float32 (heads, head_dim, head_dim) recurrent state."""
    def numbers(name: str, tp: int = 1) -> tuple[int, int]:
        totals = inspect(CONFIGS[name], tp, "bfloat16")["totals"]
        return int(totals["bytes_per_token_per_rank"]), int(totals["state_bytes_per_sequence_per_rank"])

    assert numbers("fixture:glm-4.7-fp8") == (92 * 2 * 8 * 128 * 2, 0)
    assert numbers("fixture:glm-4.7-flash") == (47 * (512 + 64) * 2, 0)
    assert numbers("fixture:minicpm3-4b") == (62 * (256 + 32) * 2, 0)
    assert numbers("fixture:laguna-xs.2-fp8") == (40 * 2 * 8 * 128 * 2, 0)  # 30 of them slide over 512
    assert numbers("fixture:dbrx-132b", 4) == (48 * 2 * 3 * (6144 // 48) * 2, 0)  # attn_config.kv_n_heads 12
    assert numbers("fixture:exaone-7.8b") == (32 * 2 * 8 * 128 * 2, 0)  # num_layers
    assert numbers("fixture:exaone-4.0-32b") == (64 * 2 * 8 * 128 * 2, 0)
    assert numbers("fixture:minimax-m2") == (62 * 2 * 8 * 128 * 2, 0)
    assert numbers("fixture:seed-oss-36b") == (64 * 2 * 8 * 128 * 2, 0)
    assert numbers("fixture:kimi-linear-48b-a3b") == (7 * 576 * 2, 20 * (3 * 3 * 32 * 128 * 2 + 32 * 128 * 128 * 4))
    assert numbers("fixture:kimi-k3", 8) == (24 * 576 * 2, 69 * (3 * 3 * 12 * 128 * 2 + 12 * 128 * 128 * 4))
    # 15 layers keep a cache (the last 20 share): every 6th is full (512 wide), the others slide (256).
    assert numbers("fixture:gemma-4-e2b") == (13 * 2 * 1 * 256 * 2 + 2 * 2 * 1 * 512 * 2, 0)
    groups = inspect(CONFIGS["fixture:exaone-4.0-32b"], 1, "bfloat16")["groups"]
    assert [(group["kind"], group["num_layers"]) for group in groups] == [("sliding_window", 48),
                                                                          ("full_attention", 16)]


def test_mimo_v2_flash_is_planned_as_vllm_stores_it_and_padded_only_where_a_layout_pads() -> None:
    """MiMo-V2-Flash's published config: keys of 192 dims, values of 128. vLLM's pages hold
    ``head_size + head_size_v`` per token and head: 9 full layers x 4 heads x 320 x 2 B and 39 sliding
    layers x 8 heads x 320 x 2 B; a layout of one head size pads the values to 192."""
    spec = model_spec_from_config(load_model_config("mimo-v2-flash").config)
    report = inspect_model(spec, "mimo", EngineParams()).to_dict()
    assert report["engine"]["layout"] == "vllm" and report["warnings"] == []
    rows = [(group["kind"], group["num_layers"], group["num_kv_heads"], group["head_size"], group["value_head_size"],
             group["values_padded_from"], group["bytes_per_token"], group["chunk_shape"]) for group in report["groups"]]
    assert rows == [("full_attention", 9, 4, 192, 128, None, 23_040, [1, 9, 256, 4 * 320]),
                    ("sliding_window", 39, 8, 192, 128, None, 199_680, [1, 39, 256, 8 * 320])]
    assert report["groups"][0]["tensor_shape"] == [16, 4, 16, 320]
    assert report["totals"]["bytes_per_token_per_rank"] == 23_040 + 199_680

    padded = inspect_model(spec, "mimo", EngineParams(layout=KVLayout.FLASH_ATTN)).to_dict()
    assert [(group["head_size"], group["value_head_size"], group["values_padded_from"], group["bytes_per_token"])
            for group in padded["groups"]] == [(192, 192, 128, 27_648), (192, 192, 128, 239_616)]
    assert padded["warnings"] == [
        "layout flash_attn holds keys and values in one head size: the values of layers 0-47 (128 dims) are counted "
        "padded to the keys' size; vLLM stores them unpadded (--layout vllm, the default for this model)"]

    pairs = inspect_model(spec, "mimo", EngineParams(layout=KVLayout.KV_SPLIT_HND, tp=4)).to_dict()
    assert [(group["tensor_shape"], group["bytes_per_token"]) for group in pairs["groups"]] == [
        ([16, 1, 16, 192], 9 * 1 * 320 * 2), ([16, 2, 16, 192], 39 * 2 * 320 * 2)]
    assert pairs["metadata"]["kv_layer_groups_manager"]["groups"][0]["value_head_size"] == 128


def test_readers_of_this_season_plan_their_config_classes_defaults() -> None:
    """dots3, Inkling and Kolibri 1.1 (verified against transformers' caches by the sweep, at two tiny sizes) on
    their config classes' own defaults, worked out by hand."""
    from transformers import AutoConfig

    def report(model_type: str) -> dict[str, Any]:
        config = json.loads(AutoConfig.for_model(model_type).to_json_string())
        return inspect({**config, "torch_dtype": "bfloat16"}, 1, "bfloat16")

    def kinds(found: dict[str, Any]) -> list[tuple[str, int, str, int, int]]:
        return [(group["kind"], group["num_layers"], group["layout"], group["bytes_per_token"],
                 group["bytes_per_sequence"]) for group in found["groups"]]

    # dots3: 13 indexed layers (0, 1, 5, 9, ..., 45) keep a latent of 512 + 64 and indexer keys of 128 + 4 bytes;
    # the 33 others slide over 512 tokens with latents of their own (1024 + 64), one row a token as MLA keeps it.
    assert kinds(report("dots3_note_text")) == [("mla", 13, "mla", 13 * 576 * 2, 0), ("mla", 13, "mla", 13 * 132, 0),
                                                ("sliding_window", 33, "mla", 33 * 1088 * 2, 0)]
    # Inkling: 55 sliding layers (16 K/V heads of 128) and 11 full ones (8 of 128), each with four float32 conv
    # states of (channels, 3): over its K and V projections and over the hidden size (6144) twice.
    assert kinds(report("inkling_text")) == [
        ("sliding_window", 55, "flash_attn", 55 * 2 * 16 * 128 * 2, 0),
        ("recurrent", 55, "recurrent", 0, 55 * (2 * 2048 + 2 * 6144) * 3 * 4),
        ("full_attention", 11, "flash_attn", 11 * 2 * 8 * 128 * 2, 0),
        ("recurrent", 11, "recurrent", 0, 11 * (2 * 1024 + 2 * 6144) * 3 * 4)]
    # Kolibri 1.1: 40 sliding layers; of the 10 indexed ones (every 5th) 4 keep their K/V (4, 19, 24, 29) and
    # 6 read another's (its default kv_source_layers).
    found = report("kolibri1_1")
    assert kinds(found) == [("sliding_window", 40, "flash_attn", 40 * 2 * 4 * 128 * 2, 0),
                            ("full_attention", 4, "flash_attn", 4 * 2 * 4 * 128 * 2, 0)]
    assert found["groups"][1]["model_layers"] == [4, 19, 24, 29]
