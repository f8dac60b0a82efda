"""The sweep over every causal-LM model type of the installed transformers (issue 20).

For each type a tiny random-weight model is built from :mod:`tests.support.model_type_recipes` (float32,
eager attention, seed 0) and run forward with a ``DynamicCache``; what its cache holds is the
ground truth both checks are held to:

- **inspect**: the layers ``kvgroups inspect`` reads from the config transformers saves for the
  model (``model.config.to_dict()``) must be, cache by cache, what the cache holds: K/V heads and
  head sizes, sliding windows and chunks as transformers keeps them, MLA latents, indexer keys,
  conv and recurrent state shapes, dtypes, layers that keep nothing. At both sizes of the recipe.
- **PrefixCache**: request A, then request B sharing A's first 3 chunks and diverging mid-chunk
  (the protocol of ``tests/integrations/transformers/test_reuse.py``): B reuses 24 tokens, its last-position
  logits equal a plain prefill's within 1e-5 of the logit scale, and its greedy tokens equal
  ``model.generate``'s.

A type is verified exactly when it passes; otherwise the row says why. Reasons are written to be
stable (no measured numbers), so the data file they land in can be compared with a fresh sweep.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from tests.support.model_type_recipes import AFTER_BUILD, BUILD_FROM_SUB, TEXT_OF, build_config

CHUNK = 8
GREEDY_TOKENS = 8
SECONDS_PER_TYPE = 60  # the slowest type takes ~6 s on a loaded 2-core machine

Entry = tuple[Any, ...]


def causal_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


class TypeTimeoutError(Exception):
    pass


@contextmanager
def alarm(seconds: int) -> Iterator[None]:
    """Raise TypeTimeout in this thread after ``seconds`` (one type never stalls the sweep)."""
    def expire(*_: Any) -> None:
        raise TypeTimeoutError(f"timed out after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def one_line(error: BaseException) -> str:
    """An exception as one stable line (no addresses, at most 160 characters)."""
    text = " ".join(str(error).split()) or type(error).__name__
    if len(text) > 160:
        text = text[:157] + "..."
    return f"{type(error).__name__}: {text}"


# --- building ---------------------------------------------------------------------------------
def build_model(model_type: str, size: str) -> Any:
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = build_config(model_type, size)
    torch.manual_seed(0)
    if model_type in BUILD_FROM_SUB:
        cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
        model = cls._from_config(config, attn_implementation="eager", dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    if model_type in AFTER_BUILD:
        AFTER_BUILD[model_type](model)
    return model.eval()


def forward_cache(model: Any, tokens: int = 12) -> Any:
    """The cache a forward of ``tokens`` tokens leaves, passed in as PrefixCache passes it."""
    from transformers import DynamicCache

    ids = torch.randint(3, 256, (1, tokens), generator=torch.Generator().manual_seed(2))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        output = model(input_ids=ids, cache=cache, use_cache=True, position_ids=torch.arange(tokens)[None])
    returned = getattr(output, "cache", None)
    if returned is None:
        raise RuntimeError(f"the forward returns no cache ({type(output).__name__})")
    return returned


# --- what the cache holds, as entries ---------------------------------------------------------
def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def observed(cache: Any) -> list[list[Entry]]:
    """Per transformers cache layer, one entry per cache it keeps."""
    return [_layer_entries(layer) for layer in getattr(cache, "layers", None) or []]


def _layer_entries(layer: Any) -> list[Entry]:
    from transformers.cache_utils import CacheLayerMixin, DummyLayer, LinearAttentionCacheLayerMixin

    entries: list[Entry] = []
    if isinstance(layer, DummyLayer):
        return [("none",)]
    if isinstance(layer, CacheLayerMixin):
        keys, values = layer.keys, layer.values
        if keys is None:
            entries.append(("empty",))
        else:
            window = getattr(layer, "sliding_window", None)
            entries.append(("kv", keys.shape[1], keys.shape[-1], values.shape[1], values.shape[-1], window,
                            _dtype(keys)))
        indexer = getattr(layer, "indexer_keys", None)
        if indexer is not None:
            entries.append(("indexer", indexer.shape[-1], _dtype(indexer)))
        for rows in (getattr(layer, "compressed_kv", None) or {}).values():  # DeepSeek-V4's compressors
            entries.append(("compressed", layer.compress_rate, rows.shape[-1], _dtype(rows)))
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        for state in range(layer.number_of_states):
            for role, tensors in (("conv", layer.conv_states), ("state", layer.recurrent_states)):
                tensor = tensors.get(state)
                if tensor is not None:
                    entries.append((role, *tensor.shape[1:], _dtype(tensor)))
    return entries


def expected(config: dict[str, Any]) -> list[list[Entry]]:
    """Per layer inspect reads from ``config``, the entries it would hold in a transformers cache."""
    from kvgroups.core.cache_specs import ChunkedLocal, SlidingWindow
    from kvgroups.models.cache_dtypes import resolve_dtypes
    from kvgroups.models.compressed_layers import CompressedAttentionLayer
    from kvgroups.models.configs import model_spec_from_config
    from kvgroups.models.layers import (
        AttentionLayer,
        CrossAttentionLayer,
        IndexedMLALayer,
        MLALayer,
        NoCacheLayer,
        ParallelLayer,
    )

    spec = model_spec_from_config(config)
    dtypes = resolve_dtypes(spec, kv=None, state=None, conv_state=None, ssm_state=None)
    kv = str(dtypes.kv).removeprefix("torch.")

    def entries(index: int, layer: Any) -> list[Entry]:
        if isinstance(layer, ParallelLayer):
            return [entry for mixer in layer.mixers for entry in entries(index, mixer)]
        if isinstance(layer, NoCacheLayer):
            return [("none",)]
        if isinstance(layer, CrossAttentionLayer):
            return [("empty",)]  # a text-only forward writes nothing into a cross-attention layer
        if isinstance(layer, CompressedAttentionLayer):  # transformers keeps it in the model's dtype, unpacked
            dtype = spec.torch_dtype
            kept: list[Entry] = [("kv", 1, layer.head_dim, 1, layer.head_dim, layer.window_tokens, dtype)]
            if layer.compress_ratio > 1:
                kept.append(("compressed", layer.compress_ratio, layer.head_dim, dtype))
            if layer.sparse:
                kept.append(("compressed", layer.compress_ratio, layer.index_head_dim, dtype))
            return kept
        if isinstance(layer, AttentionLayer):
            window = (layer.spec.window_tokens if isinstance(layer.spec, SlidingWindow)
                      else layer.spec.chunk_tokens if isinstance(layer.spec, ChunkedLocal) else None)
            return [("kv", layer.num_kv_heads, layer.head_size, layer.num_kv_heads,
                     layer.value_head_size or layer.head_size, window, kv)]
        if isinstance(layer, MLALayer | IndexedMLALayer):
            window_tokens = layer.window_tokens if isinstance(layer, MLALayer) else None
            found: list[Entry] = [("kv", 1, layer.kv_lora_rank, 1, layer.qk_rope_head_dim, window_tokens, kv)]
            if isinstance(layer, IndexedMLALayer) and layer.has_indexer:
                found.append(("indexer", layer.index_head_dim, kv))
            return found
        # Recurrent mixers: vLLM's state shapes (a conv state keeps kernel - 1 columns, transformers all of them).
        found = []
        for cache in layer.rank_caches(1, index):
            dtype = str(cache.fixed_dtype or dtypes.of(cache)).removeprefix("torch.")
            for shape in cache.spec.state_shapes:
                if cache.role.value == "conv_state":
                    found.append(("conv", *shape[:-1], shape[-1] + 1, dtype))
                else:
                    found.append(("state", *shape, dtype))
        return found

    return [entries(index, layer) for index, layer in enumerate(spec.layers)]


def flat(layers: list[list[Entry]]) -> list[Entry]:
    """Entries in order (layers and cache layers need not correspond one to one: longcat keeps two per layer)."""
    return [entry for layer in layers for entry in layer]


def describe(layers: list[list[Entry]]) -> str:
    """What each layer caches, as a short text for the docs table: runs of equal layers folded (``full 2x16 ×3``)."""
    words = [" + ".join(_words(layer)) for layer in layers]
    runs: list[list[Any]] = []
    for word in words:
        if runs and runs[-1][0] == word:
            runs[-1][1] += 1
        else:
            runs.append([word, 1])
    return "; ".join(word if count == 1 else f"{word} ×{count}" for word, count in runs)


def _words(entries: list[Entry]) -> list[str]:
    words = []
    for entry in entries:
        kind = entry[0]
        if kind == "kv":
            _, heads, k_dim, v_heads, v_dim, window, _ = entry
            if heads == v_heads == 1 and k_dim != v_dim:  # transformers keeps MLA's latent as keys, rope key as values
                size = f"latent {k_dim}+{v_dim}"
            else:
                size = f"{heads}x{k_dim}" + (f"/{v_heads}x{v_dim}" if (v_heads, v_dim) != (heads, k_dim) else "")
            words.append(f"{'full' if window is None else f'window {window}'} {size}")
        elif kind in ("conv", "state"):
            words.append(f"{kind} {'x'.join(str(dim) for dim in entry[1:-1])}" + (
                f" {entry[-1]}" if entry[-1] != "float32" else ""))
        elif kind == "indexer":
            words.append(f"indexer {entry[1]}")
        elif kind == "compressed":
            words.append(f"compressed 1/{entry[1]} {entry[2]}")
        else:
            words.append(kind)
    return words


# --- the reuse protocol -----------------------------------------------------------------------
def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    first = torch.randint(3, 256, (40,), generator=generator)
    second = torch.cat([first[: 3 * CHUNK + 3], torch.randint(3, 256, (13,), generator=generator)])
    return first, second


def reuse_failure(model: Any) -> str | None:
    """None when B reuses A's shared chunks and answers as recomputing does; else what went wrong."""
    from kvgroups.integrations.transformers import prefix_cache

    first, second = prompts()
    # Every type is tried, the ones PrefixCache refuses today included: support is what this decides.
    checked, prefix_cache.check_supported = prefix_cache.check_supported, lambda model: None
    try:
        return _reuse_failure(model, first, second)
    finally:
        prefix_cache.check_supported = checked


