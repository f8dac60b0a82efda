"""Per-layer specs read from real configs and the families' documented defaults."""

from __future__ import annotations

import copy
import logging
from collections import Counter
from typing import Any

import pytest

from kvgroups import ChunkedLocal, FullAttention, ModelConfigError, SlidingWindow
from kvgroups.models.configs import model_spec_from_config, supported_model_types
from kvgroups.models.layers import (
    AttentionLayer,
    CrossAttentionLayer,
    IndexedMLALayer,
    MLALayer,
    NoCacheLayer,
    ParallelLayer,
)
from kvgroups.models.presets import load_model_config, preset_names
from kvgroups.models.state_layers import GatedDeltaNetLayer, LightningAttentionLayer, Mamba1Layer, Mamba2Layer
from tests.support.helpers import falcon_h1_small, fixture
from tests.support.paths import ROOT


def preset(name: str) -> dict[str, Any]:
    return copy.deepcopy(load_model_config(name).config)


def kinds(config: dict[str, Any]) -> list[str]:
    result = []
    for layer in model_spec_from_config(config).layers:
        if isinstance(layer, AttentionLayer):
            spec = layer.spec
            if isinstance(spec, SlidingWindow):
                result.append(f"sliding{spec.window_tokens}")
            elif isinstance(spec, ChunkedLocal):
                result.append(f"chunked{spec.chunk_tokens}")
            else:
                result.append("full")
        else:
            result.append(type(layer).__name__)
    return result


def test_every_preset_is_a_file_copied_from_shared_configs() -> None:
    assert len(preset_names()) == 30
    assert {"llama-3.1-8b", "jamba-1.5-mini", "llama-3.2-11b-vision", "deepseek-v3.2"} <= set(preset_names())
    sources = (ROOT / "src/kvgroups/models/presets/SOURCES.tsv").read_text().splitlines()
    assert sorted(line.split("\t")[0] for line in sources[1:]) == preset_names()


def test_llama_is_full_attention_with_derived_head_dim() -> None:
    spec = model_spec_from_config(preset("llama-3.1-8b"))
    assert spec.layers == (AttentionLayer(spec=FullAttention(), num_kv_heads=8, head_size=128),) * 32
    assert spec.torch_dtype == "bfloat16" and spec.max_position_embeddings == 131072


def test_qwen3_explicit_head_dim_wins_over_hidden_over_heads() -> None:
    layer = model_spec_from_config(preset("qwen3-32b")).layers[0]
    assert layer == AttentionLayer(spec=FullAttention(), num_kv_heads=8, head_size=128)  # not 5120/64 = 80


def test_sliding_window_rules() -> None:
    assert set(kinds(preset("mistral-7b-v0.1"))) == {"sliding4096"}
    assert set(kinds(preset("phi-3-mini-128k-instruct"))) == {"full"}  # 262144 >= max positions
    assert set(kinds(preset("qwen2.5-7b-instruct"))) == {"full"}  # use_sliding_window: false
    assert set(kinds(preset("mixtral-8x7b-v0.1"))) == {"full"}  # sliding_window: null
    qwen = preset("qwen2.5-7b-instruct")
    qwen.update(use_sliding_window=True, sliding_window=4096, max_window_layers=20)
    assert kinds(qwen) == ["full"] * 20 + ["sliding4096"] * 8


def test_gemma2_even_layers_slide() -> None:
    assert kinds(preset("gemma-2-9b")) == ["sliding4096", "full"] * 21


def test_gemma3_nested_text_config_and_default_pattern() -> None:
    result = kinds(preset("gemma-3-27b-it"))
    assert len(result) == 62
    assert [i for i, kind in enumerate(result) if kind == "full"] == list(range(5, 62, 6))
    assert set(result) == {"full", "sliding1024"}
    config = preset("gemma-3-27b-it")
    config["text_config"]["sliding_window_pattern"] = 2
    assert kinds(config)[:4] == ["sliding1024", "full", "sliding1024", "full"]


def test_gpt_oss_layer_types() -> None:
    assert kinds(preset("gpt-oss-20b")) == ["sliding128", "full"] * 12


