"""Prefix keys: one stable key per full chunk of tokens, chained so that a key names its whole prefix.

``key_i = SHA-256(key_{i-1} || tokens of chunk i)`` (HMAC-SHA256 under a deployment secret), the
tokens as fixed-width little-endian unsigned 32-bit integers, starting from a digest of the
namespace. The namespace binds a key to
everything that makes stored KV bytes interchangeable (:func:`chunk_namespace`), so the same
tokens give the same keys in every process and on every machine, and different models, ranks,
chunk sizes or tenants never share one. Nothing here uses Python's ``hash()``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvgroups.core.checks import int_at_least, is_int_at_least
from kvgroups.core.metadata import LMCacheMetadata
from kvgroups.errors import KVGroupsError
from kvgroups.store.entries.secret import StoreSecret

# Bump when what a key covers changes, so keys of different meaning never collide.
KEY_FORMAT = "kvgroups.prefix-keys/1"
_TOKEN_LIMIT = 1 << 32

TokenIds = Sequence[int] | torch.Tensor | np.ndarray


def salt_bytes(salt: str | bytes, name: str = "salt") -> bytes:
    """A salt as the bytes keys are made of (a str as UTF-8); ``name`` is the argument's, for the error."""
    if isinstance(salt, str):
        return salt.encode("utf-8")
    if not isinstance(salt, bytes):
        raise TypeError(f"{name} must be a str or bytes, got {type(salt).__name__}")
    return salt


def chunk_namespace(metadata: LMCacheMetadata, salt: str | bytes = "") -> bytes:
    """The namespace of chunks stored for ``metadata`` (in its ``chunk_size``) for tenant ``salt``."""
    described = {
        "format": KEY_FORMAT, "fingerprint": metadata.fingerprint(), "chunk_size": metadata.chunk_size,
        "salt": salt_bytes(salt).hex(),
    }
    return json.dumps(described, sort_keys=True, separators=(",", ":")).encode("ascii")


def token_array(token_ids: TokenIds) -> np.ndarray:
    """``token_ids`` as a 1-D array of little-endian uint32, checked."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1 or token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
            raise TypeError(f"token_ids must be a 1-D integer tensor, got {token_ids.dtype} {list(token_ids.shape)}")
        values = token_ids.detach().cpu().numpy()
    else:
        values = np.asarray(token_ids)
        if values.ndim != 1 or (values.size and values.dtype.kind not in "iu"):
            raise TypeError(f"token_ids must be a 1-D sequence of ints, got {values.dtype} of shape "
                            f"{list(values.shape)}")
    if values.size and (int(values.min()) < 0 or int(values.max()) >= _TOKEN_LIMIT):
        bad = values[(values < 0) | (values >= _TOKEN_LIMIT)][:5].tolist()
        raise KVGroupsError(f"token ids must be in [0, 2**32); got {bad}")
    return values.astype("<u4", copy=False)


def prefix_keys(token_ids: TokenIds, chunk_size: int, namespace: str | bytes, *,
                secret: StoreSecret | None = None) -> list[str]:
    """One key per full chunk of ``token_ids``: key ``i`` names tokens ``[0, (i + 1) * chunk_size)``.

    Args:
        token_ids: the tokens, a 1-D sequence, array or integer tensor of ids in ``[0, 2**32)``.
        chunk_size: tokens per chunk; a partial trailing chunk has no key.
        namespace: what the keys are bound to (:func:`chunk_namespace`: model, ranks, chunk size, salt).
        secret: a deployment secret: the chain is then keyed (HMAC-SHA256), so that nobody without
            the secret can compute or confirm a key; without one it is plain SHA-256.

    Returns:
        64-digit hex SHA-256 keys, the same in every process and on every machine.

    Raises:
        KVGroupsError: a chunk size below 1, or token ids outside ``[0, 2**32)``.
        TypeError: token ids that are not a 1-D sequence of ints, or a namespace that is not str/bytes.
    """
    int_at_least("chunk_size", chunk_size, 1)
    if isinstance(namespace, str):
        namespace = namespace.encode("utf-8")
    if not isinstance(namespace, bytes):
        raise TypeError(f"namespace must be a str or bytes, got {type(namespace).__name__}")
    tokens = token_array(token_ids).tobytes()
    chunk_bytes = chunk_size * 4
    root = b"kvgroups-prefix-root\0" + namespace
    keys = []
    if secret is None:
        digest = hashlib.sha256(root).digest()
        for start in range(0, len(tokens) - chunk_bytes + 1, chunk_bytes):
            digest = hashlib.sha256(digest + tokens[start:start + chunk_bytes]).digest()
            keys.append(digest.hex())
        return keys
    digest = secret.chain(b"", root)
    for start in range(0, len(tokens) - chunk_bytes + 1, chunk_bytes):
        digest = secret.chain(digest, tokens[start:start + chunk_bytes])
        keys.append(digest.hex())
    return keys


def checked_keys(keys: Sequence[str]) -> list[str]:
    """Prefix keys a caller passed (as :func:`prefix_keys` made them), as a list; TypeError otherwise."""
    if isinstance(keys, str) or not all(isinstance(key, str) for key in keys):
        raise TypeError("keys must be a sequence of str, as keys() returns them")
    return list(keys)


def boundary_keys(token_ids: TokenIds | None, keys: Sequence[str] | None, num_tokens: int, chunk_size: int,
                  make_keys: Callable[[np.ndarray], list[str]]) -> list[str]:
    """The keys of the chunks up to boundary ``num_tokens``: of the keys given, else made of the tokens
    given; raises when the boundary is not a chunk boundary within them."""
    if not is_int_at_least(num_tokens, 0) or num_tokens % chunk_size:
        raise KVGroupsError(f"num_tokens {num_tokens!r} must be a multiple of chunk_size {chunk_size}")
    if keys is not None:
        keys = checked_keys(keys)
        if num_tokens > len(keys) * chunk_size:
            raise KVGroupsError(f"num_tokens {num_tokens} is beyond the {len(keys)} keys given")
        return keys[: num_tokens // chunk_size]
    tokens = token_array(token_ids) if token_ids is not None else None
    if tokens is None or num_tokens > len(tokens):
        raise KVGroupsError(f"num_tokens {num_tokens} is beyond the {'no' if tokens is None else len(tokens)} "
                            f"tokens given")
    return make_keys(tokens[:num_tokens])
