"""The kvgroups command: every preset inspects, table and JSON agree, bad input exits 2 in one line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvgroups.cli import main
from kvgroups.models.presets import preset_names


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("tp", ["1", "2", "8"])
@pytest.mark.parametrize("name", preset_names())
def test_every_preset_inspects(capsys: pytest.CaptureFixture[str], name: str, tp: str) -> None:
    code, out, err = run_main(capsys, "inspect", name, "--tp", tp, "--json")
    assert (code, err) == (0, "")
    report = json.loads(out)
    assert report["engine"]["tp"] == int(tp)
    assert report["groups"] and report["totals"]["bytes_per_token_per_rank"] >= 0


def numbers(text: str) -> list[int]:
    return [int(token.replace(",", "")) for token in re.findall(r"(?<![\w.])\d[\d,]*(?![\w.])", text)]


@pytest.mark.parametrize("name", ["qwen3-next-80b-a3b-thinking", "gemma-3-27b-it", "deepseek-v3"])
def test_table_and_json_carry_the_same_numbers(capsys: pytest.CaptureFixture[str], name: str) -> None:
    args = ["inspect", name, "--tp", "2", "--memory", "6", "--tokens", "65536", "--seqs", "4"]
    _, table, _ = run_main(capsys, *args)
    _, out, _ = run_main(capsys, *args, "--json")
    report: dict[str, Any] = json.loads(out)
    shown = numbers(table)
    for group in report["groups"]:
        for key in ("hidden_dim_size", "bytes_per_token", "bytes_per_sequence", "chunk_bytes"):
            assert group[key] in shown, (key, group[key])
        assert "[" + ", ".join(map(str, group["chunk_shape"])) + "]" in table
        assert "[" + ", ".join(map(str, group["tensor_shape"])) + "]" in table
    totals = report["totals"]
    for key in ("bytes_per_token_per_rank", "bytes_per_token_all_ranks", "state_bytes_per_sequence_per_rank",
                "state_bytes_per_sequence_all_ranks", "bytes_per_chunk_per_rank"):
        assert totals[key] in shown, key
    assert totals["fingerprint"] in table
    memory, tokens = report["capacity"]["memory"], report["capacity"]["tokens"]
    for value in (memory["tokens_per_sequence"], memory["tokens_per_sequence_all_full"],
                  tokens["bytes_per_rank"], tokens["bytes_all_ranks"], tokens["bytes_per_rank_all_full"]):
        assert value in shown, value


def test_json_keys_are_the_documented_ones(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run_main(capsys, "inspect", "nemotron-h-56b-base-8k", "--memory", "8", "--tokens", "4096", "--json")
    report = json.loads(out)
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    documented = set(re.findall(r"^\| `([a-z_.\[\]]+)`", readme, flags=re.MULTILINE))
    keys = set(report) | {f"engine.{k}" for k in report["engine"]} | {f"totals.{k}" for k in report["totals"]}
    keys |= {f"groups[].{k}" for k in report["groups"][0]} | {f"layers.{k}" for k in report["layers"]}
    keys |= {f"capacity.memory.{k}" for k in report["capacity"]["memory"]}
    keys |= {f"capacity.tokens.{k}" for k in report["capacity"]["tokens"]}
    assert keys <= documented, sorted(keys - documented)


def test_model_directory_and_path(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256,
              "num_key_value_heads": 2, "torch_dtype": "float16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for target in (str(tmp_path), str(tmp_path / "config.json")):
        code, out, _ = run_main(capsys, "inspect", target, "--json")
        assert code == 0
        assert json.loads(out)["totals"]["bytes_per_token_per_rank"] == 2 * 2 * 2 * 64 * 2


def test_presets_lists_every_bundled_config(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(capsys, "presets", "--json")
    assert code == 0
    assert [row["name"] for row in json.loads(out)] == preset_names()
    code, out, _ = run_main(capsys, "presets")
    assert code == 0 and "qwen3-next-80b-a3b-thinking" in out


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvgroups.cli", *argv], capture_output=True, text=True, timeout=120, check=False
    )


def bad_inputs(tmp: Path) -> list[tuple[list[str], str]]:
    (tmp / "bad.json").write_text('{"model_type": "llama",')
    (tmp / "list.json").write_text("[1, 2]")
    (tmp / "fields.json").write_text('{"model_type": "llama", "num_hidden_layers": 2, "torch_dtype": "bfloat16"}')
    (tmp / "empty").mkdir()
    return [
        (["inspect", str(tmp / "missing.json")], "no such preset or file"),
        (["inspect", str(tmp / "empty")], "directory has no config.json"),
        (["inspect", str(tmp / "bad.json")], "not valid JSON"),
        (["inspect", str(tmp / "list.json")], "must be a JSON object"),
        (["inspect", str(tmp / "fields.json")], "lacks fields ['num_attention_heads', 'hidden_size']"),
        (["inspect", "llama-3.1-8b", "--tp", "3"], "num_kv_heads=8 splits neither way over --tp 3"),
        (["inspect", "qwen3-next-80b-a3b-thinking", "--tp", "32"], "linear_num_key_heads=16 does not split"),
        (["inspect", "llama-3.1-8b", "--tp", "2", "--rank", "2"], "--rank must be in [0, --tp=2), got 2"),
        (["inspect", "llama-3.1-8b", "--tp", "0"], "argument --tp: expected a positive integer, got '0'"),
        (["inspect", "llama-3.1-8b", "--memory", "-1"], "argument --memory"),
        (["inspect", "llama-3.1-8b", "--memory", "0.000001"], "holds not even one block"),
        (["inspect", "llama-3.1-8b", "--kv-dtype", "int4"], "argument --kv-dtype: invalid choice"),
        (["inspect"], "the following arguments are required: model"),
        (["frobnicate"], "invalid choice"),
        (["store", "stats", "s3://bucket/kv"], "unknown scheme 's3'"),
        (["store", "verify", "memory://?max_bytes=lots"], "max_bytes='lots' is not a size"),
        (["store", "clear", "redis://127.0.0.1:1/0?timeout=0.2"], "cannot SCAN"),
        (["store", "stats", f"file://{tmp}/bad.json"], "cannot open the file store"),
        (["store"], "the following arguments are required"),
    ]


# Runs main() on each argv in one fresh interpreter, with its own stdout and stderr each time: what
# a user sees, without paying an interpreter start (and a torch import) per case.
DRIVER = """
import contextlib, io, json, sys
from kvgroups.cli.main import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit:
            code = exit.code
    results.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def test_bad_input_exits_2_with_one_line(tmp_path: Path) -> None:
    cases = bad_inputs(tmp_path)
    first = cli(*cases[0][0])  # one through the real entry point: its exit code and stderr
    assert (first.returncode, first.stdout) == (2, "") and first.stderr.count("\n") == 1
    driven = subprocess.run([sys.executable, "-c", DRIVER, json.dumps([argv for argv, _ in cases])],
                            capture_output=True, text=True, timeout=300, check=True)
    assert driven.stderr == ""
    for (argv, expected), (code, out, err) in zip(cases, json.loads(driven.stdout), strict=True):
        assert code == 2, (argv, err)
        assert out == ""
        lines = err.splitlines()
        assert len(lines) == 1, (argv, err)
        assert lines[0].startswith("kvgroups: error: ") and expected in lines[0], (argv, lines[0])
        assert "Traceback" not in err
