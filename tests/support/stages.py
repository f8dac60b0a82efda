"""``make test``'s stages, run and timed: ``python3 tests/support/stages.py`` (the Makefile's ``test`` target, once
every environment is set up, so the times are the tests' own).

Each stage is a Makefile target. Stages in one group run at once, so that each uses the cores the others leave
idle (the first writes to the terminal, the others to logs printed after it); groups run one after the other, and
the first group with a failed stage ends the run. At the end, a table: each stage's seconds, its command and
result, and the test time in all. Standard library only: it runs on the machine's own Python.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Stage:
    name: str
    target: str  # the Makefile target that runs it
    what: str
    workers: int | None = None  # pytest's workers (the Makefile's WORKERS) where not its default

    def command(self, make: list[str]) -> list[str]:
        return [*make, self.target, *([f"WORKERS={self.workers}"] if self.workers else [])]


# One group per line: stages of a group run at once. Every stage is bound by the CPU but the main suite, whose
# cluster failovers and other processes leave a quarter of the cores idle: the oldest transformers' suite runs
# there, on one worker (221 s for both, against 211 + 61 one after the other, on the 2-core VM).
GROUPS: tuple[tuple[Stage, ...], ...] = (
    (Stage("main", "test-main", "the main suite"),
     Stage("transformers 5.24", "test-transformers-oldest", "the reuse suite on the oldest transformers", workers=1),
     Stage("lint", "test-lint", "ruff, mypy --strict on src/")),
    (Stage("vLLM 0.32", "test-vllm-engines", "the connector: vLLM's Scheduler, engines, vllm serve"),),
    (Stage("soak", "test-soak", "two vllm serve on one cluster through every fault"),),
    (Stage("vLLM 0.33", "test-vllm033", "the connector on vLLM 0.33's Scheduler", workers=1),
     Stage("vLLM 0.34", "test-vllm034", "the connector on vLLM 0.34's Scheduler", workers=1),
     Stage("SGLang", "test-sglang", "the HiCache backend through SGLang's own code")),
)


@dataclass
class Ran:
    stage: Stage
    seconds: float
    code: int


def run_group(group: tuple[Stage, ...], make: list[str]) -> list[Ran]:
    """Run a group's stages at once: the first writes straight to the terminal, the others to logs printed once
    it has ended (and they have)."""
    with tempfile.TemporaryDirectory(prefix="kvgroups-stages-") as directory:
        running = []
        for index, stage in enumerate(group):
            together = " (beside the first of its group; its output follows)" if index else ""
            command = stage.command(make)
            print(f"==> {stage.name}: {' '.join(['make', *command[len(make):]])}{together}", flush=True)
            log = None if index == 0 else open(Path(directory) / f"{stage.target}.log", "w+b")  # noqa: SIM115
            process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=None if log is None else subprocess.STDOUT)
            running.append((stage, process, log, time.monotonic()))
        ran: list[Ran] = []
        waiting = list(running)
        while waiting:
            for entry in list(waiting):
                stage, process, _, started = entry
                if process.poll() is not None:
                    waiting.remove(entry)
                    ran.append(Ran(stage, time.monotonic() - started, process.returncode))
            time.sleep(0.2)
        for stage, _, log, _ in running[1:]:
            assert log is not None
            log.seek(0)
            code = next(each.code for each in ran if each.stage == stage)
            print(f"==> {stage.name} ({'passed' if code == 0 else 'FAILED'}):", flush=True)
            sys.stdout.buffer.write(log.read())
            sys.stdout.flush()
            log.close()
    order = {stage: index for index, stage in enumerate(group)}
    return sorted(ran, key=lambda each: order[each.stage])


def table(runs: list[Ran], wall: float) -> str:
    lines = ["", "make test: each stage's time (set-up excluded)",
             f"{'stage':<20} {'seconds':>8}  {'result':<7} {'command':<42} what"]
    for ran in runs:
        result = "passed" if ran.code == 0 else "FAILED"
        command = " ".join(["make", *ran.stage.command([])])
        lines.append(f"{ran.stage.name:<20} {ran.seconds:8.0f}  {result:<7} {command:<42} {ran.stage.what}")
    lines.append(f"{'test time':<20} {wall:8.0f}  (stages of a group run at once: the groups' times added up)")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--make", default=os.environ.get("MAKE", "make"), help="the make to run stages with")
    arguments = parser.parse_args()
    make = [arguments.make, "-s", "--no-print-directory"]
    runs: list[Ran] = []
    started = time.monotonic()
    for group in GROUPS:
        runs += run_group(group, make)
        if any(ran.code for ran in runs):
            break
    print(table(runs, time.monotonic() - started), flush=True)
    return 1 if any(ran.code for ran in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
