"""``kvgroups inspect --plot``: the plotted series are the JSON report's numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvgroups.cli import main
from kvgroups.cli.plot import plot_series, write_plot
from tests.support.paths import ROOT

pytest.importorskip("matplotlib")


def report(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["inspect", *argv, "--json"]) == 0
    data: dict[str, Any] = json.loads(capsys.readouterr().out)
    return data


def held(spec: dict[str, Any], tokens: int, block: int) -> int:
    """Token slots a group holds for one sequence, in whole blocks, written out from the README's rules."""
    if "window_tokens" in spec:
        tokens = min(tokens, -(-spec["window_tokens"] // block) * block + block)
    elif "chunk_tokens" in spec:
        tokens = min(tokens, -(-spec["chunk_tokens"] // block) * block)
    return -(-tokens // block) * block


@pytest.mark.parametrize("argv", [
    ["gemma-4-26b-a4b", "--tp", "2", "--memory", "24", "--seqs", "4", "--tokens", "100000"],
    ["qwen3.5-35b-a3b", "--seqs", "3", "--tokens", "4096"],
    ["llama-3.2-11b-vision", "--images", "2", "--memory", "16", "--tokens", "8192"],
    ["llama-4-scout-17b-16e-instruct", "--tp", "8", "--block-size", "32", "--tokens", "70000"],
])
def test_plotted_series_are_the_json_numbers(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    data = report(capsys, *argv)
    series = plot_series(data)
    engine, groups = data["engine"], data["groups"]
    seqs, block = engine["seqs"], engine["block_size"]
    assert series.tokens[0] == block and series.tokens[-1] == data["max_position_embeddings"]
    assert engine["tokens"] in series.tokens
    cross = data["cross_attention"]
    images = [cross["bytes_per_sequence"]] if cross and cross["bytes_per_sequence"] else []
    assert len(series.areas) == len(groups) + len(images)
    for index, tokens in enumerate(series.tokens):
        for group, area in zip(groups, series.areas, strict=False):
            tokens_held = 0 if group["kind"] == "recurrent" else held(group["spec"], tokens, block)
            assert area[index] == seqs * (tokens_held * group["bytes_per_token"] + group["bytes_per_sequence"])
        for extra, area in zip(images, series.areas[len(groups):], strict=True):
            assert area[index] == seqs * extra
        full = sum(-(-tokens // block) * block * group["bytes_per_token"] + group["bytes_per_sequence"]
                   for group in groups)
        assert series.all_full[index] == seqs * (full + sum(images))
    at = series.tokens.index(engine["tokens"])
    assert sum(area[at] for area in series.areas) == data["capacity"]["tokens"]["bytes_per_rank"]
    assert series.all_full[at] == data["capacity"]["tokens"]["bytes_per_rank_all_full"]
    memory = data["capacity"]["memory"]
    assert series.budget == (memory["budget_bytes_per_rank"] if memory else None)


def test_the_figure_draws_those_series(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    data = report(capsys, "nemotron-3-nano-30b-a3b", "--memory", "8", "--seqs", "8", "--tokens", "65536")
    series = plot_series(data)
    figure = write_plot(data, str(tmp_path / "n.svg"))
    (axes,) = figure.axes
    assert len(axes.collections) == len(data["groups"]) == 3  # one stacked area per group
    tops = [max(vertex[1] for vertex in collection.get_paths()[0].vertices) for collection in axes.collections]
    gib = 1 << 30
    stacked = [sum(area[-1] for area in series.areas[: index + 1]) / gib for index in range(3)]
    assert tops == pytest.approx(stacked)
    full_line, budget_line = axes.lines
    assert list(full_line.get_xdata()) == series.tokens
    assert list(full_line.get_ydata()) == pytest.approx([value / gib for value in series.all_full])
    assert list(budget_line.get_ydata()) == pytest.approx([8.0, 8.0])
    assert (tmp_path / "n.svg").read_text().startswith("<?xml")


def test_plot_option_writes_png_and_keeps_stdout_for_results(capsys: pytest.CaptureFixture[str],
                                                             tmp_path: Path) -> None:
    target = tmp_path / "gemma.png"
    assert main(["inspect", "gemma-3-27b-it", "--tp", "2", "--memory", "4", "--plot", str(target)]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "gemma-3-27b-it (gemma3_text" in captured.out
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["inspect", "gemma-3-27b-it", "--plot", str(tmp_path / "missing" / "g.png")]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_the_documented_picture_is_the_documented_command() -> None:
    documentation = (ROOT / "docs" / "inspect.md").read_text()
    command = "kvgroups inspect gemma-4-26b-a4b --tp 2 --memory 24 --seqs 4 --plot docs/gemma-4-26b-a4b-plot.png"
    assert f"`{command}`" in documentation and "(gemma-4-26b-a4b-plot.png)" in documentation
    picture = ROOT / "docs" / "gemma-4-26b-a4b-plot.png"
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
