"""``make test``'s stage runner (tests/support/stages.py) with a stand-in for make: stages of a group at once, each
one's time and result in the table, and a failed stage ends the run after its group."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.support import stages
from tests.support.stages import Stage

# A stand-in for make: "make -s --no-print-directory TARGET" sleeps and exits as the target's name says.
FAKE_MAKE = """#!/bin/sh
target="$3"
echo "running $target $4"
case "$target" in
  slow-*) sleep 1.5 ;;
esac
case "$target" in
  *-fails) echo "$target broke"; exit 3 ;;
esac
echo "$target done"
"""


def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, groups: tuple[tuple[Stage, ...], ...],
        capfd: pytest.CaptureFixture[str]) -> tuple[int, str, float]:
    make = tmp_path / "make"
    make.write_text(FAKE_MAKE)
    make.chmod(0o755)
    monkeypatch.setattr(stages, "GROUPS", groups)
    monkeypatch.setattr(sys, "argv", ["stages.py", "--make", str(make)])
    started = time.monotonic()
    code = stages.main()
    return code, capfd.readouterr().out, time.monotonic() - started


def test_a_groups_stages_run_at_once_and_each_ones_time_is_in_the_table(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    groups = ((Stage("first", "slow-one", "a"), Stage("second", "slow-two", "b", workers=1)),
              (Stage("third", "quick", "c"),))
    code, out, seconds = run(tmp_path, monkeypatch, groups, capfd)
    assert "running slow-two WORKERS=1" in out  # a stage's own number of pytest workers, as a make variable
    assert code == 0
    assert seconds < 2.9  # the two slow stages (1.5 s each) at once
    table = out[out.index("make test: each stage's time"):].splitlines()
    rows = {line.split()[0]: line.split() for line in table[2:5]}
    assert set(rows) == {"first", "second", "third"}
    assert 1.0 <= float(rows["first"][1]) < 2.5 and float(rows["third"][1]) < 1.0
    assert all("passed" in row for row in rows.values())
    assert rows["second"][3:6] == ["make", "slow-two", "WORKERS=1"]
    assert table[5].startswith("test time")
    # The group's other stage wrote to a log, printed once the first had ended.
    assert out.index("slow-one done") < out.index("==> second (passed):") < out.index("slow-two done")


def test_a_failed_stage_ends_the_run_after_its_group(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    groups = ((Stage("first", "quick", "a"), Stage("second", "it-fails", "b")), (Stage("third", "never", "c"),))
    code, out, _ = run(tmp_path, monkeypatch, groups, capfd)
    assert code == 1
    assert "it-fails broke" in out and "running never" not in out
    table = out[out.index("make test: each stage's time"):]
    assert "FAILED  make it-fails" in table and "third" not in table


def test_every_stage_is_a_target_of_the_makefile() -> None:
    makefile = (Path(stages.ROOT) / "Makefile").read_text(encoding="utf-8")
    for group in stages.GROUPS:
        for stage in group:
            assert f"\n{stage.target}:" in makefile or stage.target.startswith("test-vllm03"), stage.target