def _reuse_failure(model: Any, first: torch.Tensor, second: torch.Tensor) -> str | None:
    from kvgroups.integrations.transformers import prefix_cache
    from kvgroups.store import MemoryStore

    with torch.no_grad():
        plain = model(second[None], logits_to_keep=1).logits[0, -1]
    tolerance = 1e-5 * max(1.0, float(plain.abs().max()))
    try:
        with prefix_cache.PrefixCache(model, MemoryStore(), chunk_size=CHUNK, restore_check=False) as cache:
            result = cache.prefill(first)
            cache.flush()
            result = cache.prefill(second)
            if result.reused_tokens != 3 * CHUNK:
                return f"request B reused {result.reused_tokens} tokens, not the {3 * CHUNK} it shares"
            if float((result.logits - plain).abs().max()) > tolerance:
                with prefix_cache.PrefixCache(model, MemoryStore(), chunk_size=CHUNK, restore_check=False) as fresh:
                    alone = fresh.prefill(second).logits
                if float((alone - plain).abs().max()) > tolerance:
                    return ("a prefill chunk by chunk without any reuse already differs from one forward: the model "
                            "is not chunk-invariant")
                return "request B's logits after reuse differ from a plain prefill's"
            ours = cache.generate(second, max_new_tokens=GREEDY_TOKENS)
            # The cache generate was given holds every token but the last it produced (fewer at an EOS).
            held = _length(cache.last_prefill.cache if cache.last_prefill else None)
            if held is not None and held != ours.shape[-1] - 1:
                return (f"model.generate with a restored cache leaves it holding {held} tokens, not "
                        f"{ours.shape[-1] - 1}: it does not continue the cache it is given")
    except Exception as error:  # the reason is the refusal
        return one_line(error)
    theirs = model.generate(second[None], max_new_tokens=GREEDY_TOKENS, do_sample=False)
    if not torch.equal(ours, theirs):
        return "greedy tokens after reuse differ from model.generate's"
    return None


