"""Configs as transformers saves them, and fields published configs carry that change nothing for the
cache: read as the model builds them, never refused for a field that only looks like a cache field."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kvgroups import ModelConfigError
from kvgroups.core.cache_specs import FullAttention, SlidingWindow
from kvgroups.models.configs import model_spec_from_config
from kvgroups.models.layers import AttentionLayer, NoCacheLayer
from tests.support.helpers import fixture

transformers = pytest.importorskip("transformers")


def saved(model_type: str, **fields: Any) -> dict[str, Any]:
    """The config.json transformers writes for a config of ``model_type`` built from ``fields``."""
    config: dict[str, Any] = transformers.AutoConfig.for_model(model_type, **fields).to_dict()
    return config


def test_mimo_v2_flash_reads_attention_chunk_size_as_the_window_it_repeats() -> None:
    published = fixture("mimo-v2-flash")
    with_chunk = {**copy.deepcopy(published), "attention_chunk_size": published["sliding_window_size"]}
    assert model_spec_from_config(with_chunk).layers == model_spec_from_config(published).layers


def test_mimo_v2_flash_saved_by_transformers_is_read_as_its_model_builds_it() -> None:
    config = saved("mimo_v2_flash", num_hidden_layers=6, num_key_value_heads=4, head_dim=192, v_head_dim=128,
                   sliding_window_size=128)
    assert "swa_num_key_value_heads" not in config and config["sliding_window"] == 129
    layers = model_spec_from_config(config).layers
    full = AttentionLayer(spec=FullAttention(), num_kv_heads=4, head_size=192, value_head_size=128)
    sliding = AttentionLayer(spec=SlidingWindow(window_tokens=129), num_kv_heads=8, head_size=192, value_head_size=128)
    assert layers == (full, sliding, sliding, sliding, sliding, full)


def test_minimax_saved_by_transformers_reads_its_residual_scales() -> None:
    config = saved("minimax", num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                   hidden_size=256)
    assert config["linear_attn_alpha_factor"] == 1 and config["linear_attn_beta_factor"] == 1
    assert [layer.summary for layer in model_spec_from_config(config).layers] == [
        "full_attention 2x32", "lightning", "full_attention 2x32", "lightning"]


def test_gemma4_saved_by_transformers_takes_the_full_layers_sizes_from_per_layer_config() -> None:
    config = saved("gemma4_text", num_hidden_layers=6, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                   num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=64)
    assert "global_head_dim" not in config and config["per_layer_config"]["5"] == {
        "head_dim": 32, "num_key_value_heads": 1}
    layers = model_spec_from_config(config).layers
    assert [layer.summary for layer in layers] == ["sliding_window 2x16"] * 5 + ["full_attention 1x32"]
    wrong = {**config, "per_layer_config": {"5": {"head_dim": 32, "swa_head_dim": 8}}}
    with pytest.raises(ModelConfigError, match=r"per_layer_config\['5'\] sets \['swa_head_dim'\], which change what "
                                               r"layer 5 caches and are not read"):
        model_spec_from_config(wrong)


def test_per_layer_config_on_a_layer_without_attention_is_refused() -> None:
    config = saved("qwen3_next", num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"])
    config["per_layer_config"] = {"0": {"head_dim": 64}}
    with pytest.raises(ModelConfigError, match=r"per_layer_config\['0'\] sets \['head_dim'\] on layer 0, which is "
                                               r"gated_deltanet; expected positive ints on an attention layer"):
        model_spec_from_config(config)


def test_shared_kv_layers_keep_nothing_whatever_per_layer_config_says() -> None:
    config = saved("gemma3n_text", num_hidden_layers=10, num_kv_shared_layers=4, num_key_value_heads=2, head_dim=64)
    layers = model_spec_from_config(config).layers
    assert layers[6:] == (NoCacheLayer(reason="shares an earlier layer's KV"),) * 4
    assert [layer.summary for layer in layers[:6]] == ["sliding_window 2x64"] * 4 + ["full_attention 2x64",
                                                                                     "sliding_window 2x64"]


def test_an_encoder_config_is_refused_and_a_decoder_read() -> None:
    encoder = saved("bert", num_hidden_layers=2, hidden_size=64, num_attention_heads=4)
    with pytest.raises(ModelConfigError, match="with is_decoder false is an encoder: it keeps no KV cache"):
        model_spec_from_config(encoder)
    decoder = model_spec_from_config({**encoder, "is_decoder": True})
    assert decoder.layers == (AttentionLayer(spec=FullAttention(), num_kv_heads=4, head_size=16),) * 2