def test_deepseek_mla() -> None:
    spec = model_spec_from_config(preset("deepseek-v3"))
    assert spec.layers == (MLALayer(kv_lora_rank=512, qk_rope_head_dim=64),) * 61
    assert spec.layers[0].rank_caches(8, 0)[0].replicated
    custom = {"model_type": "my_mla", "num_hidden_layers": 2, "kv_lora_rank": 256, "qk_rope_head_dim": 32,
              "torch_dtype": "bfloat16"}
    with pytest.raises(ModelConfigError, match="'my_mla' is not supported"):
        model_spec_from_config(custom)
    assumed = model_spec_from_config(custom, assume="deepseek_v3")
    assert assumed.layers == (MLALayer(kv_lora_rank=256, qk_rope_head_dim=32),) * 2
    assert assumed.warnings == ("model_type 'my_mla' is not supported; read as deepseek_v3 (--assume deepseek_v3), "
                                "a guess",)


def test_qwen3_next_hybrid() -> None:
    spec = model_spec_from_config(preset("qwen3-next-80b-a3b-thinking"))
    full = [i for i, layer in enumerate(spec.layers) if isinstance(layer, AttentionLayer)]
    assert full == list(range(3, 48, 4))
    assert spec.layers[3] == AttentionLayer(spec=FullAttention(), num_kv_heads=2, head_size=256)
    linear = spec.layers[0]
    assert linear == GatedDeltaNetLayer(num_key_heads=16, key_head_dim=128, num_value_heads=32,
                                        value_head_dim=128, conv_kernel=4)
    shapes = [cache.spec.state_shapes for cache in linear.rank_caches(1, 0)]
    assert shapes == [((2 * 16 * 128 + 32 * 128, 3),), ((32, 128, 128),)]