def _length(cache: Any) -> int | None:
    """Tokens a cache says it holds (None for a cache of states only, which cannot say)."""
    try:
        return int(cache.get_seq_length())
    except Exception:
        return None


# --- why, where the automatic reason is not the whole story ----------------------------------------
MAMBA_V1 = ("its mamba (v1) layers ignore a restored SSM state in multi-token forwards, so a continued or chunk-by-"
            "chunk prefill differs from recomputing")
ROBERTA_POSITIONS = ("its positions start at padding_idx + 1 when none are given and from 0 in model.generate, so a "
                     "prefill with explicit positions (as PrefixCache computes) differs from a plain forward")
DSA = ("its sparse-attention indexer picks other keys when the same tokens are computed in other chunks once the "
       "context exceeds index_topk (transformers itself, without reuse), so a continued prefill differs from "
       "recomputing")
DRAFTER = "a drafter: its forward needs the shared K/V states of a target model"
# PrefixCache: explanations for failures the sweep sees (each must still fail; the test checks it).
PREFIX_REASONS: dict[str, str] = {
    **dict.fromkeys(("jamba", "mamba", "falcon_mamba", "zamba"), MAMBA_V1),
    **dict.fromkeys(("camembert", "data2vec-text", "roberta", "roberta-prelayernorm", "xlm-roberta", "xlm-roberta-xl",
                     "xmod"), ROBERTA_POSITIONS),
    **dict.fromkeys(("deepseek_v32", "glm_moe_dsa", "axk2", "dots3_note", "dots3_note_text", "hy_v4"), DSA),
    **dict.fromkeys(("gemma4_assistant", "gemma4_unified_assistant"), DRAFTER),
    "minimax": "it keeps its lightning-attention state in a cache class of its own (MiniMaxCache)",
    "recurrent_gemma": "it keeps its recurrent state on the modules, not in the cache",
    "xlstm": "it keeps its state in a cache class of its own (xLSTMCache)",
    "reformer": "it keeps its state in a cache class of its own (ReformerDynamicCache)",
    "rwkv": "it returns a state of its own, not a cache",
    "xlnet": "it keeps memories (mems), not a cache",
    "xlm": "an encoder: its LM head returns no cache",
    "openai-gpt": "its forward neither fills nor returns the cache",
    "blt": "a DynamicCache cannot be built from its config (it has no num_hidden_layers); it builds caches of its own",
    "musicgen": "model.generate needs its audio generation config (codebook delay pattern)",
    "musicgen_melody": "model.generate needs its audio generation config (codebook delay pattern)",
    "prophetnet": "its decoder takes one token at a time once it has a cache (n-gram prediction)",
}
# inspect: why a type has no reader (each must still be refused; the test checks it).
INSPECT_REFUSED: dict[str, str] = {
    "blt": "its caches are built from patcher, encoder, decoder and global sub-configs; no reader",
    "dory": "its recurrent loops keep a cache per pass (n_recurrent_loops), more caches than layers; no reader",
    "inkling2_loop_text": "its recurrent passes over shared layers keep a cache per pass, more caches than layers; "
                          "no reader",
    "openai-gpt": "its forward keeps no cache",
    "qwen4_exp_text": "its PLE layers keep a dilated conv state and an int64 n-gram token context beside gated "
                      "DeltaNet, its indexed layers indexer keys of their own heads and 3D positions; no reader",
    "recurrent_gemma": "it keeps its recurrent state on the modules, not in a cache; no reader",
    "reformer": "it keeps LSH buckets and states in a cache class of its own; no reader",
    "rwkv": "it keeps its state outside transformers' cache classes; no reader",
    "xlm": "an encoder: no causal cache",
    "xlnet": "it keeps memories (mems), not a KV cache",
    "xlstm": "it keeps its state in a cache class of its own (xLSTMCache); no reader",
    "zamba": "its mamba (v1) layers split their state into n_mamba_heads heads beside a shared attention block; "
             "no reader",
    "zaya": "its CCA layers keep a two-column conv state and a one-dimensional delayed-value state beside K/V; "
            "no reader",
}


