"""``kvgroups inspect MODEL`` and ``kvgroups presets``: a model's KV cache, grouped and costed per rank.

Results go to stdout (a table, or JSON with ``--json``); warnings (what the config reader assumed,
options that do not apply) go to stderr, one ``kvgroups: warning:`` line each, and into the JSON's
``warnings``. ``--plot`` writes a picture of memory against context (matplotlib, imported only
then).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from typing import Any

from rich.console import Console

from kvgroups.cli.arguments import (
    KV_DTYPES,
    LAYOUTS,
    STATE_DTYPE_CHOICES,
    gib,
    non_negative_int,
    plot_path,
    positive_int,
)
from kvgroups.cli.render import render_inspect, render_presets
from kvgroups.cli.report import inspect_model
from kvgroups.models.configs import model_spec_from_config, supported_model_types
from kvgroups.models.engine import EngineParams
from kvgroups.models.presets import load_model_config, preset_names


def add_inspect_commands(commands: Any) -> None:
    inspect = commands.add_parser(
        "inspect", help="layout and cost of a model's KV cache",
        description="Build a model's KV caches on the meta device, group them and cost them per rank.",
    )
    inspect.add_argument("model", help="preset name (see `kvgroups presets`), config.json path, or model directory")
    inspect.add_argument("--assume", choices=supported_model_types(), metavar="MODEL_TYPE",
                         help="read a config whose model_type is not supported as this supported one (a guess; "
                              "warns)")
    inspect.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel ranks (default 1)")
    inspect.add_argument("--rank", type=non_negative_int, default=0, help="rank to describe (default 0)")
    inspect.add_argument("--block-size", type=positive_int, default=16, help="tokens per block (default 16)")
    inspect.add_argument("--layout", choices=sorted(LAYOUTS),
                         help="engine cache layout; a model whose values differ from its keys in head size gets "
                              "vllm, which stores them unpadded (default flash-attn)")
    inspect.add_argument("--kv-dtype", choices=list(KV_DTYPES), default="auto",
                         help="KV cache dtype; auto = the config's torch_dtype; fp8 = float8_e4m3fn (default auto)")
    inspect.add_argument("--state-dtype", choices=list(STATE_DTYPE_CHOICES), default="auto",
                         help="dtype of recurrent states (conv and SSM); auto = the config's torch_dtype "
                              "(default auto)")
    inspect.add_argument("--conv-state-dtype", choices=list(STATE_DTYPE_CHOICES), default="auto",
                         help="dtype of conv states; auto = --state-dtype (default auto)")
    inspect.add_argument("--ssm-state-dtype", choices=list(STATE_DTYPE_CHOICES), default="auto",
                         help="dtype of SSM and gated-DeltaNet states; auto = the config's mamba_ssm_cache_dtype / "
                              "mamba_ssm_dtype, else --state-dtype (default auto)")
    inspect.add_argument("--chunk-size", type=positive_int, default=256, help="tokens per stored chunk (default 256)")
    inspect.add_argument("--memory", type=gib, metavar="GIB", help="KV budget per rank in GiB: tokens that fit")
    inspect.add_argument("--tokens", type=positive_int, help="context tokens per sequence: memory needed")
    inspect.add_argument("--seqs", type=positive_int, default=1, help="concurrent sequences (default 1)")
    inspect.add_argument("--images", type=non_negative_int, default=0,
                         help="images per sequence, for models with cross-attention layers (default 0)")
    inspect.add_argument("--image-tokens", type=positive_int, metavar="N",
                         help="vision tokens per image (default: what the config implies)")
    inspect.add_argument("--plot", type=plot_path, metavar="FILE",
                         help="write memory per rank against context length to FILE (.png or .svg; needs "
                              "kvgroups[plot])")
    inspect.add_argument("--json", action="store_true", help="print JSON (keys documented in README)")
    inspect.set_defaults(run=run_inspect)
    presets = commands.add_parser("presets", help="list the bundled model configs")
    presets.add_argument("--json", action="store_true", help="print JSON")
    presets.set_defaults(run=run_presets)


def inspect_report(args: argparse.Namespace) -> dict[str, Any]:
    loaded = load_model_config(args.model)
    spec = model_spec_from_config(loaded.config, assume=args.assume)
    params = EngineParams(
        tp=args.tp, rank=args.rank, block_size=args.block_size,
        layout=None if args.layout is None else LAYOUTS[args.layout],
        kv_dtype=KV_DTYPES[args.kv_dtype], state_dtype=STATE_DTYPE_CHOICES[args.state_dtype],
        conv_state_dtype=STATE_DTYPE_CHOICES[args.conv_state_dtype],
        ssm_state_dtype=STATE_DTYPE_CHOICES[args.ssm_state_dtype], chunk_size=args.chunk_size,
        memory_gib=args.memory, tokens=args.tokens, seqs=args.seqs, images=args.images,
        image_tokens=args.image_tokens,
    )
    return inspect_model(spec, loaded.name, params, source=loaded.source).to_dict()


def run_inspect(args: argparse.Namespace, console: Console) -> int:
    report = inspect_report(args)
    if args.plot:
        from kvgroups.cli.plot import write_plot  # noqa: PLC0415 - matplotlib only when asked for

        write_plot(report, args.plot)
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        render_inspect(report, console)
    sys.stdout.flush()
    for warning in report["warnings"]:
        sys.stderr.write(f"kvgroups: warning: {warning}\n")
    return 0


def presets_rows() -> list[dict[str, Any]]:
    rows = []
    for name in preset_names():
        spec = model_spec_from_config(load_model_config(name).config)
        kinds = Counter(layer.summary for layer in spec.layers)
        rows.append({
            "name": name, "model_type": spec.model_type, "num_layers": len(spec.layers),
            "layer_kinds": dict(sorted(kinds.items())),
        })
    return rows


def run_presets(args: argparse.Namespace, console: Console) -> int:
    rows = presets_rows()
    if args.json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
    else:
        render_presets(rows, console)
    return 0
