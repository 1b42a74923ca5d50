"""The dashboard's HTML pages, rendered from a `RunView` and the tree export (Jinja2, autoescaped)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, select_autoescape

from app.ui import svg
from app.ui.data import CURVES, RunView
from gyre.tokenizer import NUM_BYTES, SPECIAL_NAMES

TEMPLATES = Path(__file__).parent / "templates"
REFRESH_S = 5

_env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(["html"]))


def fmt(x: Any) -> str:
    """A number for a table cell: 3 significant digits; blank when missing or not finite."""
    if x is None or isinstance(x, bool):
        return "" if x is None else str(x)
    try:
        v = float(x)
    except (TypeError, ValueError):
        return str(x)
    return f"{v:.3g}" if math.isfinite(v) else ""


_env.globals["fmt"] = fmt


def run_status(run_dir: Path) -> tuple[str, str, bool]:
    """(label, css class, live) from outcome.json: done / stopped early / running."""
    outcome = run_dir / "outcome.json"
    if not outcome.is_file():
        return "running", "live", True
    try:
        info = json.loads(outcome.read_text())
    except ValueError:
        return "unknown", "failed", False
    if info.get("completed"):
        return "completed", "done", False
    return f"stopped: {info.get('reason', '?')}", "failed", False


def _base(view: RunView, title: str) -> dict[str, Any]:
    label, css, live = run_status(view.run_dir)
    run_id = view.analysis.run_id if view.analysis is not None else view.run_dir.name
    return {"title": title, "run_id": run_id, "status": label, "status_class": css, "live": live}


def overview(view: RunView) -> str:
    a = view.analysis
    charts = [
        svg.line_chart(name, title, {key: view.curves.get(key, []) for key in keys})
        for name, (title, keys) in CURVES.items()
    ]
    lanes = (
        svg.device_lanes(view.devices, a.segments, view.busy, view.markers, a.duration_s)
        if a is not None
        else '<p class="hint">no events yet</p>'
    )
    return _env.get_template("overview.html").render(
        **_base(view, "overview"),
        policy=a.policy if a else "",
        num_steps=a.num_steps if a else 0,
        num_devices=len(view.devices),
        num_reassignments=a.num_reassignments if a else 0,
        num_migrations=a.num_migrations if a else 0,
        num_llm_calls=a.num_llm_calls if a else 0,
        num_records=view.num_records,
        refresh_s=REFRESH_S,
        charts=charts,
        lanes=lanes,
    )


def executions(view: RunView) -> str:
    return _env.get_template("executions.html").render(**_base(view, "executions"), rows=view.executions)


def groups(view: RunView, trees: dict[str, dict[str, Any]]) -> str:
    return _env.get_template("groups.html").render(**_base(view, "groups"), groups=list(trees.values()))


def tree_page(
    view: RunView, group: dict[str, Any], *, execution_id: str | None = None, selected: int | None = None
) -> str:
    """The tree of a whole group, or of one execution (the nodes its calls pass through); `selected`
    shows that node's text in the side panel from the start (a link to one node)."""
    nodes = group["nodes"]
    if execution_id is not None:
        nodes = [n for n in nodes if execution_id in n["executions"]]
    scores = {
        e["execution_id"]: e["reward"] for e in group.get("executions", []) if e.get("reward") is not None
    }
    merged = {
        e["execution_id"]
        for e in group.get("executions", [])
        if e.get("representative_id") and e["representative_id"] != e["execution_id"]
    }
    heading = f"execution {execution_id}" if execution_id else f"group {group['group_id']}"
    store_nodes = group.get("store_num_nodes", "") if execution_id is None else "-"
    return _env.get_template("tree.html").render(
        **_base(view, heading),
        heading=heading + f" ({len(nodes)} nodes)",
        group=group,
        nodes=nodes,
        store_num_nodes=store_nodes,
        tree=svg.tree(group, nodes, scores, merged),
        kinds=list(svg.KIND_COLOURS.items()),
        panel=node_fragment(group, selected) if selected is not None else None,
    )


def _token_text(token_id: int) -> tuple[str, bool]:
    if 0 <= token_id < NUM_BYTES:
        if token_id == 10 or 32 <= token_id < 127:
            return chr(token_id), False
        return f"\\x{token_id:02x}", False
    return SPECIAL_NAMES.get(token_id, f"<unk{token_id}>"), True


def _logprob_colour(lp: float) -> str:
    """Green for likely tokens, red for unlikely ones (probability exp(lp) on a light scale)."""
    p = max(0.0, min(1.0, math.exp(lp)))
    return f"hsl({int(120 * p)}, 70%, 82%)"


def node_fragment(group: dict[str, Any], node_id: int) -> str | None:
    """A node's decoded text, one span per token; None when the group has no such node."""
    node = next((n for n in group["nodes"] if n["node_id"] == node_id), None)
    if node is None:
        return None
    tokens = []
    for i, (tid, lp, ver) in enumerate(
        zip(node["token_ids"], node["logprobs"], node["versions"], strict=True)
    ):
        text, special = _token_text(int(tid))
        tip = f"position {node['start'] + i}, token {tid} {text!r}"
        if lp is not None:
            tip += f", logprob {lp:.4f} (p={math.exp(lp):.3f}), policy version {ver}"
        else:
            tip += ", not generated here (prompt or observation)"
        tokens.append(
            {
                "text": text,
                "special": special,
                "generated": lp is not None,
                "colour": _logprob_colour(lp) if lp is not None else "",
                "tip": tip,
            }
        )
    num_generated = sum(1 for t in tokens if t["generated"])
    return _env.get_template("node.html").render(node=node, tokens=tokens, num_generated=num_generated)


def login(key_path: Path, *, failed: bool) -> str:
    return _env.get_template("login.html").render(
        title="key", run_id="", status="locked", status_class="", key_path=str(key_path), failed=failed
    )
