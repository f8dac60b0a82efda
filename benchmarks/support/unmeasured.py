"""What a benchmark could not measure: a row of its table saying why, and a non-zero exit once it is done.

A variant that cannot run (a reference library not installed, a server missing, an engine that does
not start) never just disappears from a table: :meth:`Unmeasured.row` records it and gives the row
to print in its place, and :meth:`Unmeasured.exit` ends the benchmark with status 1, after every
table, when anything was recorded. ``available_elsewhere`` marks what cannot exist on this platform
at all (vLLM's ``OffloadingConnector`` on vLLM's CPU build, which refuses to start there): its row
is printed, and it does not fail the run.
"""

from __future__ import annotations

import sys


class Unmeasured:
    """The variants one benchmark run could not measure."""

    def __init__(self) -> None:
        self.reasons: list[str] = []

    def row(self, variant: str, reason: str, *, columns: int = 2, available_elsewhere: bool = False) -> str:
        """A table row (``columns`` cells) saying ``variant`` was not measured and why."""
        shown = " ".join(str(reason).split())[:400]
        if not available_elsewhere:
            self.reasons.append(f"{variant}: {shown}")
        cells = [variant, f"NOT MEASURED: {shown}" if not available_elsewhere else f"not on this platform: {shown}"]
        return "| " + " | ".join(cells + [""] * max(0, columns - 2)) + " |"

    def exit(self) -> None:
        """Exit with status 1, naming every variant not measured, when there was one."""
        if self.reasons:
            print(f"\n{len(self.reasons)} variant(s) not measured:", file=sys.stderr)
            for reason in self.reasons:
                print(f"  {reason}", file=sys.stderr)
            sys.exit(1)
