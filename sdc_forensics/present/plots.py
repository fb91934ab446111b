"""The report's plots: one matplotlib figure of the steps around the incident, as inline SVG.

Five panels share the step axis: per-rank loss; per-rank local gradient norm; the all-reduce
residual over its tolerance (1 = the tolerance line); replica weight consensus (rank × step:
agrees with the strict majority, differs, no majority, not compared) with audits on it; and a
checkpoint strip coloured by status. The first divergent step is a dashed line on every panel,
checkpoints are vertical lines in their status colour, suspect ranks are drawn in red.

matplotlib is the optional ``report`` extra: it is imported here, lazily, with the Agg backend
(never at CLI start-up); :func:`render_svg` returns None when it is not installed, and the HTML
says how to get plots. Labels are numbers and fixed words only (never a string from the trace).
"""

from __future__ import annotations

import io
import re
import warnings

import numpy as np

from sdc_forensics.decide.decision import Status
from sdc_forensics.triage.series import Consensus, Series
from sdc_forensics.decide.verdict import BisectResult

STATUS_COLOURS = {
    Status.CLEAN: "#2e7d32",
    Status.UNVERIFIED: "#f9a825",
    Status.TAINTED: "#e65100",
    Status.CORRUPT: "#b71c1c",
}
_SUSPECT = "#d32f2f"
# more ranks: the ranks' median and min-max band, plus the suspects' lines
_MAX_RANK_LINES = 16


def matplotlib_available() -> bool:
    """True when matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def render_svg(series: Series, result: BisectResult) -> str | None:
    """The figure as an ``<svg>`` element (no XML prolog), or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
    except ImportError:
        return None
    # all-NaN columns and empty log axes are expected; stderr stays one line per fact
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        warnings.simplefilter("ignore", UserWarning)
        return _figure(series, result, matplotlib, plt, ListedColormap)


def _figure(series: Series, result: BisectResult, matplotlib, plt, ListedColormap) -> str:
    suspects = sorted({s.rank for s in result.suspects if s.rank is not None})
    steps = series.steps
    with matplotlib.rc_context(
        {
            "svg.fonttype": "none",
            "svg.hashsalt": "sdc-forensics",
            "font.size": 8,
            "axes.spines.top": False,
            "axes.spines.right": False,
        }
    ):
        fig, axes = plt.subplots(
            5, 1, sharex=True, figsize=(9.5, 9.0), height_ratios=(2, 2, 2, 2, 0.6), constrained_layout=True
        )
        ax_loss, ax_norm, ax_res, ax_cons, ax_ckpt = axes
        _rank_lines(ax_loss, steps, series.loss, suspects, "loss (per rank)", log=False)
        _rank_lines(ax_norm, steps, series.grad_norm, suspects, "local gradient norm", log=True)
        _rank_lines(ax_res, steps, series.residual_ratio, suspects, "all-reduce residual / tolerance", log=True)
        ax_res.axhline(1.0, color="#000000", linewidth=1.0, linestyle=":")
        ax_res.annotate(
            "tolerance", xy=(0.995, 1.0), xycoords=("axes fraction", "data"), ha="right", va="bottom", fontsize=7
        )
        colours = {
            Consensus.NOT_CHECKED: "#eeeeee",
            Consensus.AGREES: "#a5d6a7",
            Consensus.DIFFERS: _SUSPECT,
            Consensus.NO_MAJORITY: "#ffb74d",
        }
        # index = the code
        cmap = ListedColormap([colours[code] for code in sorted(Consensus)])
        if len(steps):
            extent = (steps[0] - 0.5, steps[-1] + 0.5, series.consensus.shape[1] - 0.5, -0.5)
            ax_cons.imshow(
                series.consensus.T,
                aspect="auto",
                interpolation="nearest",
                cmap=cmap,
                vmin=0,
                vmax=len(Consensus) - 1,
                extent=extent,
            )
        ax_cons.set_ylabel("rank")
        ax_cons.set_title(
            "replica weights vs strict majority: green agrees, red differs, orange no majority, grey not compared; "
            "audits: ○ ok, ✕ lost the vote",
            loc="left",
            fontsize=8,
        )
        if len(series.audits):
            ok = series.audits[series.audits[:, 2] == 0]
            bad = series.audits[series.audits[:, 2] == 1]
            ax_cons.scatter(ok[:, 0], ok[:, 1], s=14, facecolors="none", edgecolors="#1b5e20", linewidths=0.8)
            ax_cons.scatter(bad[:, 0], bad[:, 1], s=30, marker="x", color="#000000", linewidths=1.2)
        if series.consensus.shape[1] <= 16:
            ax_cons.set_yticks(range(series.consensus.shape[1]))
        ax_ckpt.set_yticks([])
        ax_ckpt.set_title(
            "checkpoints: green clean, yellow unverified, orange tainted, red corrupt", loc="left", fontsize=8
        )
        lo, hi = series.window
        for c in result.checkpoints:
            if lo <= c.step <= hi + 1:
                colour = STATUS_COLOURS[c.status]
                for ax in axes[:4]:
                    ax.axvline(c.step - 0.5, color=colour, linewidth=1.0, alpha=0.7)
                ax_ckpt.axvline(c.step - 0.5, color=colour, linewidth=3)
                ax_ckpt.text(
                    c.step - 0.5, 0.5, f" {c.step} {c.status.value}", color=colour, fontsize=7, va="center", rotation=0
                )
        s_star = result.first_divergent_step
        if s_star is not None and lo <= s_star <= hi:
            for ax in axes:
                ax.axvline(s_star, color="#000000", linestyle="--", linewidth=1.0)
            ax_loss.annotate(
                f"first divergent step {s_star}",
                xy=(s_star, 1.0),
                xycoords=("data", "axes fraction"),
                ha="left",
                va="top",
                fontsize=8,
                fontweight="bold",
            )
        for alarm_step, _rank in series.alarms:
            ax_res.axvline(alarm_step, color="#6a1b9a", linewidth=0.6, alpha=0.5)
        ax_ckpt.set_xlabel("step" + ("" if series.whole_run else f" (steps {lo}..{hi} of the run)"))
        ax_ckpt.set_xlim(lo - 0.5, hi + 0.5 if hi > lo else lo + 0.5)
        buffer = io.StringIO()
        fig.savefig(buffer, format="svg")
        plt.close(fig)
    svg = buffer.getvalue()
    svg = svg[svg.index("<svg") :]
    # a fixed width breaks small screens and print: let the page size it
    return re.sub(
        r'<svg([^>]*?) width="[^"]*" height="[^"]*"',
        r'<svg\1 class="plot" role="img" aria-label="plots around the incident"',
        svg,
        count=1,
    )


