"""A benchmark never drops a variant it could not run: the row says why and the run exits 1."""

from __future__ import annotations

import subprocess
import sys

from benchmarks.support.unmeasured import Unmeasured
from tests.support.paths import ROOT

# Runs benchmarks.store.macs with the blake3 package unimportable, as on a machine without it.
WITHOUT_BLAKE3 = """
import runpy, sys
sys.modules["blake3"] = None
sys.argv = ["macs", "--rounds", "2"]
runpy.run_module("benchmarks.store.macs", run_name="__main__", alter_sys=True)
"""


def test_a_reference_that_cannot_run_is_a_row_saying_why_and_the_run_fails() -> None:
    completed = subprocess.run([sys.executable, "-c", WITHOUT_BLAKE3], cwd=ROOT, capture_output=True, text=True,
                               timeout=300, check=False, env={"PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"})
    assert completed.returncode == 1, completed.stderr
    rows = completed.stdout.splitlines()
    assert any(row.startswith("| AES-256-GCM GMAC (ours) | ") for row in rows)  # what could run, ran
    assert "| keyed BLAKE3 | NOT MEASURED: blake3 not importable (" in completed.stdout
    assert "1 variant(s) not measured:\n  keyed BLAKE3: blake3 not importable" in completed.stderr


def test_what_cannot_exist_on_this_platform_is_a_row_that_does_not_fail_the_run() -> None:
    unmeasured = Unmeasured()
    row = unmeasured.row("vLLM OffloadingConnector (CPU tier)", "Exception: CPU Offloading is\n only on GPUs",
                         columns=4, available_elsewhere=True)  # (a line break in an error: one table row)
    assert row == ("| vLLM OffloadingConnector (CPU tier) | not on this platform: Exception: CPU Offloading is "
                   "only on GPUs |  |  |")
    unmeasured.exit()  # returns: nothing that could run here failed
    assert unmeasured.row("no connector", "ValueError: no KV space", columns=3) == \
        "| no connector | NOT MEASURED: ValueError: no KV space |  |"
    try:
        unmeasured.exit()
    except SystemExit as error:
        assert error.code == 1
    else:
        raise AssertionError("a variant not measured must fail the run")
