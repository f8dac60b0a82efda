"""Bytes per token and state bytes per sequence of a config, recomputed from the raw JSON.

Deliberately plain, one branch per model type, and sharing no code with the library: the
formulas are vLLM's (per tensor-parallel rank), written out again here:

    attention  = kv_heads/tp (one head each when fewer than ranks) * 2 * max(k_head, v_head) * kv_bytes
    MLA        = (kv_lora_rank + qk_rope_head_dim) * kv_bytes, the same on every rank
    indexer    = index_head_dim + index_head_dim / 128 * 4 bytes (fp8 keys, fp32 scales), every rank
    mamba1     = (K-1) * I/tp * conv_b + I/tp * N * ssm_b
    mamba2     = (K-1) * (I + 2 G' N)/tp * conv_b + H/tp * P * N * ssm_b,  G' = G if G % tp == 0 else tp (G must be 1)
    deltanet   = (K-1) * (2 Hk Dk + Hv Dv)/tp * conv_b + Hv/tp * Dk * Dv * ssm_b
    short conv = (L-1) * D/tp * conv_b
    lightning  = H/tp * d * d * state_b
    KDA        = (K-1) * 3 * H/tp * d * conv_b + H/tp * d * d * 4 (vLLM's kda_state_dtype: a float32 recurrent state)

conv_b is the model dtype (every hybrid config here is bfloat16 or names none), ssm_b the dtype
the config names for SSM states (mamba_ssm_cache_dtype, mamba_ssm_dtype; Nemotron-H float32 when
absent), else the model dtype.
"""

from __future__ import annotations

from typing import Any


class NoSplitError(Exception):
    """The heads (or groups, or channels) do not split over the ranks: the library must refuse."""


def heads(count: int, tp: int) -> int:
    if count % tp == 0:
        return count // tp
    if tp % count == 0:
        return 1
    raise NoSplitError


def exact(count: int, tp: int) -> int:
    if count % tp:
        raise NoSplitError
    return count // tp


def attention(kv: int, k_head: int, tp: int, kv_bytes: int, v_head: int | None = None) -> int:
    # Values of their own head size are counted as vLLM stores them (keys, then values, unpadded), the
    # layout inspect plans such a model in by default.
    return heads(kv, tp) * (k_head + (v_head or k_head)) * kv_bytes


def mamba1(inner: int, state: int, kernel: int, tp: int, conv_b: int, ssm_b: int) -> int:
    return (kernel - 1) * exact(inner, tp) * conv_b + exact(inner, tp) * state * ssm_b


def mamba2(inner: int, groups: int, num_heads: int, head_dim: int, state: int, kernel: int, tp: int,
           conv_b: int, ssm_b: int) -> int:
    if groups % tp and groups != 1:
        raise NoSplitError
    replicated = groups if groups % tp == 0 else tp
    conv = (kernel - 1) * exact(inner + 2 * replicated * state, tp) * conv_b
    return conv + exact(num_heads, tp) * head_dim * state * ssm_b


def deltanet(t: dict[str, Any], tp: int, conv_b: int, ssm_b: int) -> int:
    hk, hv = exact(t["linear_num_key_heads"], tp), exact(t["linear_num_value_heads"], tp)
    dk, dv = t["linear_key_head_dim"], t["linear_value_head_dim"]
    return (t["linear_conv_kernel_dim"] - 1) * (2 * hk * dk + hv * dv) * conv_b + hv * dk * dv * ssm_b


def head_dim(t: dict[str, Any]) -> int:
    return t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]


def ssm_bytes(t: dict[str, Any]) -> int:
    named = t.get("mamba_ssm_cache_dtype") or t.get("mamba_ssm_dtype")
    if named is None and t["model_type"] == "nemotron_h":
        named = "float32"
    return 4 if named == "float32" else 2


def _every(n: int, kind: str) -> list[str]:
    return [kind] * n


