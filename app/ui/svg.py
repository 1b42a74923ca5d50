"""Inline SVG drawn on the server: line charts, device lanes and branch trees (no JS library).

Every drawn element carries a class and data attributes naming what it shows (`class="lane"
data-device=...`, `class="tree-node" data-node-id=...`), so a test in a browser can count what is
on the page, and a reader's tooltip (`<title>`) says the numbers behind each mark.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import Any

from app.job.analysis import RoleSegment
from app.ui.data import BusySample, Marker

FAULT_COLOUR = "#d62728"
FAULT_KINDS = ("fault", "stall")
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")
ROLE_COLOURS = {"rollout": "#4c78a8", "train": "#f58518", "switching": "#bab0ac", "idle": "#eeeeee"}
KIND_COLOURS = {
    "root": "#9ecae9",
    "continue": "#dddddd",
    "sample": "#a1d99b",
    "compaction": "#fdae6b",
    "strip_reasoning": "#c49c94",
    "retry": "#fc9272",
    "subagent": "#bcbddc",
    "prompt": "#fdd0a2",
}


def _fmt(x: float) -> str:
    """A short axis or tooltip number: 0 for |x| < 1e-6, else 3 significant digits (no exponent below 1e6)."""
    if abs(x) < 1e-6:
        return "0"
    if abs(x) >= 1000:
        return f"{x:.0f}" if abs(x) < 1e6 else f"{x:.2e}"
    return f"{x:.3g}"


def line_chart(
    name: str, title: str, series: dict[str, list[tuple[int, float]]], *, width: int = 440, height: int = 170
) -> str:
    """One chart of several series against the trainer step; empty series are listed as such."""
    pad_l, pad_r, pad_t, pad_b = 52, 10, 22, 22
    points = [p for pts in series.values() for p in pts]
    head = f'<svg class="chart" data-chart="{escape(name)}" data-points="{len(points)}" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">'
    parts = [head, f'<text x="{pad_l}" y="14" class="chart-title">{escape(title)}</text>']
    if not points:
        parts.append(f'<text x="{pad_l}" y="{height // 2}" class="empty">no points yet</text></svg>')
        return "".join(parts)
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    x0, x1 = min(xs), max(max(xs), min(xs) + 1)
    y0, y1 = min(ys), max(ys)
    if y1 - y0 < 1e-12:
        y0, y1 = y0 - 0.5, y1 + 0.5
    w, h = width - pad_l - pad_r, height - pad_t - pad_b

    def px(x: float) -> float:
        return pad_l + (x - x0) / (x1 - x0) * w

    def py(y: float) -> float:
        return pad_t + (1 - (y - y0) / (y1 - y0)) * h

    parts.append(f'<rect x="{pad_l}" y="{pad_t}" width="{w}" height="{h}" class="plot-area"/>')
    parts.append(f'<text x="{pad_l - 4}" y="{pad_t + 8}" class="axis" text-anchor="end">{_fmt(y1)}</text>')
    parts.append(f'<text x="{pad_l - 4}" y="{pad_t + h}" class="axis" text-anchor="end">{_fmt(y0)}</text>')
    parts.append(f'<text x="{pad_l}" y="{height - 6}" class="axis">step {x0}</text>')
    parts.append(f'<text x="{pad_l + w}" y="{height - 6}" class="axis" text-anchor="end">step {x1}</text>')
    for i, (label, pts) in enumerate(series.items()):
        colour = PALETTE[i % len(PALETTE)]
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        parts.append(
            f'<polyline class="series" data-series="{escape(label)}" data-points="{len(pts)}" points="{coords}" '
            f'fill="none" stroke="{colour}" stroke-width="1.8"/>'
        )
        for x, y in pts:
            parts.append(
                f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.2" fill="{colour}"><title>{escape(label)} step {x}: {_fmt(y)}</title></circle>'
            )
        parts.append(
            f'<text x="{pad_l + 6 + i * 130}" y="{pad_t + 12}" fill="{colour}" class="legend">{escape(label)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def device_lanes(
    devices: Sequence[str],
    segments: Sequence[RoleSegment],
    busy: Sequence[BusySample],
    markers: Sequence[Marker],
    duration_s: float,
    *,
    width: int = 900,
) -> str:
    """One lane per device over the run: its role (colour), busy while leased (dark strip under the
    lane, from the scheduler's snapshots), reassignments (red ticks) and migrations (purple dots);
    faults and a stall across every lane (a red line, shaded until back), labelled above them."""
    lane_h, gap, pad_l = 20, 14, 70
    span = max(duration_s, 1e-9)
    w = width - pad_l - 10

    def px(t: float) -> float:
        return pad_l + max(0.0, min(t, span)) / span * w

    faults = sorted((m for m in markers if m.kind in FAULT_KINDS), key=lambda m: m.t_s)
    rows = _label_rows([(px(m.t_s), len(m.target or m.kind)) for m in faults])
    pad_t = 18 + 12 * (max(rows, default=-1) + 1)
    height = pad_t + len(devices) * (lane_h + gap) + 20

    parts = [
        f'<svg class="lanes" data-devices="{len(devices)}" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">'
    ]
    x = pad_l
    for role, colour in ROLE_COLOURS.items():
        parts.append(
            f'<rect x="{x}" y="3" width="10" height="10" fill="{colour}"/><text x="{x + 14}" y="12" class="legend">{role}</text>'
        )
        x += 90
    parts.append(
        f'<rect x="{x}" y="3" width="10" height="4" fill="#222"/><text x="{x + 14}" y="12" class="legend">busy</text>'
    )
    parts.append(
        f'<text x="{x + 70}" y="12" class="legend" fill="#d62728">| reassign</text><text x="{x + 150}" y="12" class="legend" fill="#7b4173">&#9679; migration</text>'
    )
    parts.append(
        f'<rect x="{x + 240}" y="3" width="10" height="10" fill="{FAULT_COLOUR}" fill-opacity="0.3" stroke="{FAULT_COLOUR}"/>'
        f'<text x="{x + 254}" y="12" class="legend" fill="{FAULT_COLOUR}">fault, shaded until back</text>'
    )
    by_device_busy: dict[str, list[BusySample]] = {}
    for b in busy:
        by_device_busy.setdefault(b.device_id, []).append(b)
    for i, device in enumerate(devices):
        y = pad_t + i * (lane_h + gap)
        parts.append(f'<g class="lane" data-device="{escape(device)}">')
        parts.append(f'<text x="4" y="{y + 14}" class="axis">{escape(device)}</text>')
        for seg in (s for s in segments if s.device_id == device):
            parts.append(
                f'<rect class="segment" data-role="{seg.role}" x="{px(seg.start_s):.1f}" y="{y}" '
                f'width="{max(0.5, px(seg.end_s) - px(seg.start_s)):.1f}" height="{lane_h}" fill="{ROLE_COLOURS.get(seg.role, "#999")}">'
                f"<title>{escape(device)} {seg.role} {seg.start_s:.1f}-{seg.end_s:.1f} s</title></rect>"
            )
        samples = sorted(by_device_busy.get(device, []), key=lambda b: b.t_s)
        for j, b in enumerate(samples):
            if not b.busy:
                continue
            end = samples[j + 1].t_s if j + 1 < len(samples) else b.t_s + 1.0
            parts.append(
                f'<rect class="busy" x="{px(b.t_s):.1f}" y="{y + lane_h + 1}" width="{max(0.5, px(end) - px(b.t_s)):.1f}" height="4" fill="#222"/>'
            )
        for mk in (m for m in markers if m.device_id == device and m.kind not in FAULT_KINDS):
            if mk.kind == "reassign":
                parts.append(
                    f'<line class="marker reassign" x1="{px(mk.t_s):.1f}" x2="{px(mk.t_s):.1f}" y1="{y - 3}" y2="{y + lane_h + 3}" stroke="#d62728" stroke-width="2"><title>{escape(mk.label)} at {mk.t_s:.1f} s</title></line>'
                )
            else:
                parts.append(
                    f'<circle class="marker migration" cx="{px(mk.t_s):.1f}" cy="{y + lane_h / 2}" r="3.5" fill="#7b4173"><title>{escape(mk.label)} at {mk.t_s:.1f} s</title></circle>'
                )
        parts.append("</g>")
    bottom = pad_t + len(devices) * (lane_h + gap) - gap + 3
    for mk, row in zip(faults, rows, strict=True):
        parts.append(
            _fault(mk, px(mk.t_s), px(span if mk.until_s is None else mk.until_s), 18 + 12 * row, bottom)
        )
    parts.append(f'<text x="{pad_l}" y="{height - 4}" class="axis">0 s</text>')
    parts.append(
        f'<text x="{pad_l + w}" y="{height - 4}" class="axis" text-anchor="end">{span:.0f} s</text></svg>'
    )
    return "".join(parts)


def _label_rows(labels: Sequence[tuple[float, int]]) -> list[int]:
    """The row of each label (x in pixels, length in characters), first row where it clears the
    label before it (6 px a character)."""
    ends: list[float] = []
    rows = []
    for x, num_chars in labels:
        row = next((i for i, end in enumerate(ends) if end < x), len(ends))
        if row == len(ends):
            ends.append(0.0)
        ends[row] = x + 6 * (num_chars + 1)
        rows.append(row)
    return rows


def _fault(mk: Marker, x: float, x_back: float, label_y: float, bottom: float) -> str:
    """A fault (or stall) across every lane: its label, a red line and a light span until back."""
    back = "never back" if mk.until_s is None else f"back after {mk.until_s - mk.t_s:.1f} s"
    dash = ' stroke-dasharray="4 2"' if mk.kind == "stall" else ""
    return (
        f'<g class="marker {mk.kind}" data-kind="{mk.kind}" data-target="{escape(mk.target)}" '
        f'data-t-s="{mk.t_s:.2f}" data-until-s="{"" if mk.until_s is None else f"{mk.until_s:.2f}"}">'
        f'<rect class="recovery" x="{x:.1f}" y="{label_y}" width="{max(0.0, x_back - x):.1f}" '
        f'height="{bottom - label_y:.0f}" fill="{FAULT_COLOUR}" fill-opacity="0.15"/>'
        f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{label_y}" y2="{bottom}" stroke="{FAULT_COLOUR}" stroke-width="1.5"{dash}/>'
        f'<text x="{x + 2:.1f}" y="{label_y + 9}" class="fault-label" fill="{FAULT_COLOUR}">'
        f"{escape(mk.target or mk.kind)}</text>"
        f"<title>{escape(mk.label)} at {mk.t_s:.1f} s, {back}</title></g>"
    )


def _layout(nodes: Sequence[dict[str, Any]]) -> dict[int, tuple[int, float]]:
    """node id -> (depth, row): leaves get consecutive rows, a parent sits at its children's mean."""
    children: dict[int | None, list[int]] = {}
    for n in nodes:
        children.setdefault(n["parent_id"], []).append(n["node_id"])
    ids = {n["node_id"] for n in nodes}
    roots = [n["node_id"] for n in nodes if n["parent_id"] is None or n["parent_id"] not in ids]
    pos: dict[int, tuple[int, float]] = {}
    next_row = 0.0

    def place(nid: int, depth: int) -> float:
        nonlocal next_row
        kids = children.get(nid, [])
        if not kids:
            row = next_row
            next_row += 1
        else:
            rows = [place(k, depth + 1) for k in kids]
            row = sum(rows) / len(rows)
        pos[nid] = (depth, row)
        return row

    for r in roots:
        place(r, 0)
    return pos


def tree(
    group: dict[str, Any], nodes: Sequence[dict[str, Any]], scores: dict[str, float], merged: set[str]
) -> str:
    """The branch tree: one box per node (colour = branch kind), edges to parents; each box says its
    tokens, policy versions, executions through it and the scores of the calls that end there. A
    node only merged (deduplicated) executions pass through is drawn dashed."""
    pos = _layout(nodes)
    col_w, row_h, box_w, box_h, pad = 150, 26, 132, 20, 10
    depth = max((d for d, _ in pos.values()), default=0)
    rows = max((r for _, r in pos.values()), default=0.0)
    width = pad * 2 + (depth + 1) * col_w
    height = pad * 2 + int((rows + 1) * row_h)
    parts = [
        f'<svg class="tree" data-group="{escape(str(group.get("group_id", "")))}" data-nodes="{len(nodes)}" '
        f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">'
    ]

    def xy(nid: int) -> tuple[float, float]:
        d, r = pos[nid]
        return pad + d * col_w, pad + r * row_h

    for n in nodes:
        parent = n["parent_id"]
        if parent in pos:
            (x0, y0), (x1, y1) = xy(parent), xy(n["node_id"])
            parts.append(
                f'<path class="edge" d="M{x0 + box_w:.0f},{y0 + box_h / 2:.0f} C{x0 + box_w + 10:.0f},{y0 + box_h / 2:.0f} '
                f'{x1 - 10:.0f},{y1 + box_h / 2:.0f} {x1:.0f},{y1 + box_h / 2:.0f}" fill="none" stroke="#888"/>'
            )
    for n in nodes:
        nid = n["node_id"]
        x, y = xy(nid)
        kind = str(n["branch_kind"])
        versions = n["policy_versions"]
        vtext = (
            ""
            if not versions
            else (f"v{versions[0]}" if len(versions) == 1 else f"v{versions[0]}-{versions[-1]}")
        )
        ends = n["call_ends"]
        end_scores = sorted({scores[c["execution_id"]] for c in ends if c["execution_id"] in scores})
        stext = (
            f" r={_fmt(end_scores[0])}"
            if len(end_scores) == 1
            else (f" r={_fmt(end_scores[0])}..{_fmt(end_scores[-1])}" if end_scores else "")
        )
        is_merged = bool(n["executions"]) and all(e in merged for e in n["executions"])
        label = f"{len(n['token_ids'])} tok {vtext}{stext}"
        dash = ' stroke-dasharray="4 2"' if is_merged else ""
        tip = (
            f"node {nid} ({kind}) at position {n['start']}: {len(n['token_ids'])} tokens, "
            f"{len(n['executions'])} executions, {len(ends)} calls end here"
            + (", policy versions " + ", ".join(map(str, versions)) if versions else "")
            + (", only deduplicated (merged) executions" if is_merged else "")
        )
        parts.append(
            f'<g class="tree-node{" merged" if is_merged else ""}" data-node-id="{nid}" data-kind="{escape(kind)}" '
            f'data-executions="{len(n["executions"])}" tabindex="0">'
            f'<rect x="{x:.0f}" y="{y:.0f}" width="{box_w}" height="{box_h}" rx="4" fill="{KIND_COLOURS.get(kind, "#ccc")}" '
            f'stroke="#444"{dash}/>'
            f'<text x="{x + 4:.0f}" y="{y + 14:.0f}" class="node-label">{escape(label)}</text>'
            f"<title>{escape(tip)}</title></g>"
        )
    parts.append("</svg>")
    return "".join(parts)
