"""The README's and docs/' code runs and says what it prints: every fenced block names the test that
runs it (``<!-- tested: tests/FILE.py::TEST -->`` on the line before), and these tests run theirs."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kvgroups import LayerKind
from kvgroups.cli import main
from tests.support import stages

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!-- tested: (?P<path>tests/[\w/]+\.py)::(?P<test>\w+) -->")


@dataclass(frozen=True)
class Block:
    document: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    tested_by: str | None  # "tests/FILE.py::TEST"

    @property
    def where(self) -> str:
        return f"{self.document.relative_to(ROOT)}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for document in DOCUMENTS:
        lines = document.read_text(encoding="utf-8").splitlines()
        index = 0
        while index < len(lines):
            if lines[index].startswith("```"):
                end = next(at for at in range(index + 1, len(lines)) if lines[at].startswith("```"))
                marker = MARKER.fullmatch(lines[index - 1]) if index else None
                tested_by = f"{marker['path']}::{marker['test']}" if marker else None
                code = "\n".join(lines[index + 1:end]) + "\n"
                found.append(Block(document, index + 1, lines[index][3:].strip(), code, tested_by))
                index = end
            index += 1
    return found


def claimed(test: str) -> list[Block]:
    """The blocks whose marker names ``tests/test_docs.py::test`` (at least one)."""
    mine = [block for block in blocks() if block.tested_by == f"tests/test_docs.py::{test}"]
    assert mine, f"no block names {test}"
    return mine


def test_every_block_names_a_test_that_exists() -> None:
    unclaimed = [block.where for block in blocks() if block.tested_by is None]
    assert unclaimed == [], "these blocks name no test"
    for block in blocks():
        path, test = str(block.tested_by).split("::")
        source = (ROOT / path).read_text(encoding="utf-8")
        assert re.search(rf"^def {test}\(", source, flags=re.MULTILINE), f"{block.where}: {block.tested_by}"


def test_every_test_a_document_names_exists() -> None:
    """The promises in the README and docs name the tests that hold them: each of those exists."""
    named = {(document, match) for document in DOCUMENTS
             for match in re.findall(r"`(tests/[\w/]+\.py::\w+)`", document.read_text(encoding="utf-8"))}
    assert named
    for document, reference in named:
        path, test = reference.split("::")
        source = (ROOT / path).read_text(encoding="utf-8")
        assert re.search(rf"^def {test}\(", source, flags=re.MULTILINE), f"{document.name}: {reference}"


def test_the_readme_is_short() -> None:
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 250


def test_the_quickstart_commands_are_the_makefile_targets() -> None:
    (block,) = claimed("test_the_quickstart_commands_are_the_makefile_targets")
    commands = [line.split("#")[0].strip() for line in block.code.splitlines() if line.split("#")[0].strip()]
    assert commands == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    demo = re.search(r"^demo:.*\n((?:\t.*\n)+)", makefile, flags=re.MULTILINE)
    test = re.search(r"^test:.*\n((?:\t.*\n)+)", makefile, flags=re.MULTILINE)
    assert demo and "examples/prefix_reuse_demo.py" in demo.group(1)
    # make test runs the stages tests/support/stages.py names, each a target of the Makefile.
    assert test and "tests/support/stages.py" in test.group(1)
    recipes = "".join(recipe(makefile, stage.target) for group in stages.GROUPS for stage in group)
    assert all(tool in recipes for tool in ("ruff check", "mypy", "pytest", "tests/integrations/vllm",
                                            "tests/integrations/sglang", "test_soak.py"))
    assert "make test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def recipe(makefile: str, target: str) -> str:
    """The recipe of ``target`` (for a pattern rule written with $(1), the line's own)."""
    found = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", makefile, flags=re.MULTILINE)
    if found is None:  # test-vllm033 and test-vllm034: one rule made per release line
        found = re.search(r"^test-vllm\$\(1\):.*\n((?:\t.*\n)+)", makefile, flags=re.MULTILINE)
        assert found is not None and target.removeprefix("test-vllm") in makefile, target
    return found.group(1)


def test_the_readme_names_every_stage_and_its_command() -> None:
    """The README's table of ``make test``'s stages is the stage runner's: every stage, in its group, with the
    command that runs it alone; and the test time it states is the groups' times added up, within 15 minutes."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    start = readme.index("<!-- stages: tests/test_docs.py::test_the_readme_names_every_stage_and_its_command -->")
    rows = []
    for line in readme[start + 3:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    *listed, total = rows
    expected = [(str(number), stage.name, f"`{' '.join(['make', *stage.command([])])}`", stage.what)
                for number, group in enumerate(stages.GROUPS, 1) for stage in group]
    assert [(group, name, command, what) for group, name, command, _, what in listed] == expected
    seconds = {(group, name): int(row_seconds) for group, name, _, row_seconds, _ in listed}
    slowest_of_each_group = sum(max(time for (group, _), time in seconds.items() if group == str(number))
                                for number in range(1, len(stages.GROUPS) + 1))
    assert total[1:3] == ["**test time**", "`make test`"]
    assert slowest_of_each_group <= int(total[3]) <= 15 * 60


def test_the_demo_prints_its_table(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo, at a fifth of its size: the table the README shows, each row reusing the shared prefix and
    answering as recomputing does."""
    pytest.importorskip("transformers")
    (block,) = claimed("test_the_demo_prints_its_table")
    spec = importlib.util.spec_from_file_location("prefix_reuse_demo", ROOT / "examples" / "prefix_reuse_demo.py")
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    monkeypatch.setattr(demo, "PROMPT", 384)
    monkeypatch.setattr(demo, "SHARED", 320)
    monkeypatch.setattr(demo, "CHUNK", 64)
    monkeypatch.setattr(demo, "NEW_TOKENS", 8)
    demo.main()
    printed = capsys.readouterr().out

    def rows(text: str) -> list[list[str]]:
        return [[cell.strip() for cell in line.strip("│┃").split("│" if "│" in line else "┃")]
                for line in text.splitlines() if line.startswith(("│", "┃"))]

    documented, shown = rows(block.code), rows(printed)
    assert shown[0][:-1] == documented[0][:-1] and shown[0][-1] == "8 tokens equal"
    for row in shown[1:]:
        if row[0].startswith(("llama", "qwen3-next")):
            assert (row[1], row[2], row[-1]) == ("320", "64", "yes"), row


def test_inspect_examples_print_what_the_docs_show(capsys: pytest.CaptureFixture[str]) -> None:
    for block in claimed("test_inspect_examples_print_what_the_docs_show"):
        command, *expected = block.code.splitlines()
        argv = shlex.split(command.removeprefix("$ "))
        assert argv[0] == "kvgroups", block.where
        assert main(argv[1:]) == 0, block.where
        printed = capsys.readouterr().out
        assert [line.rstrip() for line in printed.splitlines()] == [line.rstrip() for line in expected], block.where


def test_library_usage_block_runs_and_its_comments_hold() -> None:
    (block,) = claimed("test_library_usage_block_runs_and_its_comments_hold")
    namespace: dict[str, object] = {}
    exec(compile(block.code, block.where, "exec"), namespace)
    manager, metadata, other = namespace["manager"], namespace["metadata"], namespace["other"]
    assert manager.num_groups == 2  # type: ignore[attr-defined]
    assert manager.get_group_by_layer_idx(3).kind is LayerKind.FULL_ATTENTION  # type: ignore[attr-defined]
    assert metadata.get_shapes() == [torch.Size([2, 12, 256, 512])] * 2  # type: ignore[attr-defined]
    assert other.kv_layer_groups[0].hidden_dim_size == 512  # type: ignore[attr-defined]
    (mimo,) = namespace["mimo"].kv_layer_groups  # type: ignore[attr-defined]
    assert (mimo.head_size, mimo.value_head_size, mimo.chunk_shape(256)) == (192, 128, torch.Size([1, 1, 256, 1280]))


def test_data_path_block_runs() -> None:
    (block,) = claimed("test_data_path_block_runs")
    namespace: dict[str, object] = {}
    exec(compile(block.code, block.where, "exec"), namespace)
    chunk, kv_caches, transfer = namespace["chunk"], namespace["kv_caches"], namespace["transfer"]
    assert chunk.shape == (2, 4, 256, 1024) and chunk.dtype == torch.bfloat16  # type: ignore[attr-defined]
    assert transfer.kernels in (["numba"], ["torch"])  # type: ignore[attr-defined]
    moved = kv_caches["layers.3"][:, 32:48].reshape(2, 256, 1024)  # type: ignore[index]
    assert torch.equal(moved, chunk[:, 3])  # type: ignore[index]


def test_transformers_examples_run(tmp_path: Path) -> None:
    """Each PrefixCache block, run twice on one store: the second run reuses what the first saved."""
    pytest.importorskip("transformers")
    from tests.support.tiny_models import tiny_model

    model = tiny_model("llama", max_position_embeddings=1024)
    input_ids = torch.randint(3, 256, (600,), generator=torch.Generator().manual_seed(0))
    for block in claimed("test_transformers_examples_run"):
        code = block.code.replace("file:///var/cache/kv", f"file://{tmp_path}/{block.document.stem}")
        results = []
        for _ in range(2):
            namespace: dict[str, Any] = {"model": model, "input_ids": input_ids}
            exec(compile(code, block.where, "exec"), namespace)
            namespace["prefix_cache"].close()
            results.append(namespace)
        first, second = (namespace["result"] for namespace in results)
        assert (first.reused_tokens, first.computed_tokens) == (0, 600), block.where
        assert (second.reused_tokens, second.computed_tokens) == (512, 88), block.where
        assert torch.equal(results[1]["output_ids"], results[0]["output_ids"]), block.where
        assert results[0]["output_ids"].shape == (1, 632)


def test_store_example_runs(tmp_path: Path) -> None:
    """The store block on a file store that already holds chunks 0-2: its save of chunk 3 completes a
    1024-token prefix, which it looks up and loads exactly."""
    from kvgroups.store import KVChunkStore
    from tests.support.stored_chunks import build_metadata

    (block,) = claimed("test_store_example_runs")
    url = f"file://{tmp_path}/kv"
    metadata = build_metadata([("full", 0), ("sliding", 300)], chunk_size=256)
    token_ids = list(range(1100))
    generator = torch.Generator().manual_seed(0)
    every = [[torch.randn(group.chunk_shape(256), generator=generator).to(group.dtype)
              for group in metadata.kv_layer_groups_manager.kv_layer_groups] for _ in range(4)]
    with KVChunkStore(metadata, url, salt="tenant-a") as earlier:
        for chunk in range(3):
            earlier.save(token_ids, chunk, every[chunk])
    code = block.code.replace("file:///var/cache/kv", url)
    namespace: dict[str, Any] = {"metadata": metadata, "token_ids": token_ids, "chunks": every[3]}
    exec(compile(code, block.where, "exec"), namespace)
    assert len(namespace["keys"]) == 4 and namespace["boundary"] == 1024
    prefix = namespace["prefix"]
    assert prefix.num_tokens == 1024
    assert torch.equal(prefix.groups[0].tensor, torch.cat([chunks[0] for chunks in every], dim=2))
    assert prefix.groups[1].first_token == 512  # the sliding group reads its window's chunks only
    namespace["store"].close()


def test_metrics_example_runs() -> None:
    """The metrics block on a tiny llama: prompt B shares 3 of prompt A's 4 chunks of 8 tokens."""
    from tests.support.tiny_models import tiny_model

    (block,) = claimed("test_metrics_example_runs")
    generator = torch.Generator().manual_seed(0)
    prompt_a = torch.randint(3, 256, (33,), generator=generator)
    prompt_b = torch.cat([prompt_a[:24], torch.randint(3, 256, (9,), generator=generator)])
    namespace: dict[str, Any] = {"model": tiny_model("llama"), "prompt_a": prompt_a, "prompt_b": prompt_b}
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(block.code, block.where, "exec"), namespace)
    said = [line.split("#", 1)[1].strip() for line in block.code.splitlines() if line.strip().startswith("print(")]
    assert output.getvalue().splitlines() == said


if __name__ == "__main__":  # pragma: no cover - lists the blocks and who runs them
    for found in blocks():
        sys.stdout.write(f"{found.where}\t{found.language}\t{found.tested_by}\n")

