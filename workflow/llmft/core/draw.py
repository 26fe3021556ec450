"""HTML and SVG drawing for the report pages: escaping, numbers, tables, line and bar charts."""

from __future__ import annotations

import csv
import html
import io
import math

LONG_CELL_CHARS, LONG_CELL_LINES, PREVIEW_CHARS = 240, 4, 120


COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]


CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"


STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222;padding:0 1em}
h1{font-size:1.5em} h2{font-size:1.15em;border-bottom:1px solid #ddd;margin-top:1.6em}
table{border-collapse:collapse;margin:.5em 0} td,th{border:1px solid #ddd;padding:3px 8px;
text-align:left;vertical-align:top;white-space:pre-wrap;overflow-wrap:break-word} th{background:#f4f4f4}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.charts{display:flex;flex-wrap:wrap;gap:8px} .chart{border:1px solid #eee;background:#fff}
.t{font-weight:600;font-size:13px} .a{font-size:11px;fill:#555} .g{stroke:#eee}
.verdict{font-size:1.1em;padding:.6em;background:#eef6ee;border-left:4px solid #2ca02c}
.verdict.warn{background:#fff6e0;border-left-color:#d68910}
.bad{background:#fdecec} tr.warn{background:#fff6e0} .good{background:#ecf8ec} .muted{color:#777}
pre{background:#f7f7f7;padding:8px;overflow:auto;white-space:pre-wrap}
nav a{margin-right:1em}
details summary{cursor:pointer} details .full{max-height:24em;overflow:auto;margin-top:.3em}
"""


def esc(value) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def fmt(value, digits: int = 4) -> str:
    """Numbers compact and readable; None as an empty cell."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.{digits}g}" if abs(value) < 1e5 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10000 else str(value)
    return str(value)


def _nice_range(lo: float, hi: float) -> tuple[float, float]:
    if hi <= lo:
        pad = abs(lo) * 0.1 or 1.0
        return lo - pad, hi + pad
    return lo, hi


def _placeholder(head: str, width: int, height: int, message: str) -> str:
    """A chart with nothing to plot: class 'na' tells the browser test to expect text only."""
    return head.replace("class='chart'", "class='chart na'") + (
        f"<text x='{width / 2}' y='{height / 2}' class='a' text-anchor='middle'>{esc(message)}</text></svg>"
    )


def svg_lines(
    series: dict[str, list[tuple[float, float]]],
    title: str,
    xlabel: str,
    width: int = 520,
    height: int = 260,
    log_y: bool = False,
    xticks: list[tuple[float, str]] | None = None,
    na: str = "",
) -> str:
    """A line chart as inline SVG; `series` maps a name to (x, y) points.

    `na`: text drawn instead of data when the measure does not apply (e.g. MFU on CPU).
    `xticks`: labelled x positions (runs on the trend page) instead of numbers.
    """
    head = (
        f"<svg xmlns='http://www.w3.org/2000/svg' class='chart' width='{width}' height='{height}' "
        f"viewBox='0 0 {width} {height}' role='img' aria-label='{esc(title)}'>"
        f"<title>{esc(title)}</title><text x='10' y='16' class='t'>{esc(title)}</text>"
    )
    pts = [(x, y) for s in series.values() for x, y in s if y is not None and (y > 0 or not log_y)]
    if na or not pts:
        return _placeholder(head, width, height, na or "no data")

    def ty(y: float) -> float:
        return math.log10(y) if log_y else y

    x0, x1 = _nice_range(min(p[0] for p in pts), max(p[0] for p in pts))
    y0, y1 = _nice_range(min(ty(p[1]) for p in pts), max(ty(p[1]) for p in pts))
    left, right, top, bottom = 62, 12, 26, 40
    w, h = width - left - right, height - top - bottom

    def sx(x):
        return left + (x - x0) / (x1 - x0) * w

    def sy(y):
        return top + h - (ty(y) - y0) / (y1 - y0) * h

    parts = [head, f"<rect x='{left}' y='{top}' width='{w}' height='{h}' fill='none' stroke='#bbb'/>"]
    for frac in (0, 0.25, 0.5, 0.75, 1):
        yv = y0 + frac * (y1 - y0)
        ypix = top + h - frac * h
        label = f"{10**yv:.3g}" if log_y else f"{yv:.3g}"
        parts.append(f"<line x1='{left}' x2='{left + w}' y1='{ypix:.1f}' y2='{ypix:.1f}' class='g'/>")
        parts.append(f"<text x='{left - 4}' y='{ypix + 4:.1f}' class='a' text-anchor='end'>{label}</text>")
    if xticks:
        step = max(1, math.ceil(len(xticks) / 8))
        for xv, label in xticks[::step]:
            parts.append(
                f"<text x='{sx(xv):.1f}' y='{height - 22}' class='a' "
                f"text-anchor='middle'>{esc(label[:14])}</text>"
            )
    else:
        for frac in (0, 0.5, 1):
            xv = x0 + frac * (x1 - x0)
            parts.append(
                f"<text x='{sx(xv):.1f}' y='{height - 22}' class='a' text-anchor='middle'>{xv:.4g}</text>"
            )
    parts.append(
        f"<text x='{left + w / 2}' y='{height - 6}' class='a' text-anchor='middle'>"
        f"{esc(xlabel)}{' (log y)' if log_y else ''}</text>"
    )
    parts += _svg_series(series, sx, sy, log_y, bool(xticks), left + w - 6, top)
    parts.append("</svg>")
    return "".join(parts)


def _svg_series(series: dict, sx, sy, log_y: bool, dots: bool, legend_x: float, top: int) -> list[str]:
    """Each series' points (dots where there is one point, or on the trend page), its line, and its
    name in the legend; `sx`, `sy` map data to pixels."""
    parts = []
    for i, (name, s) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        s = [(x, y) for x, y in s if y is not None and (y > 0 or not log_y)]
        if not s:
            continue
        if len(s) == 1 or dots:
            for x, y in s:
                parts.append(
                    f"<circle cx='{sx(x):.1f}' cy='{sy(y):.1f}' r='3.5' fill='{color}'>"
                    f"<title>{esc(name)}: {y:.4g}</title></circle>"
                )
        if len(s) > 1:
            path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s)
            parts.append(f"<polyline points='{path}' fill='none' stroke='{color}' stroke-width='2'/>")
        parts.append(
            f"<text x='{legend_x}' y='{top + 16 + 14 * i}' class='a' "
            f"text-anchor='end' fill='{color}' style='fill:{color}'>{esc(name)}</text>"
        )
    return parts


def svg_bars(edges: list, counts: list[int], title: str, width: int = 520, height: int = 230) -> str:
    head = (
        f"<svg xmlns='http://www.w3.org/2000/svg' class='chart' width='{width}' height='{height}' "
        f"viewBox='0 0 {width} {height}' role='img' aria-label='{esc(title)}'>"
        f"<title>{esc(title)}</title><text x='10' y='16' class='t'>{esc(title)}</text>"
    )
    if not counts or not any(counts):
        return _placeholder(head, width, height, "no data")
    left, top, bottom = 50, 26, 36
    w, h = width - left - 12, height - top - bottom
    bw, top_count = w / len(counts), max(counts)
    parts = [head]
    for frac in (0, 0.5, 1):
        ypix = top + h - frac * h
        parts.append(f"<line x1='{left}' x2='{left + w}' y1='{ypix:.1f}' y2='{ypix:.1f}' class='g'/>")
        parts.append(
            f"<text x='{left - 4}' y='{ypix + 4:.1f}' class='a' "
            f"text-anchor='end'>{fmt(round(frac * top_count))}</text>"
        )
    for i, c in enumerate(counts):
        bh = c / top_count * h
        parts.append(
            f"<rect x='{left + i * bw:.1f}' y='{top + h - bh:.1f}' width='{max(bw - 1, 0.5):.1f}' "
            f"height='{bh:.1f}' fill='#1f77b4'><title>{esc(edges[i])}-{esc(edges[i + 1])} tokens: {c}"
            "</title></rect>"
        )
    parts.append(f"<text x='{left}' y='{height - 20}' class='a'>{esc(edges[0])}</text>")
    parts.append(
        f"<text x='{left + w}' y='{height - 20}' class='a' text-anchor='end'>{esc(edges[-1])}</text>"
    )
    parts.append(
        f"<text x='{left + w / 2}' y='{height - 6}' class='a' text-anchor='middle'>tokens per row "
        "(prompt + answer)</text></svg>"
    )
    return "".join(parts)


def text_cell(text: str) -> str:
    """A table cell's text, escaped; a long one collapsed behind its first words."""
    breaks = text.count("\n")
    if len(text) <= LONG_CELL_CHARS and breaks < LONG_CELL_LINES:
        return esc(text)
    preview = text.split("\n", 1)[0][:PREVIEW_CHARS].rstrip()
    more = f"{len(text):,} characters, {breaks + 1} lines"
    return (
        f"<details><summary>{esc(preview)}… <span class='muted'>({more})</span></summary>"
        f"<div class='full'>{esc(text)}</div></details>"
    )


def table(header: list[str], rows: list[list], classes: list[str] | None = None, css: str = "") -> str:
    """An HTML table; every cell escaped. `classes`: one CSS class per row (or "")."""
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = []
    for i, r in enumerate(rows):
        cls = f" class='{esc(classes[i])}'" if classes and classes[i] else ""
        cells = "".join(
            f"<td class='num'>{esc(fmt(c))}</td>"
            if isinstance(c, (int, float)) and not isinstance(c, bool)
            else f"<td>{text_cell(fmt(c))}</td>"
            for c in r
        )
        body.append(f"<tr{cls}>{cells}</tr>")
    cls = f" class='{esc(css)}'" if css else ""
    return f"<table{cls}><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def tsv(header: list[str], rows: list[list]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, delimiter="\t", lineterminator="\n")
    writer.writerow(header)
    writer.writerows([["" if c is None else c for c in r] for r in rows])
    return buf.getvalue()
