"""Grouped bar charts as SVG text: plots for the benchmarks without a plotting package (the GPU
image has none)."""

from __future__ import annotations

from html import escape

COLOURS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")
WIDTH, HEIGHT, MARGIN = 720, 300, 48


def grouped_bars(title: str, groups: list[str], series: dict[str, list[float]], y: float = 0.0) -> str:
    """One chart at vertical offset `y`: a bar per series in each group, labelled with its value."""
    top = max((v for values in series.values() for v in values), default=1.0) or 1.0
    plot_h = HEIGHT - 2 * MARGIN
    group_w = (WIDTH - 2 * MARGIN) / max(len(groups), 1)
    bar_w = 0.8 * group_w / max(len(series), 1)
    parts = [f'<text x="{MARGIN}" y="{y + 24}" font-size="15" font-weight="bold">{escape(title)}</text>']
    base = y + HEIGHT - MARGIN
    parts.append(f'<line x1="{MARGIN}" y1="{base}" x2="{WIDTH - MARGIN}" y2="{base}" stroke="black"/>')
    for g, group in enumerate(groups):
        x0 = MARGIN + g * group_w + 0.1 * group_w
        for s, (name, values) in enumerate(series.items()):
            value = values[g] if g < len(values) else 0.0
            h = plot_h * value / top
            x = x0 + s * bar_w
            parts.append(f'<rect x="{x:.1f}" y="{base - h:.1f}" width="{bar_w * 0.95:.1f}" height="{h:.1f}" '
                         f'fill="{COLOURS[s % len(COLOURS)]}"/>')
            parts.append(f'<text x="{x + bar_w / 2:.1f}" y="{base - h - 3:.1f}" font-size="9" '
                         f'text-anchor="middle">{value:,.0f}</text>')
        parts.append(f'<text x="{x0 + 0.4 * group_w:.1f}" y="{base + 16}" font-size="11" '
                     f'text-anchor="middle">{escape(group)}</text>')
    for s, name in enumerate(series):  # legend
        lx = WIDTH - MARGIN - 120
        ly = y + 40 + 16 * s
        parts.append(f'<rect x="{lx}" y="{ly - 10}" width="10" height="10" fill="{COLOURS[s % len(COLOURS)]}"/>')
        parts.append(f'<text x="{lx + 14}" y="{ly}" font-size="11">{escape(name)}</text>')
    return "\n".join(parts)


def document(charts: list[str]) -> str:
    """The charts stacked into one SVG document."""
    height = HEIGHT * len(charts)
    body = "\n".join(charts)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'font-family="sans-serif">\n<rect width="100%" height="100%" fill="white"/>\n{body}\n</svg>\n')
