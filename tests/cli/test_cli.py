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
from kvgroups.models.presets import load_model_config, preset_names
from tests.support.paths import CONFIGS, ROOT


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


INSPECT_DOCS = (ROOT / "docs" / "inspect.md").read_text()
# The warnings the inspect reference documents (its Warnings section lists each one).
DOCUMENTED_WARNINGS = re.findall(r"^- warning: `(.+?)`", INSPECT_DOCS, flags=re.MULTILINE)


@pytest.mark.parametrize("tp", ["1", "2", "8"])
@pytest.mark.parametrize("name", preset_names())
def test_every_preset_inspects(capsys: pytest.CaptureFixture[str], name: str, tp: str) -> None:
    code, out, err = run_main(capsys, "inspect", name, "--tp", tp, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["engine"]["tp"] == int(tp)
    assert report["groups"] and report["totals"]["bytes_per_token_per_rank"] >= 0
    assert err.splitlines() == [f"kvgroups: warning: {warning}" for warning in report["warnings"]]
    assert all(warning in DOCUMENTED_WARNINGS for warning in report["warnings"]), report["warnings"]
    table_code, table, table_err = run_main(capsys, "inspect", name, "--tp", tp)
    assert (table_code, table_err) == (0, err) and "warning" not in table


def test_the_documented_warnings_are_read() -> None:
    assert "config has no torch_dtype; assuming bfloat16" in DOCUMENTED_WARNINGS and len(DOCUMENTED_WARNINGS) >= 4


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


@pytest.mark.parametrize("name", ["nemotron-h-56b-base-8k", "llama-3.2-11b-vision"])
def test_json_keys_are_the_documented_ones(capsys: pytest.CaptureFixture[str], name: str) -> None:
    _, out, _ = run_main(capsys, "inspect", name, "--memory", "8", "--tokens", "4096", "--images", "1", "--json")
    report = json.loads(out)
    documented = set(re.findall(r"^\| `([a-z_.\[\]]+)`", INSPECT_DOCS, flags=re.MULTILINE))
    keys = set(report) | {f"engine.{k}" for k in report["engine"]} | {f"totals.{k}" for k in report["totals"]}
    keys |= {f"groups[].{k}" for k in report["groups"][0]} | {f"layers.{k}" for k in report["layers"]}
    keys |= {f"capacity.memory.{k}" for k in report["capacity"]["memory"]}
    keys |= {f"capacity.tokens.{k}" for k in report["capacity"]["tokens"]}
    keys |= {f"cross_attention.{k}" for k in report["cross_attention"] or {}}
    assert keys <= documented, sorted(keys - documented)


def test_model_directory_and_path(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256,
              "num_key_value_heads": 2, "torch_dtype": "float16"}
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    (tmp_path / "other.json").write_text(json.dumps(config))
    # The JSON "model" is the preset name, the directory's name, or the file's name without .json
    # (for a file named config.json: its directory's name), as docs/inspect.md says.
    for target, name in ((str(model), "my-model"), (str(model / "config.json"), "my-model"),
                         (str(tmp_path / "other.json"), "other"), ("llama-3.1-8b", "llama-3.1-8b")):
        code, out, _ = run_main(capsys, "inspect", target, "--json")
        assert code == 0
        report = json.loads(out)
        assert report["model"] == name
        if target != "llama-3.1-8b":
            assert report["totals"]["bytes_per_token_per_rank"] == 2 * 2 * 2 * 64 * 2


def test_presets_lists_every_bundled_config(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(capsys, "presets", "--json")
    assert code == 0
    assert [row["name"] for row in json.loads(out)] == preset_names()
    code, out, _ = run_main(capsys, "presets")
    assert code == 0 and "qwen3-next-80b-a3b-thinking" in out


LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256,
         "num_key_value_heads": 2, "torch_dtype": "bfloat16"}


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvgroups.cli", *argv], capture_output=True, text=True, timeout=120, check=False
    )


