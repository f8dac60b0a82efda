"""The check before a hit on a transformers version never verified (issue 39).

On a version the sweep verified nothing is checked. On another, ``PrefixCache`` serves no hit for a
model before a restored prefix was checked to continue as a computed one: a transformers whose
restored linear-attention layers count their tokens in a way kvgroups does not restore (what 5.25
did to 5.24's restore) serves no hit, answers as computed, and warns once naming the version, the
model class and what differed; one that works reuses, and its pass is remembered on disk.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import textwrap
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.paths import ROOT

transformers = pytest.importorskip("transformers")

from transformers.cache_utils import LinearAttentionCacheLayerMixin, LinearAttentionLayer  # noqa: E402

from kvgroups.integrations.transformers import PrefixCache, prefix_cache, restore_check  # noqa: E402
from kvgroups.integrations.transformers.check_records import CheckRecords, fingerprint  # noqa: E402
from kvgroups.integrations.transformers.restore_check import VERIFIED_TRANSFORMERS, RestoreCheckWarning  # noqa: E402
from kvgroups.store import MemoryStore  # noqa: E402
from tests.integrations.transformers.test_reuse import CHUNK, assert_same_answer, prompts  # noqa: E402
from tests.support.tiny_models import tiny_model  # noqa: E402

UNVERIFIED = "5.99.0"


@pytest.fixture(autouse=True)
def fresh_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A records directory of the test's own, no check remembered by this process, transformers quiet."""
    directory = tmp_path / "kvgroups-cache"
    monkeypatch.setenv("KVGROUPS_CACHE_DIR", str(directory))
    monkeypatch.delenv("KVGROUPS_RESTORE_CHECK", raising=False)
    monkeypatch.setattr(restore_check, "_CHECKED", weakref.WeakKeyDictionary())
    transformers.logging.set_verbosity_error()
    yield directory / "restore-checks"


