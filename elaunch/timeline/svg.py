"""A :class:`~elaunch.timeline.model.Timeline` as a self-contained SVG (or an HTML page holding it).

Written by hand (no matplotlib needed): one lane per node with its round band on
top, its goodput ledger band below it (productive time green, lost time in other
colours), one row per local rank below, marks over the round band, a time axis in
seconds and a legend. Every span and mark carries a ``<title>`` (a tooltip in a browser).
"""

from __future__ import annotations

import datetime
from html import escape

from .model import LEDGER, MARKS, SPANS, Timeline, nice_ticks

WIDTH = 1100  #: pixels
LEFT, RIGHT, TOP = 210, 30, 50  #: margins, pixels
BAND, ROW, GAP = 18, 9, 16  #: round band, worker row, space between lanes (pixels)
LEDGER_BAND = 7  #: the goodput ledger's band under the round band (pixels)
ROWS_AT = BAND + 2 + LEDGER_BAND + 2  #: where the worker rows start below a lane's top (pixels)


def _shape(shape: str, x: float, y: float, color: str, r: float = 6.0) -> str:
    if shape == "x":
        return (f'<path d="M{x - r:.1f},{y - r:.1f}L{x + r:.1f},{y + r:.1f}M{x - r:.1f},{y + r:.1f}'
                f'L{x + r:.1f},{y - r:.1f}" stroke="{color}" stroke-width="2.5"/>')
    if shape == "tri":
        return f'<path d="M{x - r:.1f},{y - r:.1f}L{x + r:.1f},{y - r:.1f}L{x:.1f},{y + r:.1f}Z" fill="{color}"/>'
    if shape == "diamond":
        return f'<path d="M{x:.1f},{y - r:.1f}L{x + r:.1f},{y:.1f}L{x:.1f},{y + r:.1f}L{x - r:.1f},{y:.1f}Z" fill="{color}"/>'
    if shape == "square":
        return f'<rect x="{x - r * .8:.1f}" y="{y - r * .8:.1f}" width="{r * 1.6:.1f}" height="{r * 1.6:.1f}" fill="{color}"/>'
    if shape == "star":
        import math

        pts = " ".join(f"{x + (r if i % 2 == 0 else r * .45) * math.sin(i * math.pi / 5):.1f},"
                       f"{y - (r if i % 2 == 0 else r * .45) * math.cos(i * math.pi / 5):.1f}" for i in range(10))
        return f'<polygon points="{pts}" fill="{color}" stroke="#000" stroke-width="0.6"/>'
    return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{r * .75:.1f}" fill="{color}"/>'


def render_svg(tl: Timeline, title: str | None = None) -> str:
    """Return the SVG document (a string) drawing ``tl``."""
    scale = (WIDTH - LEFT - RIGHT) / tl.end
    out: list[str] = []
    y = _lanes(tl, scale, out)
    _axis(tl, scale, y, out)
    height = _legend(y + 50, out)
    heading = title or (f"elaunch timeline: {len(tl.lanes)} node(s), {tl.end:.1f} s"
                        + (f", goodput {tl.goodput:.1%}" if tl.goodput is not None else ""))
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">\n'
            f'<rect width="100%" height="100%" fill="#fff"/>\n'
            f'<text x="{WIDTH / 2}" y="24" font-size="15" text-anchor="middle">{escape(heading)}</text>\n'
            + "\n".join(out) + "\n</svg>\n")