def bad_inputs(tmp: Path) -> list[tuple[list[str], str]]:
    (tmp / "bad.json").write_text('{"model_type": "llama",')
    (tmp / "list.json").write_text("[1, 2]")
    (tmp / "fields.json").write_text('{"model_type": "llama", "num_hidden_layers": 2, "torch_dtype": "bfloat16"}')
    (tmp / "empty").mkdir()
    (tmp / "blank.json").write_text("\n")
    (tmp / "braces.json").write_text("{}")
    (tmp / "int8.json").write_text(json.dumps({**LLAMA, "torch_dtype": "int8"}))
    mamba = load_model_config("falcon-mamba-7b").config
    (tmp / "int8-mamba.json").write_text(json.dumps({**mamba, "torch_dtype": "int8"}))
    (tmp / "new.json").write_text(json.dumps({**LLAMA, "model_type": "brand_new"}))
    return [
        (["inspect", str(tmp / "blank.json")], "the file is empty; expected a Hugging Face config.json"),
        (["inspect", str(tmp / "braces.json")], "the config is an empty JSON object"),
        (["inspect", str(tmp / "int8.json")], "config torch_dtype 'int8' cannot hold a KV cache"),
        (["inspect", str(tmp / "int8-mamba.json"), "--kv-dtype", "bfloat16"],
         "config torch_dtype 'int8' cannot hold a recurrent state"),
        (["inspect", str(tmp / "new.json"), "--assume", "nope"], "argument --assume: invalid choice: 'nope'"),
        (["inspect", "llama-3.1-8b", "--plot", "out.pdf"], "expected a .png or .svg file name, got 'out.pdf'"),
        (["inspect", "llama-3.1-8b", "--images", "-1"], "argument --images: expected an integer >= 0"),
        (["inspect", "nemotron-h-56b-base-8k", "--tp", "16"], "n_groups=8 does not split over --tp 16"),
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
        (["inspect", "llama-3.1-8b", "--ssm-state-dtype", "fp8"], "argument --ssm-state-dtype: invalid choice"),
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


def _jamba_as(model_type: str) -> dict[str, Any]:
    config = json.loads((ROOT / "src/kvgroups/models/presets/jamba-1.5-mini.json").read_text())
    return {**config, "model_type": model_type}


# Configs that kvgroups must refuse rather than read wrong: (file contents, argv after the path, message).
REFUSALS: list[tuple[str, dict[str, Any], list[str], str]] = [
    ("unknown type", {**LLAMA, "model_type": "brand_new"}, [],
     "model_type 'brand_new' is not supported; supported: afmoe, apertus, "),
    ("unknown jamba-like type", _jamba_as("jamba2"), [], "model_type 'jamba2' is not supported"),
    ("no model_type", {key: value for key, value in LLAMA.items() if key != "model_type"}, [],
     "the config has no model_type; supported: "),
    ("jamba fields under llama", _jamba_as("llama"), [],
     "config fields ['attn_layer_offset', 'attn_layer_period', 'mamba_conv_bias', 'mamba_d_conv', 'mamba_d_state', "
     "'mamba_dt_rank', 'mamba_expand'] change what the layers cache, and the llama reader does not read them"),
    ("jamba fields, --assume llama", _jamba_as("jamba2"), ["--assume", "llama"],
     "change what the layers cache, and the llama reader does not read them; refusing to guess (model_type 'jamba2')"),
    ("hybrid pattern under qwen2", {**LLAMA, "model_type": "qwen2", "hybrid_layer_pattern": [0, 1],
                                    "swa_num_key_value_heads": 8, "swa_head_dim": 64}, [],
     "config fields ['hybrid_layer_pattern', 'swa_head_dim', 'swa_num_key_value_heads'] change what the layers cache"),
    ("cross-attention under llama", {**LLAMA, "cross_attention_layers": [1]}, [], "['cross_attention_layers']"),
    ("indexer under deepseek_v3", {**LLAMA, "model_type": "deepseek_v3", "kv_lora_rank": 512,
                                   "qk_rope_head_dim": 64, "index_head_dim": 128, "index_n_heads": 64}, [],
     "config fields ['index_head_dim', 'index_n_heads'] change what the layers cache, and the deepseek_v3 reader"),
    ("latent under mistral", {**LLAMA, "model_type": "mistral", "kv_lora_rank": 512}, [], "['kv_lora_rank']"),
    ("ssm dtype under qwen2", {**LLAMA, "model_type": "qwen2", "mamba_ssm_cache_dtype": "float32"}, [],
     "['mamba_ssm_cache_dtype']"),
    ("linear attention under llama", {**LLAMA, "linear_num_key_heads": 16}, [], "['linear_num_key_heads']"),
    ("global heads under gemma3", {**LLAMA, "model_type": "gemma3_text", "global_head_dim": 512}, [],
     "['global_head_dim']"),
    ("a pattern under llama", {**LLAMA, "layer_pattern": "LLG"}, [], "['layer_pattern']"),
    ("falcon_h1 without mamba_d_ssm",
     json.loads((CONFIGS / "falcon-h1-0.5b.json").read_text()), [],
     "mamba_n_heads * mamba_d_head = 24 * 64 = 1536 differs from mamba_d_ssm (default)=1024"),
]


def test_a_state_dtype_is_resolved_only_for_models_that_keep_a_state(capsys: pytest.CaptureFixture[str],
                                                                      tmp_path: Path) -> None:
    """An attention-only config whose torch_dtype cannot hold a recurrent state is read with --kv-dtype."""
    (tmp_path / "int8.json").write_text(json.dumps({**LLAMA, "torch_dtype": "int8"}))
    code, out, err = run_main(capsys, "inspect", str(tmp_path / "int8.json"), "--kv-dtype", "bfloat16", "--json")
    assert (code, err) == (0, "")
    engine = json.loads(out)["engine"]
    assert engine["kv_dtype"] == "bfloat16"
    assert engine["state_dtype"] is engine["conv_state_dtype"] is engine["ssm_state_dtype"] is None


def test_refusals_exit_2_with_one_line_and_nothing_on_stdout(tmp_path: Path) -> None:
    argvs = []
    for index, (_, config, extra, _) in enumerate(REFUSALS):
        path = tmp_path / f"refused{index}.json"
        path.write_text(json.dumps(config))
        argvs.append(["inspect", str(path), *extra])
    driven = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(argvs)],
                            capture_output=True, text=True, timeout=300, check=True)
    assert driven.stderr == ""
    for (what, _, _, expected), (code, out, err) in zip(REFUSALS, json.loads(driven.stdout), strict=True):
        assert (code, out) == (2, ""), (what, err)
        assert len(err.splitlines()) == 1 and err.startswith("kvgroups: error: ") and expected in err, (what, err)


