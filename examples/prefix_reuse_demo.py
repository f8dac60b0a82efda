"""Prefix reuse end to end: two requests that share a long prefix, on the embedded file store.

For a plain model (llama) and a hybrid (Qwen3-Next-like: 3 Gated DeltaNet layers per full
attention layer), tiny and random-weight (built here, nothing downloaded): request A is computed
and its chunks saved to a file store in a temporary directory; request B shares A's first 1792 of
2048 tokens. B's time to first token with reuse is compared with recomputing it, and B's answer
(last-position logits, 32 greedy tokens) with the recomputed one.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

import torch
import transformers
from rich.console import Console
from rich.table import Table

from kvgroups.integrations.transformers import PrefixCache

PROMPT, SHARED, CHUNK, NEW_TOKENS = 2048, 1792, 256, 32
COMMON = dict(vocab_size=4096, hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, initializer_range=0.1)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama, 8 full attention": ("llama", {}),
    "qwen3-next, 6 gated DeltaNet + 2 full": ("qwen3_next", dict(
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
        linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2,
        linear_num_value_heads=4, moe_intermediate_size=256, shared_expert_intermediate_size=256, num_experts=4,
        num_experts_per_tok=2,
    )),
}


def build(model_type: str, fields: dict[str, Any]) -> Any:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **{**COMMON, **fields})
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def main() -> None:
    transformers.logging.set_verbosity_error()
    console = Console(width=140)
    generator = torch.Generator().manual_seed(1)
    vocab = COMMON["vocab_size"]
    first = torch.randint(3, vocab, (PROMPT,), generator=generator)
    second = torch.cat([first[:SHARED], torch.randint(3, vocab, (PROMPT - SHARED,), generator=generator)])
    table = Table(title=f"Request B shares {SHARED} of its {PROMPT} tokens with request A "
                        f"({CHUNK}-token chunks, file store)")
    for header in ("model", "reused", "computed", "TTFT with reuse s", "TTFT recompute s", "speed-up",
                   "max |Δ logit|", f"{NEW_TOKENS} tokens equal"):
        table.add_column(header, justify="left" if header == "model" else "right")
    with tempfile.TemporaryDirectory() as directory:
        console.print(f"file store: file://{directory}/kv")
        for label, (model_type, fields) in MODELS.items():
            model = build(model_type, fields)
            with PrefixCache(model, f"file://{directory}/kv", chunk_size=CHUNK) as cache:
                cache.prefill(first)
                cache.flush()
                reused = cache.prefill(second)
                begin = time.perf_counter()
                with torch.no_grad():
                    plain = model(second[None], logits_to_keep=1).logits[0, -1]
                recompute = time.perf_counter() - begin
                ours = cache.generate(second, max_new_tokens=NEW_TOKENS)
                reference = model.generate(second[None], max_new_tokens=NEW_TOKENS, do_sample=False)
            table.add_row(label, str(reused.reused_tokens), str(reused.computed_tokens), f"{reused.seconds:.3f}",
                          f"{recompute:.3f}", f"{recompute / reused.seconds:.1f}x",
                          f"{float((reused.logits - plain).abs().max()):.1e}",
                          "yes" if torch.equal(ours, reference) else "NO")
    console.print(table)


if __name__ == "__main__":
    main()
