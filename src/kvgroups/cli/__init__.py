"""The ``kvgroups`` command: argument parsing (``main``), the inspect report, its rendering."""

from kvgroups.cli.main import main

__all__ = ["main"]