@pytest.fixture
def unverified(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(transformers, "__version__", UNVERIFIED)
    return UNVERIFIED


@pytest.fixture
def linear_layers_count_their_own_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """A release whose linear-attention layers count tokens in a counter kvgroups does not know: each
    update_conv_state adds the columns it was given, and the cache's length is that count (as 5.25 did
    with cumulative_length_linear, which 5.24's restore left at the conv window)."""
    update = LinearAttentionLayer.update_conv_state

    def counting_update(self: Any, conv_states: torch.Tensor, state_idx: int = 0, **kwargs: Any) -> Any:
        if state_idx == 0:
            self.tokens_seen_v99 = getattr(self, "tokens_seen_v99", 0) + conv_states.shape[-1]
        return update(self, conv_states, state_idx=state_idx, **kwargs)

    def increase_count(self: Any, state_idx: int) -> None:
        if state_idx == 0:
            self.tokens_seen_v99 = getattr(self, "tokens_seen_v99", 0) + 1

    monkeypatch.setattr(LinearAttentionLayer, "update_conv_state", counting_update)
    monkeypatch.setattr(LinearAttentionCacheLayerMixin, "increase_count", increase_count)
    monkeypatch.setattr(LinearAttentionCacheLayerMixin, "get_seq_length",
                        lambda self: getattr(self, "tokens_seen_v99", 0))


def hit(cache: PrefixCache, first: torch.Tensor, second: torch.Tensor) -> Any:
    """Request A stored, then request B's prefill (which shares A's first three chunks)."""
    cache.prefill(first)
    cache.flush()
    return cache.prefill(second)


def test_the_installed_transformers_is_verified_and_never_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert transformers.__version__ in VERIFIED_TRANSFORMERS
    assert {"5.24.0", "5.25.0"} <= VERIFIED_TRANSFORMERS

    def never(*_: Any) -> Any:
        raise AssertionError("a verified version was checked")

    monkeypatch.setattr(prefix_cache, "checked", never)
    model = tiny_model("qwen3_next")
    first, second = prompts(seed=11)
    with PrefixCache(model, MemoryStore(), chunk_size=CHUNK) as cache:
        result = hit(cache, first, second)
        assert result.reused_tokens == 3 * CHUNK and cache.restore_check is None


@pytest.mark.usefixtures("unverified", "linear_layers_count_their_own_way")
def test_a_release_whose_restored_layers_differ_serves_no_hit_and_warns_once(
        caplog: pytest.LogCaptureFixture, fresh_checks: Path) -> None:
    model = tiny_model("qwen3_next")
    first, second = prompts(seed=11)
    with PrefixCache(model, MemoryStore(), chunk_size=CHUNK) as cache:
        cache.prefill(first)
        cache.flush()
        with caplog.at_level(logging.WARNING, logger="kvgroups"), pytest.warns(RestoreCheckWarning) as warned:
            result = cache.prefill(second)
        assert (result.reused_tokens, result.computed_tokens) == (0, len(second))
        assert_same_answer(model, cache, second, result.logits)
        assert cache.restore_check is not None and not cache.restore_check.passed
        assert cache.restore_check.seconds > 0
        # One warning, naming the version, the model class and what differed.
        [warning] = [str(entry.message) for entry in warned]
        assert UNVERIFIED in warning and "Qwen3NextForCausalLM" in warning
        assert "logits differ from computing by" in warning or "chose tokens" in warning
        assert [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING] == [warning]
        # Every later request computes everything, with no other warning and no lookup.
        caplog.clear()
        lookups = cache.stats.lookups
        again = cache.prefill(first)
        assert again.reused_tokens == 0
        assert not [record for record in caplog.records if record.levelno >= logging.WARNING]
        assert cache.stats.lookups == lookups
    # A failure is never remembered: the next process checks again.
    assert not fresh_checks.exists() or not list(fresh_checks.glob("*.json"))


@pytest.mark.usefixtures("unverified")
def test_a_release_that_restores_right_is_checked_once_then_reuses(
        caplog: pytest.LogCaptureFixture, fresh_checks: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model("qwen3_next")
    first, second = prompts(seed=11)
    with PrefixCache(model, MemoryStore(), chunk_size=CHUNK) as cache:
        with caplog.at_level(logging.INFO, logger="kvgroups"):
            result = hit(cache, first, second)
        assert result.reused_tokens == 3 * CHUNK
        assert_same_answer(model, cache, second, result.logits)
        assert cache.restore_check is not None and cache.restore_check.passed
        assert not cache.restore_check.remembered
        assert any("checked" in record.getMessage() and UNVERIFIED in record.getMessage()
                   for record in caplog.records)
    # Remembered on disk, privately: a directory of 0700, a file of 0600 naming the version and class.
    [record] = list(fresh_checks.glob("*.json"))
    assert stat.S_IMODE(fresh_checks.stat().st_mode) == 0o700 and stat.S_IMODE(record.stat().st_mode) == 0o600
    saved = json.loads(record.read_text())
    assert saved["passed"] is True and saved["transformers"] == UNVERIFIED
    assert saved["model_class"].endswith("Qwen3NextForCausalLM")
    # Another process (no memory of its own) reads the pass and runs nothing.
    monkeypatch.setattr(restore_check, "_CHECKED", weakref.WeakKeyDictionary())

    def never(*_: Any) -> Any:
        raise AssertionError("a remembered pass was checked again")

    # (the function the check runs, swapped where the fingerprint does not look: patching the module's
    # check_restore would change the fingerprint and rightly cost a check)
    monkeypatch.setattr(restore_check.checked, "__defaults__", (None, never))
    with PrefixCache(model, MemoryStore(), chunk_size=CHUNK) as cache:
        assert hit(cache, first, second).reused_tokens == 3 * CHUNK
        assert cache.restore_check is not None and cache.restore_check.remembered


@pytest.mark.usefixtures("unverified")
def test_a_remembered_pass_is_not_one_for_patched_layers(fresh_checks: Path) -> None:
    """A pass remembered for the layers as they were does not serve layers patched since: the fingerprint
    holds their code (a hostile or stale record file is no pass either)."""
    model = tiny_model("qwen3_next")
    first, second = prompts(seed=11)
    with PrefixCache(model, MemoryStore(), chunk_size=CHUNK) as cache:
        assert hit(cache, first, second).reused_tokens == 3 * CHUNK
        before = fingerprint(model, cache.binding)
    with pytest.MonkeyPatch.context() as patch:
        original = LinearAttentionLayer.update_conv_state

        def same_update(self: Any, *args: Any, **kwargs: Any) -> Any:  # another function, the same behaviour
            return original(self, *args, **kwargs)

        patch.setattr(LinearAttentionLayer, "update_conv_state", same_update)
        with PrefixCache(model, MemoryStore(), chunk_size=CHUNK) as cache:
            assert fingerprint(model, cache.binding) != before
    # A forward replaced on one module of this model object, and a hook: code its class does not show.
    attention = model.model.layers[0].linear_attn
    forward = attention.forward
    with PrefixCache(model, MemoryStore(), chunk_size=CHUNK) as cache:
        assert fingerprint(model, cache.binding) == before
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            return forward(*args, **kwargs)

        attention.forward = wrapped
        replaced = fingerprint(model, cache.binding)
        del attention.forward
        handle = attention.register_forward_hook(lambda module, inputs, output: None)
        hooked = fingerprint(model, cache.binding)
        handle.remove()
        assert len({before, replaced, hooked}) == 3 and fingerprint(model, cache.binding) == before


def test_records_on_disk_are_read_defensively(tmp_path: Path) -> None:
    records = CheckRecords(tmp_path / "checks")
    key = "a" * 64
    assert not records.passed(key)  # no directory
    (tmp_path / "checks").mkdir()
    for text in ("not json", json.dumps({"fingerprint": "b" * 64, "passed": True}), json.dumps([1, 2]),
                 json.dumps({"fingerprint": key, "passed": "yes"}),
                 json.dumps({"fingerprint": key, "passed": True, "padding": "x" * 5000})):
        (tmp_path / "checks" / f"{key}.json").write_text(text)
        assert not records.passed(key), text
    (tmp_path / "checks" / f"{key}.json").write_text(json.dumps({"fingerprint": key, "passed": True}))
    assert records.passed(key)


@pytest.mark.usefixtures("unverified", "linear_layers_count_their_own_way")
@pytest.mark.parametrize("how", ["option", "environment"])
def test_operators_who_verified_turn_the_check_off(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Off, nothing is checked and hits are served, even where the check would fail: the operator's call."""
    if how == "environment":
        monkeypatch.setenv("KVGROUPS_RESTORE_CHECK", "0")
    model = tiny_model("qwen3_next")
    first, second = prompts(seed=11)
    with PrefixCache(model, MemoryStore(), chunk_size=CHUNK,
                     restore_check=False if how == "option" else None) as cache:
        assert hit(cache, first, second).reused_tokens == 3 * CHUNK
        assert cache.restore_check is None


@pytest.mark.usefixtures("unverified")
@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "mamba2", "bamba", "lfm2"])
def test_the_check_passes_where_reuse_is_right(model_type: str) -> None:
    """Full, sliding, all-recurrent and hybrid caches: the check passes and the hit answers as computed."""
    model = tiny_model(model_type)
    generator = torch.Generator().manual_seed(3)
    long = torch.randint(3, 256, (40,), generator=generator)
    with PrefixCache(model, MemoryStore(), chunk_size=CHUNK) as cache:
        result = hit(cache, long, long[:30])
        assert result.reused_tokens == 3 * CHUNK, cache.restore_check
        assert_same_answer(model, cache, long[:30], result.logits)


def test_the_fingerprint_is_the_same_in_every_process() -> None:
    """Remembering a pass is worth something only if another process finds it: no address or string hash
    may reach the fingerprint."""
    script = textwrap.dedent("""
        import transformers
        transformers.logging.set_verbosity_error()
        from tests.support.tiny_models import tiny_model
        from kvgroups.integrations.transformers.cache_binding import CacheBinding
        from kvgroups.integrations.transformers.check_records import fingerprint
        model = tiny_model("bamba")
        print(fingerprint(model, CacheBinding(model, 8, "name")))
    """)
    found = set()
    for seed in ("1", "2"):
        output = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True,
                                env={**os.environ, "PYTHONHASHSEED": seed}, timeout=300)
        found.add(output.stdout.strip().splitlines()[-1])
    assert len(found) == 1 and len(found.pop()) == 64


