"""Prefix keys: pinned vectors, the chain as specified, the same in every process, bound to their namespace."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgroups import KVGroupsError, LMCacheMetadata
from kvgroups.store import chunk_namespace, prefix_keys
from tests.support.helpers import meta

PINNED = {
    ("range8", 4, "test-namespace"): [
        "689e7c384536ae22a910cf3bf46a004114d50976cdd4229e396fa7a31a9e226c",
        "7a6230e20fb785522628cce1332af56def11bfa5ed323e440283ba3b85b1bdb6",
    ],
    ("mixed", 2, "bytes"): [
        "9e883d5ff1f7ac67650681353cebfdb5e5e5eb652c4118dd83ab137edae6dae3",
        "6682e9742769c04856b6c830803ae236fac1092421e52f96be4f006aa2901e43",
        "509977a9a81ef41b4435c37d64a9b8b754158acf3575f3f4881e9786ee2fe5d1",
    ],
}
TOKENS = {"range8": list(range(8)), "mixed": [7, 1, 2**32 - 1, 0, 5, 5]}
NAMESPACES: dict[str, str | bytes] = {"test-namespace": "test-namespace", "bytes": b"\x00bytes"}


def spelled_out(tokens: list[int], chunk_size: int, namespace: bytes) -> list[str]:
    """The chain as the documentation states it, written independently of the library."""
    digest = hashlib.sha256(b"kvgroups-prefix-root\0" + namespace).digest()
    keys = []
    for start in range(0, len(tokens) - chunk_size + 1, chunk_size):
        chunk = b"".join(token.to_bytes(4, "little") for token in tokens[start:start + chunk_size])
        digest = hashlib.sha256(digest + chunk).digest()
        keys.append(digest.hex())
    return keys


@pytest.mark.parametrize("case", list(PINNED))
def test_pinned_vectors(case: tuple[str, int, str]) -> None:
    tokens, chunk_size, namespace = TOKENS[case[0]], case[1], NAMESPACES[case[2]]
    assert prefix_keys(tokens, chunk_size, namespace) == PINNED[case]
    raw = namespace.encode() if isinstance(namespace, str) else namespace
    assert spelled_out(tokens, chunk_size, raw) == PINNED[case]


def test_keys_are_the_same_in_other_processes_whatever_their_hash_seed() -> None:
    code = (
        "import json; from kvgroups.store import prefix_keys; "
        "print(json.dumps([prefix_keys(list(range(8)), 4, 'test-namespace'), "
        "prefix_keys([7, 1, 2**32 - 1, 0, 5, 5], 2, b'\\x00bytes')]))"
    )
    for seed in ("0", "12345", "random"):
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                env={**os.environ, "PYTHONHASHSEED": seed})
        assert json.loads(result.stdout) == [PINNED["range8", 4, "test-namespace"], PINNED["mixed", 2, "bytes"]]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=40), st.integers(1, 9), st.binary(max_size=8))
def test_a_key_names_its_whole_prefix(tokens: list[int], chunk_size: int, namespace: bytes) -> None:
    keys = prefix_keys(tokens, chunk_size, namespace)
    assert len(keys) == len(tokens) // chunk_size  # a partial trailing chunk has no key
    assert keys == spelled_out(tokens, chunk_size, namespace)
    assert prefix_keys(torch.tensor(tokens, dtype=torch.int64), chunk_size, namespace) == keys
    assert prefix_keys(np.array(tokens, dtype=np.uint32), chunk_size, namespace) == keys
    if keys:
        changed = list(tokens)
        changed[0] = (changed[0] + 1) % 2**32
        assert not set(prefix_keys(changed, chunk_size, namespace)) & set(keys)  # every later key changes too
        assert prefix_keys(tokens, chunk_size, namespace + b"!")[0] != keys[0]


def metadata(**changes: object) -> LMCacheMetadata:
    fields: dict[str, object] = dict(model_name="m", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                                     kv_dtype=torch.bfloat16, kv_shape=(2, 2, 256, 2, 8))
    fields.update(changes)
    built = LMCacheMetadata(**fields)  # type: ignore[arg-type]
    built.kv_layer_groups_manager.build_kv_layer_groups({"l0": meta(2, 4, 16, 2, 8), "l1": meta(2, 4, 16, 2, 8)})
    return built


def test_the_namespace_binds_fingerprint_chunk_size_and_salt() -> None:
    base = chunk_namespace(metadata())
    assert chunk_namespace(metadata()) == base
    assert chunk_namespace(metadata(), salt="tenant-a") != base
    assert chunk_namespace(metadata(), salt="tenant-a") != chunk_namespace(metadata(), salt="tenant-b")
    assert chunk_namespace(metadata(chunk_size=128)) != base
    assert chunk_namespace(metadata(model_name="other")) != base
    assert chunk_namespace(metadata(world_size=2, local_world_size=2)) != base
    assert json.loads(base)["fingerprint"] == metadata().fingerprint()


def test_bad_arguments_name_what_is_wrong() -> None:
    with pytest.raises(KVGroupsError, match=r"chunk_size must be an int >= 1, got 0"):
        prefix_keys([1, 2], 0, "n")
    with pytest.raises(KVGroupsError, match=r"token ids must be in \[0, 2\*\*32\); got \[-1\]"):
        prefix_keys([1, -1], 1, "n")
    with pytest.raises(TypeError, match=r"1-D sequence of ints, got float64"):
        prefix_keys([1.5, 2.0], 1, "n")
    with pytest.raises(TypeError, match=r"1-D integer tensor, got torch.float32"):
        prefix_keys(torch.zeros(4), 1, "n")
    with pytest.raises(TypeError, match=r"namespace must be a str or bytes, got int"):
        prefix_keys([1], 1, 7)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"salt must be a str or bytes"):
        chunk_namespace(metadata(), salt=3)  # type: ignore[arg-type]