def deepseek_v4(t: dict[str, Any], kv_bytes: int) -> float:
    """Bytes per token of DeepSeek-V4 in vLLM's pages (every cache replicated over the ranks): per layer its
    window (blocks of 64), and on a compressed layer of ratio r its rows (blocks of 256 tokens, 256 / r rows)
    and its compressor's float32 state (blocks of 4 tokens for r = 4, else 8; two series where r = 4), on a
    ratio-4 layer the indexer's keys (fp8 plus an fp32 scale per 128) and its compressor's state. An 8-bit KV
    dtype is vLLM's fp8_ds_mla (rows of fp8 values, bf16 RoPE values, a scale per 64 and a spare byte; pages to
    576 bytes), a 16-bit one its FlashInfer layout (pages to 512)."""
    layers, head, rope, index = t["num_hidden_layers"], t["head_dim"], t["qk_rope_head_dim"], t["index_head_dim"]
    align = 576 if kv_bytes == 1 else 512
    row = (head - rope) + 2 * rope + (head - rope) // 64 + 1 if kv_bytes == 1 else head * kv_bytes

    def page(rows: int, row_bytes: int, tokens: int) -> float:
        return -(-rows * row_bytes // align) * align / tokens

    total = 0.0
    for ratio in (max(1, value) for value in t["compress_ratios"][:layers]):
        total += page(64, row, 64)
        if ratio > 1:
            series, block = (2, 4) if ratio == 4 else (1, 8)
            total += page(256 // ratio, row, 256) + page(block, 2 * series * head * 4, block)
        if ratio == 4:
            total += page(64, index + index // 128 * 4, 256) + page(4, 4 * index * 4, 4)
    return total


def deepseek_v41(t: dict[str, Any], kv_bytes: int) -> tuple[float, int]:
    """DeepSeek-V4.1 in vLLM's pages: every layer's window in 32-token pages; a KV source's compressed rows (one
    per 2 tokens or per token) and, where it is an index source, its indexer keys, in 128-token pages; a ratio-2
    source's ring of 8 float32 rows of kv and score, one per request."""
    layers, head, rope, index = t["num_hidden_layers"], t["head_dim"], t["qk_rope_head_dim"], t["index_head_dim"]
    align = 576 if kv_bytes == 1 else 512
    row = (head - rope) + 2 * rope + (head - rope) // 64 + 1 if kv_bytes == 1 else head * kv_bytes

    def page(rows: int, row_bytes: int, tokens: int) -> float:
        return -(-rows * row_bytes // align) * align / tokens

    per_token, per_sequence = 0.0, 0
    for layer in range(layers):
        ratio = t["compress_ratios"][layer]
        per_token += page(32, row, 32)
        if layer in t["kv_source_layer_ids"] and ratio:
            per_token += page(128 // ratio, row, 128)
            if layer in t["index_source_layer_ids"]:
                per_token += page(128 // ratio, index + index // 128 * 4, 128)
            if ratio == 2:
                per_sequence += 8 * 2 * head * 4
    return per_token, per_sequence


def recompute(config: dict[str, Any], tp: int, kv_bytes: int) -> tuple[float, int]:
    """(bytes per token per rank, state bytes per sequence per rank); raises NoSplitError."""
    t = config.get("text_config") or config
    kind = t.get("model_type") or config["model_type"]
    layers = t.get("num_hidden_layers") or t.get("num_layers") or t.get("n_layers")  # exaone, dbrx spell it so
    conv_b, ssm_b = 2, ssm_bytes({**t, "model_type": kind})
    kv = t.get("num_key_value_heads") or t.get("num_attention_heads")
    if kind == "deepseek_v4":
        return deepseek_v4(t, kv_bytes), 0
    if kind in ("deepseek_v41", "deepseek_v41_text"):
        return deepseek_v41(t, kv_bytes)
    if kind in ("deepseek_v2", "deepseek_v3"):
        return layers * (t["kv_lora_rank"] + t["qk_rope_head_dim"]) * kv_bytes, 0
    if kind in ("deepseek_v32", "glm_moe_dsa"):
        index = t.get("index_head_dim", 128)
        return layers * ((t["kv_lora_rank"] + t["qk_rope_head_dim"]) * kv_bytes + index + index // 128 * 4), 0
    if kind == "nemotron-nas":
        total = 0
        for block in t["block_configs"]:
            a = block["attention"]
            if not (a["no_op"] or a["replace_with_linear"]):
                total += attention(t["num_attention_heads"] // a["n_heads_in_group"], head_dim(t), tp, kv_bytes)
        return total, 0
    if kind == "nemotron_h":
        pattern = t["hybrid_override_pattern"]
        h, p, n = t["mamba_num_heads"], t["mamba_head_dim"], t["ssm_state_size"]
        state = mamba2(h * p, t["n_groups"], h, p, n, t["conv_kernel"], tp, conv_b, ssm_b)
        attention_head = t.get("attention_head_dim") or t["head_dim"]
        return pattern.count("*") * attention(kv, attention_head, tp, kv_bytes), pattern.count("M") * state
    if kind in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"):
        types = t.get("layer_types") or [
            "full_attention" if (i + 1) % t["full_attention_interval"] == 0 else "linear_attention"
            for i in range(layers)
        ]
        full = types.count("full_attention")
        return full * attention(kv, head_dim(t), tp, kv_bytes), (layers - full) * deltanet(t, tp, conv_b, ssm_b)
    if kind == "jamba":
        full = sum(1 for i in range(layers) if i % t["attn_layer_period"] == t["attn_layer_offset"])
        state = mamba1(t["mamba_expand"] * t["hidden_size"], t["mamba_d_state"], t["mamba_d_conv"], tp, conv_b, ssm_b)
        return full * attention(kv, head_dim(t), tp, kv_bytes), (layers - full) * state
    if kind in ("mamba", "falcon_mamba"):
        return 0, layers * mamba1(t["intermediate_size"], t["state_size"], t["conv_kernel"], tp, conv_b, ssm_b)
    if kind == "mamba2":
        inner = t["expand"] * t["hidden_size"]
        return 0, layers * mamba2(inner, t["n_groups"], t["num_heads"], t["head_dim"], t["state_size"],
                                  t["conv_kernel"], tp, conv_b, ssm_b)
    if kind in ("bamba", "granitemoehybrid", "falcon_h1"):
        inner = t.get("mamba_d_ssm") or t.get("mamba_expand", 2) * t["hidden_size"]
        n_heads = t.get("mamba_n_heads", 128)
        state = mamba2(inner, t.get("mamba_n_groups", 1), n_heads, t.get("mamba_d_head") or inner // n_heads,
                       t.get("mamba_d_state", 256), t.get("mamba_d_conv", 4), tp, conv_b, ssm_b)
        kv = t.get("num_key_value_heads") or 8
        if kind == "falcon_h1":
            return layers * attention(kv, head_dim(t), tp, kv_bytes), layers * state
        full = len(t["attn_layer_indices"]) if kind == "bamba" else t["layer_types"].count("attention")
        return full * attention(kv, head_dim(t), tp, kv_bytes), (layers - full) * state
    if kind == "zamba2":
        inner, n_heads = t["mamba_expand"] * t["hidden_size"], t["n_mamba_heads"]
        state = mamba2(inner, t["mamba_ngroups"], n_heads, inner // n_heads, t["mamba_d_state"], t["mamba_d_conv"],
                       tp, conv_b, ssm_b)
        hybrid = t["layers_block_type"].count("hybrid")
        return hybrid * attention(kv, 2 * t["hidden_size"] // t["num_attention_heads"], tp, kv_bytes), layers * state
    if kind == "lfm2":
        full = t["layer_types"].count("full_attention") if "layer_types" in t else len(t["full_attn_idxs"])
        channels = t.get("conv_dim") or t["hidden_size"]
        conv = (t["conv_L_cache"] - 1) * exact(channels, tp) * conv_b
        return full * attention(kv, head_dim(t), tp, kv_bytes), (layers - full) * conv
    if kind in ("minimax", "minimax_m1"):
        full = sum(t["attn_type_list"])
        d = head_dim(t)
        return full * attention(kv, d, tp, kv_bytes), (layers - full) * exact(t["num_attention_heads"], tp) * d * d * 2
    if kind == "mllama_text_model":
        return (layers - len(t["cross_attention_layers"])) * attention(kv, head_dim(t), tp, kv_bytes), 0
    if kind == "gemma4_text":
        types = t.get("layer_types") or ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                         for i in range(layers)]
        types = [*types[:-1], "full_attention"]
        global_kv = t["num_global_key_value_heads"] if t.get("attention_k_eq_v") else kv
        shared = t.get("num_kv_shared_layers", 0)
        total = 0
        for layer_type in types[:layers - shared]:
            if layer_type == "full_attention":
                total += attention(global_kv, t.get("global_head_dim", 512), tp, kv_bytes)
            else:
                total += attention(kv, t["head_dim"], tp, kv_bytes)
        return total, 0
    if kind == "mimo_v2_flash":
        total = 0
        for sliding in t["hybrid_layer_pattern"]:
            if sliding:
                total += attention(t["swa_num_key_value_heads"], t["swa_head_dim"], tp, kv_bytes, t["swa_v_head_dim"])
            else:
                total += attention(kv, t["head_dim"], tp, kv_bytes, t["v_head_dim"])
        return total, 0
    if kind in ("glm4_moe_lite", "minicpm3"):
        return layers * (t["kv_lora_rank"] + t["qk_rope_head_dim"]) * kv_bytes, 0
    if kind == "kimi_linear":
        linear = t["linear_attn_config"]
        full = len(linear["full_attn_layers"])
        kda = exact(linear["num_heads"], tp)
        d = linear["head_dim"]
        state = (linear["short_conv_kernel_size"] - 1) * 3 * kda * d * conv_b + kda * d * d * 4
        return full * (t["kv_lora_rank"] + t["qk_rope_head_dim"]) * kv_bytes, len(linear["kda_layers"]) * state
    if kind == "dbrx":
        return t["n_layers"] * attention(t["attn_config"]["kv_n_heads"], t["d_model"] // t["n_heads"], tp, kv_bytes), 0
    if kind == "exaone":
        return t["num_layers"] * attention(kv, head_dim(t), tp, kv_bytes), 0
    # Every layer keeps K/V per token; a sliding layer's window limits how many, not the bytes each costs.
    assert kind in ("llama", "mistral", "mixtral", "phi3", "qwen2", "qwen3", "gemma2", "gemma3_text", "gpt_oss",
                    "llama4_text", "glm4_moe", "laguna", "exaone4", "minimax_m2", "seed_oss"), kind
    if kind in ("gemma2", "gemma3_text"):
        kv = t.get("num_key_value_heads") or 4
        return layers * attention(kv, t.get("head_dim", 256), tp, kv_bytes), 0
    return layers * attention(kv, head_dim(t), tp, kv_bytes), 0


def tokens_per_image(config: dict[str, Any]) -> int:
    vision = config["vision_config"]
    return vision["max_num_tiles"] * ((vision["image_size"] // vision["patch_size"]) ** 2 + 1)