# --- one type ---------------------------------------------------------------------------------
@dataclass
class TypeResult:
    model_type: str
    text_type: str = ""  # what PrefixCache and inspect look the model up by (its text config's model_type)
    cache: str = ""  # what each layer caches, from the size "a" model
    inspect: str = "refused: not run"  # "verified", "unchecked: why" or "refused: why"
    prefix_cache: str = "refused: not run"  # "verified" or "refused: why"
    seconds: float = 0.0


def _inspect_reads(config: dict[str, Any]) -> str | None:
    """None when inspect reads the config; else why not."""
    from kvgroups.errors import KVGroupsError

    try:
        expected(config)
    except KVGroupsError as error:
        return one_line(error)
    return None


def _inspect_verdict(model_type: str, model: Any, entries: list[list[Entry]], size: str) -> str:
    from kvgroups.errors import KVGroupsError

    try:
        wanted = expected(model.config.to_dict())
    except KVGroupsError as error:
        return f"refused: {INSPECT_REFUSED.get(model_type, one_line(error))}"
    if flat(wanted) != flat(entries):
        return f"refused: size {size}: inspect reads {describe(wanted)} where the cache holds {describe(entries)}"
    return "verified"


def run_type(model_type: str, *, reuse: bool = True, sizes: tuple[str, ...] = ("a", "b")) -> TypeResult:
    """Build, forward, check inspect at each size, and run the reuse protocol at size "a"."""
    result = TypeResult(model_type)
    begin = time.perf_counter()
    try:
        with alarm(SECONDS_PER_TYPE):
            config = build_config(model_type)
            text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
            result.text_type = str(getattr(text, "model_type", "") or config.model_type)
            for size in sizes:
                step = "the tiny model does not build"
                try:
                    model = build_model(model_type, size)
                    step = "a forward with a DynamicCache fails"
                    entries = observed(forward_cache(model))
                except Exception as error:
                    failure = f"{step}: {one_line(error)}"
                    if size == "a":
                        reads = _inspect_reads(config.to_dict())
                        result.inspect = (f"unchecked: {failure}" if reads is None
                                          else f"refused: {INSPECT_REFUSED.get(model_type, reads)}")
                        result.prefix_cache = f"refused: {PREFIX_REASONS.get(model_type, failure)}"
                    elif result.inspect == "verified":
                        result.inspect = f"refused: size {size}: {failure}"
                    break
                verdict = _inspect_verdict(model_type, model, entries, size)
                if size == "a":
                    result.cache = describe(entries)
                    result.inspect = verdict
                    if reuse:
                        failure = reuse_failure(model)
                        result.prefix_cache = ("verified" if failure is None
                                               else f"refused: {PREFIX_REASONS.get(model_type, failure)}")
                elif result.inspect == "verified":
                    result.inspect = verdict
    except TypeTimeoutError as error:
        result.inspect = result.prefix_cache = f"refused: {error}"
    result.seconds = time.perf_counter() - begin
    return result


