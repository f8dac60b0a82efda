"""``kvgroups inspect --plot FILE``: memory per rank against context length, from the report's numbers.

One stacked area per group (and one for the images of cross-attention layers), the line an
engine without a hybrid allocator would reserve ("as if every layer were full") and the
``--memory`` budget when given, for ``--seqs`` sequences, from one block to the model's context
on logarithmic axes (a full-attention group is a rising line, a sliding window or a recurrent
state flattens out). The
series come from the JSON report alone (:func:`plot_series`); matplotlib (``kvgroups[plot]``) is
imported only by :func:`write_plot`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvgroups.cli.render import kind_text
from kvgroups.cli.report import costs_of
from kvgroups.core.sizes import GIB
from kvgroups.errors import KVGroupsError
from kvgroups.models.capacity import memory_needed

POINTS = 400
# The context plotted when the config states no maximum and --tokens is not given.
DEFAULT_CONTEXT = 131072


@dataclass(frozen=True, kw_only=True)
class PlotSeries:
    """What the picture shows, in bytes per rank at each context length of ``tokens``."""

    tokens: list[int]
    labels: list[str]
    areas: list[list[int]]  # stacked, one per group (then the images), in group order
    all_full: list[int]
    budget: int | None


def _labels(report: dict[str, Any]) -> list[str]:
    """One label per area: the groups in the table's words, then the images."""
    labels = [f"group {group['index']}: {kind_text(group)}, {group['num_layers']} layers ({group['dtype']})"
              for group in report["groups"]]
    cross = report["cross_attention"]
    if cross is not None and cross["bytes_per_sequence"]:
        labels.append(f"images: {cross['images']} x {cross['tokens_per_image']} tokens in "
                      f"{cross['num_layers']} cross-attention layers")
    return labels


def plot_series(report: dict[str, Any], points: int = POINTS) -> PlotSeries:
    """The stacked areas, the all-full line and the budget of ``report`` (a ``Report.to_dict()``)."""
    engine = report["engine"]
    context = report["max_position_embeddings"] or engine["tokens"] or DEFAULT_CONTEXT
    first = min(engine["block_size"], context)
    tokens = sorted({round(first * (context / first) ** (step / (points - 1))) for step in range(points)}
                    | ({engine["tokens"]} if engine["tokens"] and engine["tokens"] <= context else set()))
    labels, costs = _labels(report), costs_of(report["groups"], report["cross_attention"])
    seqs, block = engine["seqs"], engine["block_size"]
    areas = [[memory_needed([cost], count, seqs, block, hybrid=True) for count in tokens] for cost in costs]
    all_full = [memory_needed(costs, count, seqs, block, hybrid=False) for count in tokens]
    budget = report["capacity"]["memory"]["budget_bytes_per_rank"] if report["capacity"]["memory"] else None
    return PlotSeries(tokens=tokens, labels=labels, areas=areas, all_full=all_full, budget=budget)


def _tokens_label(value: float, _position: int) -> str:
    """``1024`` -> ``1K``, ``262144`` -> ``256K``, ``1048576`` -> ``1M``."""
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if value >= size:
            return f"{value / size:g}{unit}"
    return f"{value:g}"


def _gib_label(value: float, _position: int) -> str:
    """GiB on the axis, as ``1 MiB`` / ``64 MiB`` below one GiB."""
    if value >= 1:
        return f"{value:g} GiB"
    if value * 1024 >= 1:
        return f"{value * 1024:g} MiB"
    return f"{value * 1024 * 1024:g} KiB"


def write_plot(report: dict[str, Any], path: str) -> Any:
    """Draw :func:`plot_series` of ``report`` into ``path`` (PNG or SVG by its extension); the Figure."""
    try:
        from matplotlib.figure import Figure  # noqa: PLC0415 - an optional extra, for --plot alone
        from matplotlib.ticker import FuncFormatter  # noqa: PLC0415
    except ImportError:
        raise KVGroupsError("--plot needs matplotlib: pip install 'kvgroups[plot]'") from None
    series = plot_series(report)
    engine = report["engine"]
    figure = Figure(figsize=(10, 5.6), layout="constrained")
    axes = figure.subplots()
    gib = [[value / GIB for value in area] for area in series.areas]
    axes.stackplot(series.tokens, *gib, labels=series.labels, alpha=0.85)
    axes.plot(series.tokens, [value / GIB for value in series.all_full], color="black", linestyle="--",
              linewidth=1.4, label="as if every layer were full")
    if series.budget is not None:
        axes.axhline(series.budget / GIB, color="tab:red", linewidth=1.4,
                     label=f"--memory {engine['memory_gib']} GiB per rank")
    sequences = f"{engine['seqs']} sequence{'s' if engine['seqs'] > 1 else ''}"
    axes.set_title(f"{report['model']}: KV memory per rank, tp={engine['tp']}, {sequences}, "
                   f"{engine['kv_dtype']} KV, block {engine['block_size']}")
    axes.set_xlabel("context length per sequence (tokens, log scale)")
    axes.set_ylabel("memory per rank (log scale)")
    axes.set_xscale("log", base=2)
    axes.xaxis.set_major_formatter(FuncFormatter(_tokens_label))
    axes.set_xlim(series.tokens[0], series.tokens[-1])
    totals = [sum(values) for values in zip(*series.areas, strict=True)]
    lowest = min([value for value in (*totals, *series.all_full) if value > 0] or [GIB])
    axes.set_yscale("log", base=2)
    axes.yaxis.set_major_formatter(FuncFormatter(_gib_label))
    axes.set_ylim(bottom=lowest / GIB / 2)
    axes.grid(alpha=0.3)
    axes.legend(loc="upper left", fontsize="small")
    try:
        figure.savefig(path, dpi=110)
    except OSError as error:
        raise OSError(f"--plot {path}: cannot write: {error}") from None
    return figure
