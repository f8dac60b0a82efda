"""``make gpu-check``'s engine rows, run on vLLM's CPU build (CPU_ATTN) so that the script a GPU machine
runs is exercised here: two engine processes, one store, the same tokens and logprobs."""

from __future__ import annotations

import pytest

from benchmarks.datapath import gpu_check


def test_the_engine_row_reuses_a_prefix_across_processes_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.main(["--device", "cpu", "--engines", "llama"]) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("vLLM llama on CPU_ATTN")]
    assert "reuse from a 2nd process, chunk 64; TTFT of 300 tokens" in row
    assert "same tokens and logprobs; store hit " in row and " ms, vLLM prefix cache " in row, row


def test_a_row_that_cannot_run_says_why_and_fails_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks.integrations.vllm import gpu_engines

    def refuse(job: dict[str, object], *_: object) -> list[dict[str, object]]:
        raise RuntimeError("ValueError: no attention backend NOPE")

    monkeypatch.setattr(gpu_engines, "_run", refuse)
    monkeypatch.setattr("tests.integrations.vllm.tiny_vllm_models.save_model", lambda kind, directory: directory)
    rows = gpu_engines.engine_rows(("NOPE",), ("llama",))
    assert rows == [("vLLM llama on NOPE", "reuse from a second process", "NO: ValueError: no attention backend NOPE")]
    assert gpu_check._exit_code(rows) == 1
