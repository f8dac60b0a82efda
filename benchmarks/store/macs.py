"""What sealing an entry's bytes costs per MiB on this CPU: the unkeyed checksum stored entries carry
without a secret, the GMAC they carry with one, and the other keyed functions that could replace it.

A secret's MAC must be a keyed cryptographic function; its cost over the checksum's is what a
sealed save or load pays (``benchmarks.store.tiers``'s ``file + MAC`` rows). Candidates, each over
the same 1 MiB (or ``--mib``) buffer, in turn round after round (A, B, C, ..., A, B, C, ...):

  xxh3-64            the checksum of unsealed entries (not a MAC: anyone can recompute it)
  AES-256-GCM GMAC   the store's MAC (the bytes as associated data)
  GMAC, 2 threads    the same split in two halves, the second on a waiting thread
  ChaCha20-Poly1305, Poly1305, HMAC-SHA256, keyed BLAKE2b, AES-OCB3 and AES-GCM-SIV (associated
  data only), keyed BLAKE3 (when the ``blake3`` package is installed; one thread and all cores)

Reported: the median time per MiB and the median over rounds of its ratio to the GMAC's time in
the same round (below 1.00: faster than the GMAC).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import queue
import statistics
import threading
import time
from collections.abc import Callable

import xxhash
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, AESGCMSIV, AESOCB3, ChaCha20Poly1305
from cryptography.hazmat.primitives.poly1305 import Poly1305

from benchmarks.support.unmeasured import Unmeasured

MISSING: dict[str, str] = {}  # the candidates that could not run here, and why


def candidates(data: memoryview) -> dict[str, Callable[[], object]]:
    key, nonce = os.urandom(32), os.urandom(12)
    gcm, chacha, ocb, siv = AESGCM(key), ChaCha20Poly1305(key), AESOCB3(key), AESGCMSIV(key)
    half = data.nbytes // 2
    jobs: queue.SimpleQueue[threading.Lock] = queue.SimpleQueue()
    tags: list[bytes] = []

    def helper() -> None:
        while True:
            done = jobs.get()
            tags.append(gcm.encrypt(nonce, b"", data[half:]))
            done.release()

    threading.Thread(target=helper, daemon=True).start()

    def gmac_two_threads() -> bytes:
        done = threading.Lock()
        done.acquire()
        jobs.put(done)
        first = gcm.encrypt(nonce, b"", data[:half])
        done.acquire()
        return first + tags.pop()

    functions: dict[str, Callable[[], object]] = {
        "xxh3-64 (no secret)": lambda: xxhash.xxh3_64_digest(data),
        "AES-256-GCM GMAC (ours)": lambda: gcm.encrypt(nonce, b"", data),
        "GMAC, 2 threads": gmac_two_threads,
        "ChaCha20-Poly1305": lambda: chacha.encrypt(nonce, b"", data),
        "Poly1305": lambda: Poly1305.generate_tag(key, data),
        "HMAC-SHA256": lambda: hmac.digest(key, data, "sha256"),
        "keyed BLAKE2b": lambda: hashlib.blake2b(data, key=key).digest(),
        "AES-OCB3": lambda: ocb.encrypt(nonce, b"", data),
        "AES-GCM-SIV": lambda: siv.encrypt(nonce, b"", data),
    }
    try:
        import blake3  # type: ignore[import-not-found]
    except ImportError as error:
        MISSING["keyed BLAKE3"] = f"blake3 not importable ({error}; pip install blake3)"
        return functions
    functions["keyed BLAKE3, 1 thread"] = lambda: blake3.blake3(data, key=key).digest()
    functions["keyed BLAKE3, all cores"] = lambda: blake3.blake3(data, key=key, max_threads=blake3.blake3.AUTO).digest()
    return functions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=1, help="buffer size in MiB (default 1)")
    parser.add_argument("--rounds", type=int, default=400)
    args = parser.parse_args()
    data = memoryview(bytearray(os.urandom(args.mib << 20)))
    functions = candidates(data)
    times: dict[str, list[float]] = {name: [] for name in functions}
    for function in functions.values():
        function()
    for _ in range(args.rounds):
        for name, function in functions.items():
            begin = time.perf_counter()
            function()
            times[name].append((time.perf_counter() - begin) / args.mib)
    gmac = times["AES-256-GCM GMAC (ours)"]
    print(f"| keyed function | ms per MiB ({args.mib} MiB buffer) | vs GMAC |")
    print("|---|---|---|")
    for name, values in times.items():
        ratio = statistics.median(value / base for value, base in zip(values, gmac, strict=True))
        print(f"| {name} | {statistics.median(values) * 1e3:.3f} | {ratio:.2f} |")
    unmeasured = Unmeasured()
    for name, reason in MISSING.items():
        print(unmeasured.row(name, reason, columns=3))
    unmeasured.exit()


if __name__ == "__main__":
    main()