# A release whose linear layers count their own way (as the fixture above), then `kvgroups generate`.
BROKEN_RELEASE_GENERATE = """
import sys
import transformers
from transformers.cache_utils import LinearAttentionCacheLayerMixin, LinearAttentionLayer
transformers.__version__ = "5.99.0"
update = LinearAttentionLayer.update_conv_state
def counting_update(self, conv_states, state_idx=0, **kwargs):
    if state_idx == 0:
        self.tokens_seen_v99 = getattr(self, "tokens_seen_v99", 0) + conv_states.shape[-1]
    return update(self, conv_states, state_idx=state_idx, **kwargs)
def increase_count(self, state_idx):
    if state_idx == 0:
        self.tokens_seen_v99 = getattr(self, "tokens_seen_v99", 0) + 1
LinearAttentionLayer.update_conv_state = counting_update
LinearAttentionCacheLayerMixin.increase_count = increase_count
LinearAttentionCacheLayerMixin.get_seq_length = lambda self: getattr(self, "tokens_seen_v99", 0)
from kvgroups.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("off", [False, True])
def test_kvgroups_generate_says_so_in_one_line_or_reuses_when_told(off: bool, tmp_path: Path) -> None:
    model = tiny_model("qwen3_next")
    model.save_pretrained(tmp_path / "model")
    ids = [3 + (index * 5) % 250 for index in range(30)]
    (tmp_path / "ids.json").write_text(json.dumps(ids))
    command = [sys.executable, "-c", BROKEN_RELEASE_GENERATE, "generate", str(tmp_path / "model"), "--prompt-ids",
               str(tmp_path / "ids.json"), "--store", f"file://{tmp_path}/kv", "--chunk-size", "8",
               "--max-new-tokens", "4", *(["--no-restore-check"] if off else [])]
    environment = {**os.environ, "KVGROUPS_CACHE_DIR": str(tmp_path / "checks")}
    for _ in range(2):  # the second run has a stored prefix to hit
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
                                env=environment)
        assert result.returncode == 0, result.stderr
    warned = [line for line in result.stderr.splitlines() if "warning" in line.lower()]
    if off:
        assert "reused 24 tokens" in result.stderr and not warned
    else:
        assert "reused 0 tokens, computed 30" in result.stderr
        [line] = warned
        assert line.startswith("kvgroups: warning: prefix reuse is off for ") and "5.99.0" in line
        assert "Qwen3NextForCausalLM" in line
        plain = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
        assert json.loads(result.stdout) == plain[0, len(ids):].tolist()
