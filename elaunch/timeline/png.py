"""A :class:`~elaunch.timeline.model.Timeline` as a PNG with matplotlib (the ``bench`` extra).

The same picture as :mod:`elaunch.timeline.svg`: a lane per node, the round band
on top, the goodput ledger's band under it, one row per local rank, marks, a legend.
"""

from __future__ import annotations

from .model import LEDGER, MARKS, SPANS, Timeline

_MARKERS = {"x": "x", "tri": "v", "diamond": "D", "square": "s", "circle": "o", "star": "*"}


def render_png(tl: Timeline, path: str, title: str | None = None) -> None:
    """Write ``tl`` to ``path`` as a PNG.

    Raises:
        ImportError: matplotlib is not installed.
        OSError: ``path`` cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    lanes = tl.lanes[::-1]  # drawn bottom up: the first lane ends on top, as in the SVG
    heights = [1.5 + max(lane.rows, 1) * 0.6 for lane in lanes]  # round band 1.0, ledger band 0.4, rows
    fig_height = 1.6 + 0.45 * sum(heights) + 1.4  # inches; the legend takes the bottom 1.4
    fig, ax = plt.subplots(figsize=(12, fig_height))
    y, ticks, labels = 0.0, [], []
    for lane, height in zip(lanes, heights):
        top = y + height  # the round band is on top, the ledger band under it, local rank 0 below
        for cat, start, end in lane.ledger:
            ax.broken_barh([(start, max(end - start, tl.end * 1e-4))], (top - 1.4, 0.3),
                           facecolors=LEDGER[cat][1], linewidth=0)
        for kind, start, end, label, row in lane.spans:
            lo, h = (top - 1.0, 0.9) if row < 0 else (top - 1.5 - (row + 1) * 0.6, 0.5)
            color = SPANS[kind][1]
            if kind == "round" and label[1:].isdigit() and int(label[1:]) % 2:
                color = "#9ecae1"
            ax.broken_barh([(start, max(end - start, tl.end * 1e-3))], (lo, h), facecolors=color,
                           edgecolor="white", linewidth=0.5)
            if kind == "round" and (end - start) > tl.end * 0.03:
                ax.text(start + tl.end * 0.003, lo + h / 2, label, va="center", fontsize=8)
        for kind, t, _, row in lane.marks:
            _, color, shape = MARKS[kind]
            my = top - 0.55 if row < 0 else top - 1.5 - (row + 1) * 0.6 + 0.25
            ax.plot([t], [my], marker=_MARKERS[shape], color=color, markersize=9 if shape == "star" else 7,
                    markeredgecolor="black" if shape == "star" else color, linestyle="none")
        ticks.append(top - 0.55)
        labels.append(f"{lane.host}\n{lane.node[:30]}"
                      + (f"\ngoodput {lane.goodput:.1%}" if lane.goodput is not None else ""))
        y = top + 0.4
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_ylim(-0.2, y)
    ax.set_xlim(0, tl.end * 1.01)
    ax.set_xlabel("seconds since the first event")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title or f"elaunch timeline: {len(tl.lanes)} node(s), {tl.end:.1f} s"
                 + (f", goodput {tl.goodput:.1%}" if tl.goodput is not None else ""))
    handles = [Patch(facecolor=color, label=label) for label, color in SPANS.values()]
    handles += [Patch(facecolor=color, label=f"ledger: {label}") for label, color in LEDGER.values()]
    handles += [Line2D([], [], marker=_MARKERS[shape], color=color, linestyle="none", label=label)
                for label, color, shape in MARKS.values()]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 1.4 / fig_height, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