def test_assume_reads_an_unknown_type_with_a_warning(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, "model_type": "brand_new"}))
    code, out, err = run_main(capsys, "inspect", str(path), "--assume", "llama", "--json")
    assert code == 0
    warning = "model_type 'brand_new' is not supported; read as llama (--assume llama), a guess"
    assert err == f"kvgroups: warning: {warning}\n"
    assert json.loads(out)["warnings"] == [warning]
    assert json.loads(out)["totals"]["bytes_per_token_per_rank"] == 2 * 2 * 2 * 64 * 2


def test_warnings_go_to_stderr_never_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(capsys, "inspect", "llama-3.1-8b", "--tokens", "200000")
    assert code == 0 and "warning" not in out
    assert err == "kvgroups: warning: --tokens 200000 is beyond the model's context (max_position_embeddings 131072)\n"
    _, out, err = run_main(capsys, "inspect", "llama-3.1-8b", "--images", "2", "--json")
    assert json.loads(out)["warnings"] == ["--images / --image-tokens ignored: the model has no cross-attention layers"]
    assert err.count("\n") == 1


def test_a_normal_inspect_prints_nothing_on_stderr() -> None:
    """Through the real entry point, in a fresh interpreter: no library log lines, no NumPy warning from torch."""
    result = cli("inspect", "qwen3-next-80b-a3b-thinking", "--tp", "2", "--memory", "8")
    assert (result.returncode, result.stderr) == (0, "")
    assert "qwen3-next-80b-a3b-thinking (qwen3_next" in result.stdout


def test_bare_command_prints_usage(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(capsys)
    assert (code, out) == (2, "")
    assert err.startswith("usage: kvgroups") and "inspect" in err and "presets" in err


def test_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["inspect", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for option, default in (("--layout", "(default flash-attn)"), ("--chunk-size", "(default 256)"),
                            ("--block-size", "(default 16)"), ("--images", "(default 0)"),
                            ("--state-dtype", "(default auto)")):
        assert default in text.split(option, 2)[2][:400], option
