"""Rich tables for ``kvgroups inspect`` and ``kvgroups presets``: the same numbers as the JSON.

Only results are printed here; warnings go to stderr (:mod:`kvgroups.cli.inspect_command`).
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from kvgroups.core.formatting import compact_ranges


def human_bytes(count: int) -> str:
    """``131072`` -> ``"128.0 KiB"``."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{count} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


# What a group of each kind holds unless its ``holds`` says otherwise.
_USUAL_HOLDS = {"full_attention": "attention k/v", "sliding_window": "attention k/v",
                "chunked_local": "attention k/v", "mla": "mla latent"}


def kind_text(group: dict[str, Any]) -> str:
    """The kind with its window or chunk; a recurrent group by what it holds (``mamba2 conv+ssm``)."""
    spec = group["spec"]
    if group["kind"] == "recurrent":
        return str(group["holds"])
    if "window_tokens" in spec:
        kind = f"sliding({spec['window_tokens']})"
    elif "chunk_tokens" in spec:
        kind = f"chunked({spec['chunk_tokens']})"
    elif "tokens_per_row" in spec:
        kind = f"compressed(1/{spec['tokens_per_row']})"
    else:
        kind = str(spec["kind"])
    if group.get("block_tokens") is not None:  # pages the engine fixes itself, blocks of their own
        kind += f" [{group['block_tokens']}-token pages of {group['page_bytes']:,} B]"
    return kind if group["holds"] == _USUAL_HOLDS.get(group["kind"]) else f"{kind}: {group['holds']}"


def _shape(group: dict[str, Any]) -> str:
    shape = "[" + ", ".join(str(dim) for dim in group["tensor_shape"]) + "]"
    if group["kind"] == "recurrent":
        states = " + ".join("x".join(map(str, state)) for state in group["spec"]["state_shapes"])
        return f"{shape} ({states})"
    if group["value_head_size"] != group["head_size"]:  # keys and values of their own head sizes
        sizes = f"({group['head_size']}+{group['value_head_size']})"
        return f"K {shape} + V [..., {group['value_head_size']}]" if group["tensors_per_layer"] == 2 else (
            f"{shape} {sizes}")
    if group["tensors_per_layer"] == 2:
        return f"2 x {shape}"
    return shape


def _hidden(group: dict[str, Any]) -> str:
    if group["value_hidden_dim_size"] != group["hidden_dim_size"]:
        return f"{_number(group['hidden_dim_size'])}+{_number(group['value_hidden_dim_size'])}"
    return _number(group["hidden_dim_size"])


def _layers(model_layers: list[int], total_layers: int) -> str:
    """Compacted layer list, or "all but ..." when the complement reads shorter."""
    direct = compact_ranges(model_layers)
    members = set(model_layers)
    rest = [index for index in range(total_layers) if index not in members]
    if rest:
        complement = f"all but {compact_ranges(rest)}"
        if len(complement) < len(direct):
            return complement
    return direct


def _number(value: float) -> str:
    return f"{value:,}"


def _tokens(value: int | None) -> str:
    return "unbounded" if value is None else _number(value)


def render_inspect(report: dict[str, Any], console: Console) -> None:
    engine, totals, capacity = report["engine"], report["totals"], report["capacity"]
    console.print(
        f"[bold]{report['model']}[/bold] ({report['model_type']}, {report['layers']['total']} layers, "
        f"{report['layers']['with_cache']} with a cache)  tp={engine['tp']} rank={engine['rank']} "
        f"layout={engine['layout']} kv_dtype={engine['kv_dtype']} block_size={engine['block_size']} "
        f"chunk_size={engine['chunk_size']} num_blocks={engine['num_blocks']}"
    )
    table = Table(title="KV layer groups (sizes per rank)", show_lines=False)
    for header, justify in (
        ("#", "right"), ("layers", "left"), ("kind", "left"), ("tensor shape", "left"), ("dtype", "left"),
        ("hidden", "right"), ("B/token", "right"), ("B/seq", "right"), ("chunk shape", "left"),
        ("chunk B", "right"),
    ):
        table.add_column(header, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for group in report["groups"]:
        table.add_row(
            str(group["index"]), _layers(group["model_layers"], report["layers"]["total"]), kind_text(group),
            _shape(group), group["dtype"], _hidden(group), _number(group["bytes_per_token"]),
            _number(group["bytes_per_sequence"]), "[" + ", ".join(map(str, group["chunk_shape"])) + "]",
            _number(group["chunk_bytes"]),
        )
    console.print(table)
    lines = [
        ("bytes per token, per rank", totals["bytes_per_token_per_rank"]),
        ("bytes per token, all ranks", totals["bytes_per_token_all_ranks"]),
        ("state bytes per sequence, per rank", totals["state_bytes_per_sequence_per_rank"]),
        ("state bytes per sequence, all ranks", totals["state_bytes_per_sequence_all_ranks"]),
        ("bytes per chunk, per rank", totals["bytes_per_chunk_per_rank"]),
    ]
    for label, value in lines:
        console.print(f"{label:<38} {_number(value):>18}  ({human_bytes(value)})")
    cross = report["cross_attention"]
    if cross is not None:
        console.print(
            f"{'cross-attention, per image, per rank':<38} {_number(cross['bytes_per_image']):>18}  "
            f"({human_bytes(cross['bytes_per_image'])}): layers {cross['layers']}, "
            f"{_number(cross['tokens_per_image'])} image tokens each; x {cross['images']} images per sequence "
            f"(--images)"
        )
    console.print(f"{'metadata fingerprint':<38} {totals['fingerprint']}")
    memory = capacity["memory"]
    if memory is not None:
        label = f"{'tokens that fit in ' + str(engine['memory_gib']) + ' GiB/rank':<38}"
        if memory["tokens_per_sequence"] is None:
            console.print(f"{label} {'unbounded':>18} per sequence x {memory['sequences']} (no layer grows with "
                          f"the context, and the config states no maximum)")
        else:
            console.print(
                f"{label} {_number(memory['tokens_per_sequence']):>18} per sequence x {memory['sequences']} "
                f"(limited by {memory['limited_by']}); as if every layer were full: "
                f"{_tokens(memory['tokens_per_sequence_all_full'])} (limited by {memory['limited_by_all_full']})"
            )
    tokens = capacity["tokens"]
    if tokens is not None:
        console.print(
            f"{'memory for ' + _number(tokens['tokens_per_sequence']) + ' tokens x ' + str(tokens['sequences']):<38} "
            f"{_number(tokens['bytes_per_rank']):>18}  ({human_bytes(tokens['bytes_per_rank'])}) per rank, "
            f"{_number(tokens['bytes_all_ranks'])} ({human_bytes(tokens['bytes_all_ranks'])}) all ranks; "
            f"as if every layer were full: {_number(tokens['bytes_per_rank_all_full'])} "
            f"({human_bytes(tokens['bytes_per_rank_all_full'])}) per rank"
        )


def render_presets(rows: list[dict[str, Any]], console: Console) -> None:
    table = Table(title="Bundled model configs")
    for header in ("preset", "model_type", "layers", "layer kinds"):
        table.add_column(header, overflow="fold")
    for row in rows:
        kinds = ", ".join(f"{count} {kind}" for kind, count in row["layer_kinds"].items())
        table.add_row(row["name"], row["model_type"], str(row["num_layers"]), kinds)
    console.print(table)
