"""``make gpu-check``'s CPU part: its kernel rows (Triton interpreted against the torch path, every layout
the connector accepts) byte-exact, and without CUDA one line and exit 0."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from benchmarks.datapath import gpu_check


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton missing")
def test_the_kernel_rows_are_byte_exact_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.main(["--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "gpu-check on cpu (Triton interpreted)"
    rows = lines[2:]
    assert len(rows) == 11 and all(row.rstrip().endswith("byte-exact") for row in rows), rows


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: gpu-check runs for real")
def test_without_cuda_it_says_so_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.main([]) == 0
    assert capsys.readouterr().out == "gpu-check: no CUDA device here; nothing checked\n"
