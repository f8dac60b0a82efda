"""Per-layer specs read from real configs and the families' documented defaults."""

from __future__ import annotations

import copy
import logging
from collections import Counter
from typing import Any

import pytest

from kvgroups import ChunkedLocal, FullAttention, ModelConfigError, SlidingWindow
from kvgroups.models.configs import model_spec_from_config, supported_model_types
from kvgroups.models.layers import AttentionLayer, GatedDeltaNetLayer, Mamba2Layer, MLALayer, NoCacheLayer
from kvgroups.models.presets import load_model_config, preset_names


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
    assert len(preset_names()) == 19
    assert "llama-3.1-8b" in preset_names()


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
    assert spec.layers[0].rank_cache(8, 0).replicated  # type: ignore[union-attr]
    custom = {"model_type": "my_mla", "num_hidden_layers": 2, "kv_lora_rank": 256, "qk_rope_head_dim": 32,
              "torch_dtype": "bfloat16"}
    assert model_spec_from_config(custom).layers == (MLALayer(kv_lora_rank=256, qk_rope_head_dim=32),) * 2


def test_qwen3_next_hybrid() -> None:
    spec = model_spec_from_config(preset("qwen3-next-80b-a3b-thinking"))
    full = [i for i, layer in enumerate(spec.layers) if isinstance(layer, AttentionLayer)]
    assert full == list(range(3, 48, 4))
    assert spec.layers[3] == AttentionLayer(spec=FullAttention(), num_kv_heads=2, head_size=256)
    linear = spec.layers[0]
    assert linear == GatedDeltaNetLayer(num_key_heads=16, key_head_dim=128, num_value_heads=32,
                                        value_head_dim=128, conv_kernel=4)
    state = linear.rank_cache(1, 0).spec
    assert state.state_shapes == ((2 * 16 * 128 + 32 * 128, 3), (32, 128, 128))  # type: ignore[attr-defined]


def test_nemotron_h_pattern() -> None:
    spec = model_spec_from_config(preset("nemotron-h-56b-base-8k"))
    counts = Counter(type(layer).__name__ for layer in spec.layers)
    assert counts == {"Mamba2Layer": 54, "NoCacheLayer": 54, "AttentionLayer": 10}
    mamba = spec.layers[0]
    assert mamba == Mamba2Layer(num_heads=256, head_dim=64, n_groups=8, state_size=256, conv_kernel=4)
    assert mamba.rank_cache(8, 0).spec.state_shapes == (  # type: ignore[attr-defined]
        ((256 * 64 + 2 * 8 * 256) // 8, 3), (32, 64, 256)
    )
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


def test_unknown_model_type_with_generic_fields_reads_llama_like(caplog: pytest.LogCaptureFixture) -> None:
    config = {"model_type": "brand_new", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256,
              "num_key_value_heads": 2, "torch_dtype": "float16"}
    with caplog.at_level(logging.WARNING, logger="kvgroups"):
        spec = model_spec_from_config(config)
    assert spec.layers == (AttentionLayer(spec=FullAttention(), num_kv_heads=2, head_size=64),) * 2
    assert "'brand_new' is not known" in spec.warnings[0]
    assert "brand_new" in caplog.text


def test_unknown_model_type_without_fields_lists_supported() -> None:
    with pytest.raises(ModelConfigError, match=r"'brand_new' is not supported .*lacks \['hidden_size'\].*llama"):
        model_spec_from_config({"model_type": "brand_new", "num_hidden_layers": 2, "num_attention_heads": 4})
    assert {"llama", "gemma3", "qwen3_next", "nemotron_h", "nemotron-nas", "llama4"} <= set(supported_model_types())


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
