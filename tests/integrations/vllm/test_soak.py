"""The soak's three-minute version (``python -m benchmarks.soak.run --quick``): two ``vllm serve`` on one cluster,
every fault once, every invariant checked; a broken one fails this test with the soak's own words."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import ROOT


@pytest.mark.skipif(os.geteuid() != 0, reason="the soak mounts tmpfs file tiers, which needs root")
def test_two_servers_on_one_cluster_answer_right_through_every_fault(tmp_path: Path) -> None:
    report = tmp_path / "soak.json"
    output = tmp_path / "soak.log"
    with open(output, "wb") as log:
        soak = subprocess.Popen([sys.executable, "-m", "benchmarks.soak.run", "--quick", "--json", str(report)],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = soak.wait(timeout=900)
        except subprocess.TimeoutExpired:
            # Interrupted, the soak stops its servers and cluster, unmounts its file tiers and reports what ran;
            # killed, it would leave them all behind.
            soak.send_signal(signal.SIGINT)
            code = soak.wait(timeout=180)
    said = output.read_text(errors="replace")
    assert code == 0, said[-8000:]
    result = json.loads(report.read_text())
    assert [row["fault"] for row in result["faults"]] == [
        "master killed", "node stopped", "cluster full", "file tier full", "entries corrupted", "entries deleted",
        "store unwritable", "server killed"]
    assert result["problems"] == [] and result["failed"] == 0 and result["differ"] == 0
    assert all(row["hits back after s"] is not None for row in result["faults"]), result["faults"]
    assert sum(row["store hit tokens"] for row in result["faults"]) > 0  # the store served, not only vLLM's cache
    assert result["requests"] >= 200
