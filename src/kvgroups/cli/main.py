"""The ``kvgroups`` command: ``inspect`` a model's KV cache, list ``presets``, ``generate`` with prefix
reuse, look into a ``store``.

Strings become enums and dtypes here and nowhere else. Any bad input ends as one line on stderr
and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
from rich.console import Console

from kvgroups.cli.generate_command import add_generate_command
from kvgroups.cli.render import render_inspect, render_presets
from kvgroups.cli.report import inspect_model
from kvgroups.cli.store_command import add_store_commands
from kvgroups.dtypes import ALIASES, KV_CACHE_DTYPES, STATE_DTYPES, dtype_from_name
from kvgroups.layouts import KVLayout
from kvgroups.models.configs import model_spec_from_config
from kvgroups.models.engine import EngineParams
from kvgroups.models.presets import load_model_config, preset_names

EXIT_BAD_INPUT = 2

# Layout names as the command line spells them; "hnd" is the short name of FlashInfer's HND layout.
LAYOUTS: dict[str, KVLayout] = {
    **{layout.value.replace("_", "-"): layout for layout in KVLayout if layout.holds_kv},
    "hnd": KVLayout.FLASHINFER_HND,
}


def _dtype_choices(names: Sequence[str]) -> dict[str, torch.dtype | None]:
    """``auto`` (the config's dtype), each name, and the aliases of those names."""
    choices: dict[str, torch.dtype | None] = {"auto": None}
    choices.update({name: dtype_from_name(name) for name in names})
    choices.update({alias: dtype_from_name(alias) for alias, name in ALIASES.items() if name in names})
    return choices


KV_DTYPES = _dtype_choices(KV_CACHE_DTYPES)
STATE_DTYPE_CHOICES = _dtype_choices(STATE_DTYPES)


class _BadInputError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _BadInputError(message)


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type for ints >= ``minimum``."""
    expected = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive, finite number of GiB, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvgroups", description="Describe the KV cache of LLMs from their config.json.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    inspect = commands.add_parser(
        "inspect", help="layout and cost of a model's KV cache",
        description="Build a model's KV caches on the meta device, group them and cost them per rank.",
    )
    inspect.add_argument("model", help="preset name (see `kvgroups presets`), config.json path, or model directory")
    inspect.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel ranks (default 1)")
    inspect.add_argument("--rank", type=_non_negative_int, default=0, help="rank to describe (default 0)")
    inspect.add_argument("--block-size", type=_positive_int, default=16, help="tokens per block (default 16)")
    inspect.add_argument("--layout", choices=sorted(LAYOUTS), default="flash-attn", help="engine cache layout")
    inspect.add_argument("--kv-dtype", choices=list(KV_DTYPES), default="auto",
                         help="KV cache dtype; auto = the config's torch_dtype; fp8 = float8_e4m3fn")
    inspect.add_argument("--state-dtype", choices=list(STATE_DTYPE_CHOICES), default="auto",
                         help="recurrent-state dtype; auto = the config's torch_dtype")
    inspect.add_argument("--chunk-size", type=_positive_int, default=256, help="tokens per stored chunk")
    inspect.add_argument("--memory", type=_gib, metavar="GIB", help="KV budget per rank in GiB: tokens that fit")
    inspect.add_argument("--tokens", type=_positive_int, help="context tokens per sequence: memory needed")
    inspect.add_argument("--seqs", type=_positive_int, default=1, help="concurrent sequences (default 1)")
    inspect.add_argument("--json", action="store_true", help="print JSON (keys documented in README)")
    presets = commands.add_parser("presets", help="list the bundled model configs")
    presets.add_argument("--json", action="store_true", help="print JSON")
    add_store_commands(commands, _Parser)
    add_generate_command(commands, _positive_int)
    return parser


def _inspect(args: argparse.Namespace) -> dict[str, Any]:
    loaded = load_model_config(args.model)
    spec = model_spec_from_config(loaded.config)
    params = EngineParams(
        tp=args.tp, rank=args.rank, block_size=args.block_size, layout=LAYOUTS[args.layout],
        kv_dtype=KV_DTYPES[args.kv_dtype], state_dtype=STATE_DTYPE_CHOICES[args.state_dtype],
        chunk_size=args.chunk_size,
        memory_gib=args.memory, tokens=args.tokens, seqs=args.seqs,
    )
    return inspect_model(spec, loaded.name, params, source=loaded.source).to_dict()


def _presets() -> list[dict[str, Any]]:
    rows = []
    for name in preset_names():
        spec = model_spec_from_config(load_model_config(name).config)
        kinds = Counter(layer.summary for layer in spec.layers)
        rows.append({
            "name": name, "model_type": spec.model_type, "num_layers": len(spec.layers),
            "layer_kinds": dict(sorted(kinds.items())),
        })
    return rows


def _console() -> Console:
    # Wide enough that group rows do not wrap when piped; a terminal's own width wins when wider.
    return Console(width=max(shutil.get_terminal_size((160, 24)).columns, 160), soft_wrap=True)


def main(argv: Sequence[str] | None = None) -> int:
    # Warnings reach the user through the report; keep library log lines off the terminal while
    # the command runs (and only then: main() also runs inside other programs and tests).
    library = logging.getLogger("kvgroups")
    previous = library.level
    library.setLevel(logging.ERROR)
    try:
        return _run(argv)
    finally:
        library.setLevel(previous)


def _run(argv: Sequence[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if hasattr(args, "run"):
            return int(args.run(args, _console()))
        if args.command == "inspect":
            report = _inspect(args)
            if args.json:
                sys.stdout.write(json.dumps(report, indent=2) + "\n")
            else:
                render_inspect(report, _console())
        else:
            rows = _presets()
            if args.json:
                sys.stdout.write(json.dumps(rows, indent=2) + "\n")
            else:
                render_presets(rows, _console())
    except (_BadInputError, ValueError, TypeError, OSError) as error:
        message = " ".join(str(error).split())
        sys.stderr.write(f"kvgroups: error: {message}\n")
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
