"""The memory timeline as an SVG: live activation bytes against op order, one curve per timeline.

matplotlib draws it (the `report` extra: `pip install "fxopt[report]"`); text stays text in the
SVG (searchable, and the page's tests can read the labels).
"""
from __future__ import annotations

import io

from ...errors import FxoptError
from ..cli_inspect import human_bytes
from .timeline import Timeline

COLORS = ("#8c8c8c", "#1f77b4", "#2ca02c", "#d62728")
EXTRA_HINT = 'pip install "fxopt[report]"'


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise FxoptError(f"the HTML report draws its memory plot with matplotlib, which is not installed: "
                         f"{EXTRA_HINT}") from e
    matplotlib.use("Agg", force=True)
    matplotlib.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "fxopt", "font.size": 10})
    import matplotlib.pyplot as plt
    return plt


def _unit(nbytes: int) -> tuple[int, str]:
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if nbytes >= scale:
            return scale, unit
    return 1, "bytes"


def timeline_svg(timelines: list[Timeline], title: str) -> str:
    """One plot of every timeline (live bytes vs op index), each peak marked and labelled."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(11, 4.2))
    top = max((t.peak_bytes for t in timelines), default=0) or 1
    scale, unit = _unit(top)
    top /= scale
    for k, (t, color) in enumerate(zip(timelines, COLORS)):
        xs = range(len(t.points))
        ys = [p.live_bytes / scale for p in t.points]
        ax.step(xs, ys, where="post", color=color, linewidth=1.6, label=f"{t.label}: peak {human_bytes(t.peak_bytes)}")
        i = t.peak_index
        ax.plot([i], [t.peak_bytes / scale], marker="v", color=color, markersize=9, zorder=5)
        ax.annotate(f"peak {human_bytes(t.peak_bytes)}\n{t.describe_peak()}", (i, t.peak_bytes / scale),
                    xytext=(8, -14 - 30 * k), textcoords="offset points", fontsize=8, color=color,
                    bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": color, "alpha": 0.9})
        start = t.backward_start
        if start is not None:
            ax.axvline(start, color=color, linestyle=":", linewidth=1)
            ax.text(start, top * (1.04 + 0.05 * k), f" backward starts ({t.label})", color=color, fontsize=8,
                    va="bottom")
    ax.set_ylim(0, top * 1.2)
    ax.set_xlabel("op order (ATen ops of one step, in the order they ran)")
    ax.set_ylabel(f"live activation memory ({unit})")
    ax.set_title(title, fontsize=10, loc="left")
    ax.grid(alpha=0.25)
    ax.legend(loc="upper right", fontsize=9)
    fig.tight_layout()
    out = io.StringIO()
    fig.savefig(out, format="svg")
    plt.close(fig)
    svg = out.getvalue()
    return svg[svg.index("<svg"):]  # drop the XML prolog: the SVG goes inline into the page


def check_matplotlib() -> None:
    """Raise FxoptError naming the extra to install if matplotlib is missing."""
    _pyplot()