def test_nemotron_h_pattern() -> None:
    spec = model_spec_from_config(preset("nemotron-h-56b-base-8k"))
    counts = Counter(type(layer).__name__ for layer in spec.layers)
    assert counts == {"Mamba2Layer": 54, "NoCacheLayer": 54, "AttentionLayer": 10}
    mamba = spec.layers[0]
    assert mamba == Mamba2Layer(num_heads=256, head_dim=64, n_groups=8, state_size=256, conv_kernel=4)
    assert [cache.spec.state_shapes for cache in mamba.rank_caches(8, 0)] == [
        (((256 * 64 + 2 * 8 * 256) // 8, 3),), ((32, 64, 256),)
    ]
    assert model_spec_from_config(preset("nemotron-h-56b-base-8k")).ssm_state_dtype == "float32"  # as vLLM
    assert isinstance(spec.layers[1], NoCacheLayer)


def test_nemotron_nas_block_configs() -> None:
    spec = model_spec_from_config(preset("llama-3.3-nemotron-super-49b-v1"))
    attention = [layer for layer in spec.layers if isinstance(layer, AttentionLayer)]
    assert len(attention) == 49 and len(spec.layers) == 80
    assert set(attention) == {AttentionLayer(spec=FullAttention(), num_kv_heads=8, head_size=128)}
    config = preset("llama-3.3-nemotron-super-49b-v1")
    config["block_configs"][0]["attention"].update(no_op=False, replace_with_linear=True)
    assert isinstance(model_spec_from_config(config).layers[0], NoCacheLayer)


def test_llama4_chunked_except_nope_layers() -> None:
    result = kinds(preset("llama-4-scout-17b-16e-instruct"))
    assert [i for i, kind in enumerate(result) if kind == "full"] == list(range(3, 48, 4))
    assert result.count("chunked8192") == 36
    config = preset("llama-4-scout-17b-16e-instruct")
    config["text_config"]["no_rope_layers"] = [1, 0] * 24
    assert kinds(config)[:2] == ["chunked8192", "full"]


def test_unknown_model_type_is_refused_unless_assumed(caplog: pytest.LogCaptureFixture) -> None:
    config = {"model_type": "brand_new", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256,
              "num_key_value_heads": 2, "torch_dtype": "float16"}
    with pytest.raises(ModelConfigError, match=r"^model_type 'brand_new' is not supported; supported: .*llama.*"
                                               r"--assume MODEL_TYPE"):
        model_spec_from_config(config)
    with caplog.at_level(logging.WARNING, logger="kvgroups"):
        spec = model_spec_from_config(config, assume="llama")
    assert spec.layers == (AttentionLayer(spec=FullAttention(), num_kv_heads=2, head_size=64),) * 2
    assert spec.warnings == ("model_type 'brand_new' is not supported; read as llama (--assume llama), a guess",)
    assert "brand_new" in caplog.text
    with pytest.raises(ModelConfigError, match="--assume 'nope' is not a supported model_type"):
        model_spec_from_config(config, assume="nope")
    known = model_spec_from_config(preset("llama-3.1-8b"), assume="gemma2")
    assert known.warnings == ("--assume gemma2 ignored: model_type 'llama' is supported",)
    assert {"llama", "gemma3", "qwen3_next", "nemotron_h", "nemotron-nas", "llama4", "jamba", "falcon_h1", "bamba",
            "granitemoehybrid", "zamba2", "lfm2", "mamba", "falcon_mamba", "mamba2", "qwen3_5", "qwen3_5_moe",
            "qwen3_5_text", "qwen3_5_moe_text", "gemma4", "gemma4_text", "mllama", "mllama_text_model",
            "deepseek_v32", "glm_moe_dsa", "minimax", "minimax_m1", "mimo_v2_flash"} <= set(supported_model_types())


def _drop_hidden_size(config: dict[str, Any]) -> None:
    del config["hidden_size"]


@pytest.mark.parametrize(
    ("name", "edit", "pattern"),
    [
        ("llama-3.1-8b", _drop_hidden_size, r"lacks fields \['hidden_size'\]"),
        ("llama-3.1-8b", lambda c: c.update(num_key_value_heads="8"),
         r"'num_key_value_heads' must be an int >= 1, got '8'"),
        ("gpt-oss-20b", lambda c: c.update(layer_types=c["layer_types"][:-1]),
         r"layer_types has 23 entries but num_hidden_layers is 24"),
        ("nemotron-h-56b-base-8k", lambda c: c.update(hybrid_override_pattern="M*X"), r"position 2: 'X'"),
    ],
)
def test_missing_and_bad_fields(name: str, edit: Any, pattern: str) -> None:
    config = preset(name)
    edit(config)
    with pytest.raises(ModelConfigError, match=pattern):
        model_spec_from_config(config)


def test_infinity_literal_in_a_real_config_parses() -> None:
    config = load_model_config("nemotron-h-56b-base-8k").config
    assert config["time_step_limit"] == [0.0, float("inf")]


def test_jamba_attention_every_period_from_offset() -> None:
    spec = model_spec_from_config(preset("jamba-1.5-mini"))
    assert [i for i, layer in enumerate(spec.layers) if isinstance(layer, AttentionLayer)] == [4, 12, 20, 28]
    assert spec.layers[0] == Mamba1Layer(intermediate_size=2 * 4096, state_size=16, conv_kernel=4)
    config = preset("jamba-1.5-mini")
    config.update(attn_layer_period=2, attn_layer_offset=1)
    assert kinds(config)[:4] == ["Mamba1Layer", "full", "Mamba1Layer", "full"]
    config.update(attn_layer_offset=2)
    with pytest.raises(ModelConfigError, match="attn_layer_offset=2 must be smaller than attn_layer_period=2"):
        model_spec_from_config(config)


def test_falcon_h1_attention_and_mamba2_in_every_layer() -> None:
    spec = model_spec_from_config(fixture("falcon-h1-7b"))
    assert spec.layers == (ParallelLayer(mixers=(
        AttentionLayer(spec=FullAttention(), num_kv_heads=2, head_size=128),
        Mamba2Layer(num_heads=24, head_dim=128, n_groups=1, state_size=256, conv_kernel=4),
    )),) * 44
    with pytest.raises(ModelConfigError, match=r"24 \* 64 = 1536 differs from mamba_d_ssm \(default\)=1024"):
        model_spec_from_config(fixture("falcon-h1-0.5b"))  # the transcription lacks mamba_d_ssm
    assert len(model_spec_from_config(falcon_h1_small()).layers) == 36
    with pytest.raises(ModelConfigError, match="attn_layer_indices is not read"):
        model_spec_from_config({**falcon_h1_small(), "attn_layer_indices": [1, 2]})


def test_zamba2_shared_attention_keeps_a_cache_per_position() -> None:
    config = fixture("zamba2-7b")
    spec = model_spec_from_config(config)
    hybrid = [i for i, layer in enumerate(spec.layers) if isinstance(layer, ParallelLayer)]
    assert hybrid == [6, 11, 17, 23, 29, 35, 41, 47, 53, 59, 65, 71, 77]  # num_mem_blocks 2 does not matter
    assert spec.layers[6] == ParallelLayer(mixers=(
        AttentionLayer(spec=FullAttention(), num_kv_heads=32, head_size=2 * 3584 // 32),
        Mamba2Layer(num_heads=112, head_dim=64, n_groups=2, state_size=64, conv_kernel=4),
    ))
    del config["n_mamba_heads"]  # as the dict was transcribed: transformers' default 8 heads contradicts headdim 64
    with pytest.raises(ModelConfigError, match=r"mamba_headdim=64 disagrees .* 7168 / 8 = 896"):
        model_spec_from_config(config)


def test_granite_hybrid_layer_types_and_its_all_mamba_default() -> None:
    result = kinds(fixture("granite-4.0-h-tiny"))
    assert [i for i, kind in enumerate(result) if kind == "full"] == [5, 15, 25, 35]
    config = fixture("granite-4.0-h-tiny")
    del config["layer_types"]
    assert set(kinds(config)) == {"Mamba2Layer"}  # transformers' GraniteMoeHybridConfig default


def test_bamba_attention_indices() -> None:
    result = kinds(fixture("bamba-9b-fragment"))
    assert [i for i, kind in enumerate(result) if kind == "full"] == [9, 18, 27]
    with pytest.raises(ModelConfigError, match=r"attn_layer_indices lists layers \[40\]"):
        model_spec_from_config({**fixture("bamba-9b-fragment"), "attn_layer_indices": [9, 40]})


def test_lfm2_layer_types_or_full_attn_idxs() -> None:
    assert [i for i, kind in enumerate(kinds(fixture("lfm2-1.2b"))) if kind == "full"] == [2, 5, 8, 10, 12, 14]
    assert [i for i, kind in enumerate(kinds(fixture("lfm2-2.6b"))) if kind == "full"] == [2, 5, 9, 13, 17, 21, 24, 27]


def test_minimax_attn_type_list() -> None:
    spec = model_spec_from_config(preset("minimax-m1"))
    assert [i for i, layer in enumerate(spec.layers) if isinstance(layer, AttentionLayer)] == list(range(7, 80, 8))
    assert spec.layers[0] == LightningAttentionLayer(num_heads=64, head_dim=128)
    config = preset("minimax-m1")
    config["layer_types"] = ["full_attention"] * 80
    with pytest.raises(ModelConfigError, match="layer_types and attn_type_list disagree"):
        model_spec_from_config(config)


def test_gemma4_global_layers_and_kv_sharing() -> None:
    spec = model_spec_from_config(preset("gemma-4-26b-a4b"))
    assert set(spec.layers[5::6]) == {AttentionLayer(spec=FullAttention(), num_kv_heads=2, head_size=512)}
    assert spec.layers[0] == AttentionLayer(spec=SlidingWindow(window_tokens=1024), num_kv_heads=8, head_size=256)
    trimmed = model_spec_from_config(fixture("gemma-4-31b"))  # no k_eq_v: kv heads as the sliding layers
    assert trimmed.layers[5] == AttentionLayer(spec=FullAttention(), num_kv_heads=16, head_size=512)
    config = preset("gemma-4-26b-a4b")
    config["text_config"]["num_kv_shared_layers"] = 10
    shared = model_spec_from_config(config).layers
    assert shared[20:] == (NoCacheLayer(reason="shares an earlier layer's KV"),) * 10 and shared[19] != shared[20]
    config["text_config"]["layer_types"][-1] = "sliding_attention"
    forced = model_spec_from_config(config)
    assert "the last layer is read as full_attention" in forced.warnings[0]


def test_mimo_hybrid_layer_pattern_and_swa_fields() -> None:
    spec = model_spec_from_config(fixture("mimo-v2-flash"))
    full = [i for i, layer in enumerate(spec.layers) if isinstance(layer, AttentionLayer)
            and isinstance(layer.spec, FullAttention)]
    assert full == [0, 5, 11, 17, 23, 29, 35, 41, 47]
    assert spec.layers[0] == AttentionLayer(spec=FullAttention(), num_kv_heads=4, head_size=192, value_head_size=128)
    assert spec.layers[1] == AttentionLayer(spec=SlidingWindow(window_tokens=128), num_kv_heads=8, head_size=192,
                                            value_head_size=128)
    # The layer keeps both sizes: the engine layout decides whether values are padded.
    assert (spec.layers[1].rank_caches(1, 1)[0].head_size, spec.layers[1].rank_caches(1, 1)[0].value_head_size) == (
        192, 128)
    assert not any("padded" in warning for warning in spec.warnings)


def test_mllama_cross_attention_layers_cache_image_tokens() -> None:
    spec = model_spec_from_config(load_model_config("llama-3.2-11b-vision").config)
    cross = [i for i, layer in enumerate(spec.layers) if isinstance(layer, CrossAttentionLayer)]
    assert cross == [3, 8, 13, 18, 23, 28, 33, 38] and len(spec.layers) == 40
    assert spec.layers[3] == CrossAttentionLayer(num_kv_heads=8, head_size=128, tokens_per_image=4 * (40 * 40 + 1))


def test_dsa_indexer_in_every_layer_that_runs_one() -> None:
    spec = model_spec_from_config(preset("deepseek-v3.2"))
    assert spec.layers == (IndexedMLALayer(kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128),) * 61
    config = preset("glm-5-fp8")
    config.update(index_topk_freq=4)  # transformers: full where max(i - offset + 1, 0) % freq == 0, offset 2
    has = [layer.has_indexer for layer in model_spec_from_config(config).layers]  # type: ignore[attr-defined]
    assert [i for i, flag in enumerate(has) if flag][:5] == [0, 1, 5, 9, 13]
    config.update(index_topk_pattern="FS" * 39)
    has = [layer.has_indexer for layer in model_spec_from_config(config).layers]  # type: ignore[attr-defined]
    assert has == [True, False] * 39


def test_state_only_models() -> None:
    assert model_spec_from_config(preset("falcon-mamba-7b")).layers[0] == Mamba1Layer(
        intermediate_size=8192, state_size=16, conv_kernel=4)  # intermediate_size wins over expand 16
    assert model_spec_from_config(fixture("mamba-codestral-7b")).layers[0] == Mamba2Layer(
        num_heads=128, head_dim=64, n_groups=8, state_size=128, conv_kernel=4)


def _with(name: str, **fields: Any) -> dict[str, Any]:
    config = preset(name)
    (config.get("text_config") or config).update(fields)
    return config


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (_with("llama-3.1-8b", mamba_d_state=16), "mamba_d_state"),
        (_with("llama-3.1-8b", attn_layer_period=8), "attn_layer_period"),
        (_with("mistral-7b-v0.1", hybrid_layer_pattern=[0, 1] * 16), "hybrid_layer_pattern"),
        (_with("qwen3-8b", swa_num_key_value_heads=8), "swa_num_key_value_heads"),
        (_with("llama-3.1-8b", cross_attention_layers=[3]), "cross_attention_layers"),
        (_with("deepseek-v3", index_head_dim=128), "index_head_dim"),
        (_with("llama-3.1-8b", kv_lora_rank=512), "kv_lora_rank"),
        (_with("qwen3-next-80b-a3b-thinking", mamba_d_state=16), "mamba_d_state"),
        (_with("gemma-3-27b-it", global_head_dim=512), "global_head_dim"),
        (_with("llama-3.1-8b", linear_num_key_heads=16), "linear_num_key_heads"),
        (_with("jamba-1.5-mini", ssm_state_size=128), "ssm_state_size"),
        (_with("qwen3-8b", sliding_window_pattern=6), "sliding_window_pattern"),
    ],
)
def test_fields_a_reader_does_not_read_are_refused(config: dict[str, Any], field: str) -> None:
    with pytest.raises(ModelConfigError, match=rf"config fields \['{field}'\] change what the layers cache"):
        model_spec_from_config(config)


def test_unset_cache_fields_are_not_refused() -> None:
    config = _with("llama-3.1-8b", mamba_d_state=None, attn_layer_indices=[], num_kv_shared_layers=0)
    assert len(model_spec_from_config(config).layers) == 32


def test_empty_and_typeless_configs() -> None:
    with pytest.raises(ModelConfigError, match="the config is an empty JSON object"):
        model_spec_from_config({})
    with pytest.raises(ModelConfigError, match=r"^the config has no model_type; supported: "):
        model_spec_from_config({"num_hidden_layers": 2})


def test_fields_saved_configs_repeat_are_read() -> None:
    """Published configs carry fields beside the ones that size the cache; the readers know them."""
    lfm2 = {**fixture("lfm2-2.6b"), "conv_dim_out": 2048, "conv_use_xavier_init": True, "conv_bias": False}
    assert kinds(lfm2) == kinds(fixture("lfm2-2.6b"))
    zamba2 = fixture("zamba2-7b")
    hybrid = [i for i, kind in enumerate(zamba2["layers_block_type"]) if kind == "hybrid"]
    assert len(model_spec_from_config({**zamba2, "hybrid_layer_ids": hybrid}).layers) == 81
    with pytest.raises(ModelConfigError, match=r"hybrid_layer_ids .* disagrees with layers_block_type"):
        model_spec_from_config({**zamba2, "hybrid_layer_ids": hybrid[1:]})