def sweep(types: list[str] | None = None, *, progress: Callable[[TypeResult], None] | None = None,
          reuse: bool = True) -> dict[str, TypeResult]:
    """Every causal-LM type; a composite whose text type is swept takes that type's result (the same
    text model, looked up by the same name)."""
    results: dict[str, TypeResult] = {}
    chosen = types or causal_types()
    for model_type in chosen:
        if model_type in TEXT_OF and TEXT_OF[model_type] in chosen:
            continue
        results[model_type] = run_type(model_type, reuse=reuse)
        if progress is not None:
            progress(results[model_type])
    for composite, text in TEXT_OF.items():
        if composite in chosen and text in results:
            source = results[text]
            results[composite] = TypeResult(composite, text_type=source.text_type, cache=source.cache,
                                             inspect=source.inspect, prefix_cache=source.prefix_cache)
    return dict(sorted(results.items()))


def to_record(results: dict[str, TypeResult]) -> dict[str, Any]:
    """What ``src/kvgroups/models/transformers_types.json`` holds."""
    import transformers

    return {
        "transformers": transformers.__version__,
        "written_by": "tests/models/test_model_type_sweep.py (KVGROUPS_UPDATE_SWEEP=1); do not edit by hand",
        "types": {name: {"text_type": result.text_type, "cache": result.cache, "inspect": result.inspect,
                         "prefix_cache": result.prefix_cache} for name, result in sorted(results.items())},
    }