def _rank_lines(ax, steps: np.ndarray, values: np.ndarray, suspects: list[int], title: str, log: bool) -> None:
    ax.set_title(title, loc="left", fontsize=8)
    if not len(steps):
        return
    finite = np.where(np.isfinite(values), values, np.nan)
    if log:
        finite = np.where(finite > 0, finite, np.nan)
    num_ranks = values.shape[1]
    if num_ranks <= _MAX_RANK_LINES:
        for rank in range(num_ranks):
            if rank in suspects:
                continue
            ax.plot(steps, finite[:, rank], linewidth=0.9, alpha=0.8, label=f"rank {rank}")
    else:
        ax.fill_between(
            steps,
            np.nanmin(finite, axis=1),
            np.nanmax(finite, axis=1),
            color="#90a4ae",
            alpha=0.4,
            label="min-max of ranks",
        )
        ax.plot(steps, np.nanmedian(finite, axis=1), color="#455a64", linewidth=0.9, label="median of ranks")
    for rank in suspects:
        if rank < num_ranks:
            ax.plot(steps, finite[:, rank], color=_SUSPECT, linewidth=1.8, label=f"rank {rank} (suspect)")
            blown = ~np.isfinite(values[:, rank]) & ~np.isnan(values[:, rank])
            # an infinite value would vanish from the line: mark it at the top
            if blown.any():
                ax.scatter(
                    steps[blown],
                    np.full(int(blown.sum()), np.nanmax(finite) if np.isfinite(np.nanmax(finite)) else 1.0),
                    marker="^",
                    color=_SUSPECT,
                    s=30,
                    zorder=5,
                )
    if log and np.isfinite(finite).any():
        ax.set_yscale("log")
    if np.isfinite(finite).any():
        ax.legend(loc="upper left", fontsize=6, ncol=min(num_ranks + 1, 6), frameon=False, bbox_to_anchor=(0.0, 0.93))