def _lanes(tl: Timeline, scale: float, out: list[str]) -> float:
    """Append one lane per node (name, goodput, ledger band, spans, marks); return the y below them."""
    y = TOP
    for lane in tl.lanes:
        height = ROWS_AT + max(lane.rows, 1) * (ROW + 2) + 4
        out.append(f'<rect x="0" y="{y - 4}" width="{WIDTH}" height="{height + 8}" fill="#fafafa"/>')
        out.append(f'<text x="8" y="{y + 13}" font-weight="bold">{escape(lane.host)}</text>')
        out.append(f'<text x="8" y="{y + 27}" font-size="9" fill="#555">{escape(lane.node[:34])}</text>')
        if lane.goodput is not None:
            out.append(f'<text x="8" y="{y + 40}" font-size="10" fill="{LEDGER["productive"][1]}">'
                       f'goodput {lane.goodput:.1%}</text>')
        for cat, start, end in lane.ledger:
            tip = f"{LEDGER[cat][0]} {start:.2f}-{end:.2f} s ({end - start:.2f} s)"
            out.append(f'<rect x="{LEFT + start * scale:.1f}" y="{y + BAND + 2}" '
                       f'width="{max((end - start) * scale, 0.5):.1f}" height="{LEDGER_BAND}" '
                       f'fill="{LEDGER[cat][1]}"><title>{escape(tip)}</title></rect>')
        for kind, start, end, label, row in lane.spans:
            top, h = (y, BAND) if row < 0 else (y + ROWS_AT + row * (ROW + 2), ROW)
            color = SPANS[kind][1]
            if kind == "round" and label[1:].isdigit() and int(label[1:]) % 2:
                color = "#9ecae1"
            x, w = LEFT + start * scale, max((end - start) * scale, 1.0)
            tip = f"{SPANS[kind][0]} {label} {start:.2f}-{end:.2f} s"
            out.append(f'<rect x="{x:.1f}" y="{top}" width="{w:.1f}" height="{h}" fill="{color}" '
                       f'stroke="#fff" stroke-width="0.5"><title>{escape(tip)}</title></rect>')
            if kind == "round" and w > 22:
                out.append(f'<text x="{x + 3:.1f}" y="{top + 13}" font-size="10">{escape(label)}</text>')
        for kind, t, label, row in lane.marks:
            _, color, shape = MARKS[kind]
            my = y + BAND / 2 if row < 0 else y + ROWS_AT + row * (ROW + 2) + ROW / 2
            out.append(f'<g><title>{escape(f"{label} at {t:.2f} s")}</title>'
                       f'{_shape(shape, LEFT + t * scale, my, color, 6.0 if row < 0 else 4.5)}</g>')
        y += height + GAP
    return y


def _axis(tl: Timeline, scale: float, y: float, out: list[str]) -> None:
    """Append the time axis at ``y``: the line, a grid line and label per tick, the unit."""
    out.append(f'<line x1="{LEFT}" y1="{y}" x2="{WIDTH - RIGHT}" y2="{y}" stroke="#000"/>')
    for tick in nice_ticks(tl.end):
        x = LEFT + tick * scale
        out.append(f'<line x1="{x:.1f}" y1="{TOP - 6}" x2="{x:.1f}" y2="{y + 4}" stroke="#000" '
                   f'stroke-opacity="0.12"/>')
        out.append(f'<text x="{x:.1f}" y="{y + 16}" font-size="10" text-anchor="middle">{tick:g}</text>')
    out.append(f'<text x="{(LEFT + WIDTH - RIGHT) / 2}" y="{y + 32}" text-anchor="middle">seconds since '
               f'{escape(_when(tl.t0))}</text>')


def _legend(y: float, out: list[str]) -> float:
    """Append the legend from ``y`` (spans, ledger categories, then marks, in 4 columns); return the height."""
    items = [("span", label, color, "") for label, color in SPANS.values()]
    items += [("span", f"ledger: {label}", color, "") for label, color in LEDGER.values()]
    items += [("mark", label, color, shape) for label, color, shape in MARKS.values()]
    for i, (what, label, color, shape) in enumerate(items):
        lx, ly = 20 + (i % 4) * 270, y + (i // 4) * 20
        if what == "span":
            out.append(f'<rect x="{lx}" y="{ly - 9}" width="22" height="11" fill="{color}"/>')
        else:
            out.append(_shape(shape, lx + 11, ly - 4, color))
        out.append(f'<text x="{lx + 30}" y="{ly}" font-size="11">{escape(label)}</text>')
    return y + ((len(items) + 3) // 4) * 20 + 10


def render_html(tl: Timeline, title: str | None = None) -> str:
    """Return a self-contained HTML page showing :func:`render_svg`'s picture."""
    heading = escape(title or "elaunch timeline")
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{heading}</title></head>\n"
            f"<body style=\"margin:0\">\n{render_svg(tl, title)}</body></html>\n")


def _when(t0: float) -> str:
    return datetime.datetime.fromtimestamp(t0).isoformat(sep=" ", timespec="seconds")
