"""A temporary directory of its own for each engine or server a test starts, removed once it has stopped.

vLLM leaves files in the temporary directory of every process it starts and does not always remove them: a unix
socket per ZMQ channel (``VLLM_RPC_BASE_PATH``, by default the temporary directory) and a rendezvous file per engine
(``vllm_dist_*``); a suite of dozens of engines left hundreds in /tmp, run after run. Given ``TMPDIR`` of its own,
short enough for a unix socket's path (108 bytes), an engine's files go with its directory.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def scratch_directory() -> Iterator[str]:
    """A fresh directory under the system's temporary directory (``/tmp/kvg-XXXXXXXX``), removed after use."""
    directory = tempfile.mkdtemp(prefix="kvg-")
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)
