"""``python -m cumempool plot SNAPSHOT -o usage.svg``: bytes in use per library over time, from
a snapshot's recorded events, with each device's budget marked. SVG and HTML are written with
no dependency; PNG needs matplotlib (``pip install cumempool[plot]``)."""

from __future__ import annotations

import html
from typing import Any

from ._budget import size_text as _size

# One colour per library, in the order first seen.
_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


def _library(event: dict[str, Any]) -> str:
    if "library" in event:
        return str(event["library"])
    frames = event.get("frames") or []
    first = frames[0]["filename"] if frames else ""
    return first.strip("<>") if first.startswith("<") else "torch"


def series(data: dict[str, Any]) -> dict[int, dict[str, list[tuple[float, int]]]]:
    """Per device, per library: (seconds since the first event, bytes in use) at each change."""
    answer: dict[int, dict[str, list[tuple[float, int]]]] = {}
    starts = [events[0]["time_us"] for events in data["device_traces"] if events and "time_us" in events[0]]
    start = min(starts) if starts else 0
    for device, events in enumerate(data["device_traces"]):
        in_use: dict[str, int] = {}
        lines: dict[str, list[tuple[float, int]]] = {}
        seen: set[int] = set()
        for event in events:
            action = event["action"]
            if action == "alloc":
                seen.add(event["addr"])
            elif action == "free_completed" and event["addr"] in seen:
                seen.discard(event["addr"])
            else:
                continue  # a free whose allocation the trace no longer holds counts for nothing
            library = _library(event)
            in_use[library] = in_use.get(library, 0) + (event["size"] if action == "alloc" else -event["size"])
            at = (event.get("time_us", start) - start) / 1e6
            lines.setdefault(library, [(at, 0)]).append((at, in_use[library]))
        if lines:
            answer[device] = lines
    return answer


def _budgets(data: dict[str, Any]) -> dict[int, int]:
    usage = data.get("cumempool", {}).get("usage", {})
    return {int(device): figures["limit"] for device, figures in usage.items()}


def svg(data: dict[str, Any], width: int = 900, height: int = 360) -> str:
    """The plot as an SVG document: one panel per device."""
    panels = series(data)
    budgets = _budgets(data)
    if not panels:
        raise ValueError("the snapshot records no allocation: call cumempool.record_history() before the program allocates")
    colours: dict[str, str] = {}
    parts = []
    margin_left, margin_top, plot_w, plot_h = 80, 30, width - 260, height - 70
    for index, (device, lines) in enumerate(sorted(panels.items())):
        top = index * height
        end = max(at for points in lines.values() for at, _ in points) or 1.0
        peak = max([value for points in lines.values() for _, value in points] + [budgets.get(device, 0), 1])

        def x(at: float, end: float = end) -> float:
            return margin_left + plot_w * at / end

        def y(value: float, top: float = top, peak: float = peak) -> float:
            return top + margin_top + plot_h * (1 - value / peak)

        parts.append(f'<text x="{margin_left}" y="{top + 18}" font-size="14">device {device}: bytes in use per library</text>')
        parts.append(f'<line x1="{margin_left}" y1="{y(0)}" x2="{margin_left + plot_w}" y2="{y(0)}" stroke="black"/>')
        parts.append(f'<line x1="{margin_left}" y1="{y(0)}" x2="{margin_left}" y2="{y(peak)}" stroke="black"/>')
        parts.append(f'<text x="{margin_left - 6}" y="{y(peak) + 4}" font-size="11" text-anchor="end">{_size(peak)}</text>')
        parts.append(f'<text x="{margin_left - 6}" y="{y(0) + 4}" font-size="11" text-anchor="end">0</text>')
        parts.append(f'<text x="{margin_left + plot_w}" y="{y(0) + 16}" font-size="11" text-anchor="end">{end:.3f} s</text>')
        if device in budgets:
            limit = budgets[device]
            parts.append(
                f'<line x1="{margin_left}" y1="{y(limit)}" x2="{margin_left + plot_w}" y2="{y(limit)}" stroke="red" stroke-dasharray="6,4"/>'
            )
            parts.append(
                f'<text x="{margin_left + plot_w + 6}" y="{y(limit) + 4}" font-size="11" fill="red">budget {_size(limit)}</text>'
            )
        for row, (library, points) in enumerate(sorted(lines.items())):
            colour = colours.setdefault(library, _COLOURS[len(colours) % len(_COLOURS)])
            steps = []
            for (at, value), (next_at, _) in zip(points, points[1:] + [(end, 0)], strict=True):
                steps.append(f"{x(at):.1f},{y(value):.1f} {x(next_at):.1f},{y(value):.1f}")
            parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{" ".join(steps)}"/>')
            legend_y = top + margin_top + 20 + 18 * row
            parts.append(f'<rect x="{margin_left + plot_w + 10}" y="{legend_y - 9}" width="12" height="12" fill="{colour}"/>')
            parts.append(f'<text x="{margin_left + plot_w + 28}" y="{legend_y + 1}" font-size="12">{html.escape(library)}</text>')
    total_height = height * len(panels)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{total_height}" '
        f'viewBox="0 0 {width} {total_height}" font-family="sans-serif">\n' + "\n".join(parts) + "\n</svg>\n"
    )


def write(data: dict[str, Any], path: str) -> None:
    """Writes the plot to ``path``: ``.svg``, ``.html`` (the SVG in a page) or ``.png``."""
    lower = path.lower()
    if lower.endswith(".svg"):
        text = svg(data)
    elif lower.endswith((".html", ".htm")):
        text = f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>cumempool: bytes in use</title></head><body>\n{svg(data)}</body></html>\n'
    elif lower.endswith(".png"):
        return _png(data, path)
    else:
        raise ValueError(f"{path}: write .svg, .html or .png")
    with open(path, "w", encoding="utf-8") as file:
        file.write(text)


def _png(data: dict[str, Any], path: str) -> None:
    try:
        import matplotlib  # type: ignore[import-not-found,unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]
    except ImportError as error:
        raise ImportError(f"a PNG needs matplotlib (pip install cumempool[plot]), or write .svg/.html: {error}") from error
    panels = series(data)
    if not panels:
        raise ValueError("the snapshot records no allocation: call cumempool.record_history() before the program allocates")
    budgets = _budgets(data)
    figure, axes = plt.subplots(len(panels), 1, figsize=(9, 3.6 * len(panels)), squeeze=False)
    for axis, (device, lines) in zip(axes[:, 0], sorted(panels.items()), strict=True):
        end = max(at for points in lines.values() for at, _ in points)
        for library, points in sorted(lines.items()):
            held = points + [(end, points[-1][1])]  # each line runs to the panel's end
            axis.step([at for at, _ in held], [value / 2**20 for _, value in held], where="post", label=library)
        if device in budgets:
            axis.axhline(budgets[device] / 2**20, color="red", linestyle="--", label="budget")
        axis.set_title(f"device {device}: bytes in use per library")
        axis.set_xlabel("seconds")
        axis.set_ylabel("MiB")
        axis.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
