"""The plots of report.html (and the PNG encoder trend.py uses): worst max |Δ| per layout and model,
memory per phase, time blocked per strategy; each only when the run has rows for it."""
from __future__ import annotations

import io
from typing import Any

import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from harness.report.results import rows_frame


def figure_png(fig: Figure) -> bytes:
    """PNG bytes of a figure. Figures are built on the Agg canvas directly (no pyplot): headless,
    no global backend switch, no figure registry to leak in a long pytest session."""
    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    return buffer.getvalue()


def _bars(ax, table: pd.DataFrame, log: bool) -> None:
    """Grouped bars: one group per index entry, one bar per column."""
    n = max(1, len(table.columns))
    width = 0.8 / n
    for i, column in enumerate(table.columns):
        xs = [x - 0.4 + width * (i + 0.5) for x in range(len(table.index))]
        ax.bar(xs, table[column].fillna(0.0).tolist(), width=width, label=str(column))
    ax.set_xticks(range(len(table.index)))
    ax.set_xticklabels([str(i) for i in table.index], rotation=30, ha="right")
    if log:
        ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3)


def _numeric_values(rows: pd.DataFrame) -> pd.DataFrame | None:
    """The rows whose value is a number (as float), or None when there are none to plot."""
    data = rows.copy()
    data["value"] = pd.to_numeric(data["value"], errors="coerce")
    data = data.dropna(subset=["value"])
    return None if data.empty else data


def plot_max_abs(frame: pd.DataFrame) -> bytes | None:
    """(a) worst max |Δ| per layout (x) and model (bars), one panel per dtype, log y, with that
    dtype's tolerance(s) as dashed lines. Negative controls are left out: they are meant to be
    orders of magnitude off and would flatten every real bar."""
    data = _numeric_values(frame[(frame["metric"] == "max_abs") & ~frame["expected_failure"]])
    if data is None:
        return None
    dtypes = sorted(data["dtype"].unique())
    fig = Figure(figsize=(max(8.0, 1.1 * data["layout"].nunique() + 4), 4.2 * len(dtypes)))
    for k, dtype in enumerate(dtypes):
        ax = fig.add_subplot(len(dtypes), 1, k + 1)
        sub = data[data["dtype"] == dtype]
        table = sub.pivot_table(index="layout", columns="model", values="value", aggfunc="max")
        # Zero (bit-identical) would vanish on a log axis: draw it at a visible floor instead.
        positive = table[table > 0].min().min()
        floor = positive / 10 if pd.notna(positive) else 1e-12
        _bars(ax, table.clip(lower=floor), log=True)
        for tol in sorted(pd.to_numeric(sub["tolerance"], errors="coerce").dropna().unique())[:3]:
            ax.axhline(tol, color="red", linestyle="--", linewidth=1)
            ax.annotate(f"tolerance {tol:g}", (0.995, tol), xycoords=("axes fraction", "data"),
                        ha="right", va="bottom", color="red", fontsize=8)
        ax.set_title(f"max |Δ logprob| vs HF — {dtype or 'no dtype'} (worst per layout/model)")
        ax.set_ylabel("max_abs")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="model")
    fig.tight_layout()
    return figure_png(fig)


MEMORY_UNITS = {"bytes": 1 / 2**30, "b": 1 / 2**30, "mib": 1 / 1024, "gib": 1.0}


def plot_memory(frame: pd.DataFrame) -> bytes | None:
    """(b) memory per phase in GiB: x = phase (extra.phase, else the metric name), bars = layout
    / model. Rows say their unit; bytes and MiB are converted so bars are comparable."""
    units = frame["units"].astype(str).str.lower()
    data = frame[units.isin(list(MEMORY_UNITS))].copy()
    if data.empty:
        return None
    data["gib"] = pd.to_numeric(data["value"], errors="coerce") * units[data.index].map(MEMORY_UNITS)
    data = data.dropna(subset=["gib"])
    if data.empty:
        return None
    data["phase"] = [(e or {}).get("phase") or m for e, m in zip(data["extra"], data["metric"])]
    data["series"] = _series_label(data, ("model", "layout", "dtype"))
    table = data.pivot_table(index="phase", columns="series", values="gib", aggfunc="max")
    table = _cap_columns(table, 10)
    fig = Figure(figsize=(max(8.0, 1.2 * len(table.index) + 4), 4.5))
    ax = fig.add_subplot(1, 1, 1)
    _bars(ax, table, log=False)
    ax.set_title("memory per phase (max over tests)")
    ax.set_ylabel("GiB")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    return figure_png(fig)


def plot_blocking(frame: pd.DataFrame) -> bytes | None:
    """(c) metrics named *blocking_s* per strategy (extra.strategy, else variant, else layout);
    the median over rows, since single timings on shared machines jitter."""
    data = _numeric_values(frame[frame["metric"].astype(str).str.contains("blocking_s", regex=False)])
    if data is None:
        return None
    data["strategy"] = [(e or {}).get("strategy") or v or l or "?"
                        for e, v, l in zip(data["extra"], data["variant"], data["layout"])]
    table = _cap_columns(data.pivot_table(index="strategy", columns="metric", values="value",
                                          aggfunc="median"), 10)
    fig = Figure(figsize=(max(8.0, 1.2 * len(table.index) + 4), 4.5))
    ax = fig.add_subplot(1, 1, 1)
    _bars(ax, table, log=False)
    ax.set_title("time blocked per strategy (median over rows)")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return figure_png(fig)


def _series_label(data: pd.DataFrame, dims: tuple[str, ...]) -> list[str]:
    return ["/".join(str(v) for v in values if v) or "all"
            for values in zip(*(data[d].astype(str) for d in dims))]


def _cap_columns(table: pd.DataFrame, cap: int) -> pd.DataFrame:
    """Keep the `cap - 1` largest series; fold the rest into one "other (max of N)" column."""
    if len(table.columns) <= cap:
        return table
    keep = table.max().sort_values(ascending=False).index[: cap - 1]
    rest = [c for c in table.columns if c not in keep]
    capped = table[list(keep)].copy()
    capped[f"other (max of {len(rest)})"] = table[rest].max(axis=1)
    return capped


def plots(run: dict[str, Any]) -> list[tuple[str, bytes]]:
    """(title, png) for every plot that has data; an empty list when none has."""
    frame = rows_frame(run["rows"])
    if frame.empty:
        return []
    makers = (("max |Δ logprob| vs HF per layout and model (worst row; negative controls left "
               "out; 0 is drawn at a tenth of the smallest non-zero value)", plot_max_abs), ("memory per phase", plot_memory),
              ("blocking time per strategy", plot_blocking))
    return [(title, png) for title, make in makers if (png := make(frame)) is not None]
