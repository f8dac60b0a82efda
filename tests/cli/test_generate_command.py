"""``kvgroups generate``: a saved tiny model and tokenizer, two prompts sharing a prefix, the same text."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.paths import ROOT

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from tests.support.tiny_models import tiny_model  # noqa: E402

# Special tokens must not look like words: the tokenizer splits any word they start.
WORDS = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{index}" for index in range(4, 256)]


def save_model_with_tokenizer(directory: Path, model_type: str = "llama") -> tuple[object, object]:
    vocabulary = {word: index for index, word in enumerate(WORDS)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>",
                                                     bos_token="<s>", eos_token="</s>")
    model = tiny_model(model_type)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model, tokenizer


def generate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvgroups", "generate", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False)


def test_generate_reuses_a_stored_prefix_and_prints_the_plain_text(tmp_path: Path) -> None:
    model, tokenizer = save_model_with_tokenizer(tmp_path / "model")
    shared = " ".join(f"w{4 + (index * 7) % 250}" for index in range(40))
    store = f"file://{tmp_path}/kv"
    first = generate(str(tmp_path / "model"), "--prompt", shared + " w10 w11", "--store", store, "--chunk-size", "8",
                     "--max-new-tokens", "8")
    assert first.returncode == 0, first.stderr
    assert "reused 0 tokens, computed 42" in first.stderr and "time to first token" in first.stderr
    prompt = shared + " w99 w98 w97"
    second = generate(str(tmp_path / "model"), "--prompt", prompt, "--store", store, "--chunk-size", "8",
                      "--max-new-tokens", "8", "--stats")
    assert second.returncode == 0, second.stderr
    assert "reused 40 tokens, computed 3" in second.stderr
    # --stats: the store's numbers on stderr. The prefill is of 42 tokens (the last is generate's): 5 full
    # chunks looked up (the last token is always computed), all 5 found and loaded; the reply filled chunk 5
    # (tokens 40-47: the prompt's last 3, then 5 generated), saved while generating.
    stats = dict(line.strip().split(": ", 1) for line in second.stderr.splitlines()[1:] if line.startswith("  "))
    assert "store stats:" in second.stderr
    assert {name: stats[name] for name in ("tier", "lookups", "query_tokens", "hit_tokens", "hit_rate", "loads",
                                           "loaded_tokens", "saved_chunks", "dropped_saves", "failed_reads",
                                           "corrupt_entries", "hit_tokens_by_tier")} == {
        "tier": "file", "lookups": "1", "query_tokens": "40", "hit_tokens": "40", "hit_rate": "1.0", "loads": "1",
        "loaded_tokens": "40", "saved_chunks": "1", "dropped_saves": "0", "failed_reads": "0", "corrupt_entries": "0",
        "hit_tokens_by_tier": '{"file": 40}'}
    assert json.loads(stats["tiers"]) == {"file": {"gets": 5, "hits": 5, "promotions": 0, "errors": {}}}
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])  # type: ignore[operator]
    plain = model.generate(ids, max_new_tokens=8, do_sample=False)  # type: ignore[attr-defined]
    expected = tokenizer.decode(plain[0, ids.shape[1]:].tolist(), skip_special_tokens=True)  # type: ignore[attr-defined]
    assert second.stdout == expected + "\n"


def test_generate_from_token_ids_prints_ids(tmp_path: Path) -> None:
    model, _ = save_model_with_tokenizer(tmp_path / "model", "qwen3_next")
    ids = [3 + (index * 5) % 250 for index in range(20)]
    (tmp_path / "ids.json").write_text(json.dumps(ids))
    result = generate(str(tmp_path / "model"), "--prompt-ids", str(tmp_path / "ids.json"), "--store", "memory://",
                      "--chunk-size", "8", "--max-new-tokens", "5")
    assert result.returncode == 0, result.stderr
    plain = model.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False)  # type: ignore[attr-defined]
    assert json.loads(result.stdout) == plain[0, 20:].tolist()


def test_generate_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    save_model_with_tokenizer(tmp_path / "model")
    (tmp_path / "bad.txt").write_text("1 two 3")
    cases = [
        ([str(tmp_path / "nowhere"), "--prompt", "w5", "--store", "memory://"], "not a model directory"),
        ([str(tmp_path / "model"), "--prompt", "w5", "--store", "s3://x"], "unknown scheme 's3'"),
        ([str(tmp_path / "model"), "--prompt-ids", str(tmp_path / "bad.txt"), "--store", "memory://"],
         "not a list of token ids"),
        ([str(tmp_path / "model"), "--store", "memory://"], "one of the arguments --prompt --prompt-file --prompt-ids"),
    ]
    for argv, expected in cases:
        result = generate(*argv)
        assert result.returncode == 2, (argv, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], (argv, result.stderr)
        assert result.stdout == ""
