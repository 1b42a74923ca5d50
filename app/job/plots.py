"""PNG figures of a run report (matplotlib, Agg backend: no display needed).

Each function takes a `RunAnalysis` and a path, writes one PNG and returns the path.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from app.job.analysis import ROLES, RunAnalysis
from app.job.busy import BusyTime
from app.job.faults import Mark
from app.job.stall_rule import STALL_ZERO_VARIANCE

ROLE_COLORS = {"rollout": "#4C72B0", "train": "#DD8452", "switching": "#C44E52", "idle": "#BBBBBB"}


def _pyplot():  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path) -> Path:
    """Lay out, write `path` (PNG, 110 dpi) and free the figure; returns `path`."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_reward(a: RunAnalysis, path: Path) -> Path:
    """Mean reward (incl. partial progress), milestone progress and the oracle's reward per trainer
    step, with the 20% windows and the stall span (if any)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.2))
    xs = [r.step for r in a.steps if r.reward_samples]
    ys = [r.reward_mean for r in a.steps if r.reward_samples]
    errs = []
    for r in a.steps:
        if r.reward_samples:
            n = len(r.reward_samples)
            if n > 1:
                mean = r.reward_mean
                var = sum((x - mean) ** 2 for x in r.reward_samples) / (n - 1)
                errs.append(1.96 * math.sqrt(var / n))
            else:
                errs.append(0.0)
    ax.errorbar(
        xs,
        ys,
        yerr=errs,
        fmt="o-",
        color="#4C72B0",
        ms=4,
        lw=1.2,
        capsize=2,
        label="reward incl. progress (per group, 95% CI)",
    )
    sx = [r.step for r in a.steps if r.scored_samples]
    if sx:
        sy = [sum(r.scored_samples) / len(r.scored_samples) for r in a.steps if r.scored_samples]
        ax.plot(sx, sy, "^:", color="#DD8452", ms=4, lw=1, label="scored groups (trainer's signal)")
    px = [r.step for r in a.steps if r.progress_samples]
    py = [r.progress_mean for r in a.steps if r.progress_samples]
    if px:
        ax.plot(px, py, "s--", color="#55A868", ms=3, lw=1, label="milestone progress (ended executions)")
    ox = [r.step for r in a.steps if r.oracle_samples]
    if ox:
        oy = [r.oracle_mean for r in a.steps if r.oracle_samples]
        ax.plot(ox, oy, "-", color="black", lw=1.5, alpha=0.7, label="oracle policy (same tasks)")
    _shade_stall(ax, a)
    v = a.verdict
    if v is not None:
        for (s0, s1), iv, color, name in (
            (v.first_steps, v.first20, "#8172B2", "first 20%"),
            (v.last_steps, v.last20, "#C44E52", "last 20%"),
        ):
            ax.axvspan(s0 - 0.4, s1 + 0.4, color=color, alpha=0.08)
            if not math.isnan(iv.mean):
                ax.hlines(iv.mean, s0 - 0.4, s1 + 0.4, color=color, lw=2, label=f"{name}: {iv.mean:.3f}")
            if not math.isnan(iv.low):
                ax.fill_between([s0 - 0.4, s1 + 0.4], iv.low, iv.high, color=color, alpha=0.2)
    ax.set_xlabel("trainer step (weight version in use)")
    ax.set_ylabel("reward incl. partial progress")
    title = "Reward per trainer step"
    if v is not None:
        if not v.judged:
            title += f" — {v.outcome}"
        else:
            title += f" — {'learned' if v.learned else 'no significant improvement'} (Δ={v.delta.mean:+.3f})"
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return _save(plt, fig, path)


def _shade_stall(ax, a: RunAnalysis) -> None:  # type: ignore[no-untyped-def]
    if a.stall is not None:
        ax.axvspan(
            a.stall.first_step - 0.5,
            a.stall.last_step + 0.5,
            color="#C44E52",
            alpha=0.12,
            hatch="//",
            label="stall",
        )


def plot_learning_health(a: RunAnalysis, path: Path) -> Path:
    """Per trainer step: entropy of generated tokens, KL to the behaviour policy, clip fraction and
    the fraction of scored groups with zero reward variance, with the stall span (if any) shaded."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(10, 6), sharex=True)
    series = (
        ("entropy", "entropy of generated tokens (nats)", "#4C72B0"),
        ("kl_behaviour", "KL(behaviour || policy) per token", "#8172B2"),
        ("clip_fraction", "clip fraction (ratio outside the clip range)", "#DD8452"),
    )
    for ax, (name, title, color) in zip(axes.flat, series, strict=False):
        xs = [r.step for r in a.steps if name in r.trainer_metrics]
        ax.plot(
            xs,
            [r.trainer_metrics[name] for r in a.steps if name in r.trainer_metrics],
            "o-",
            ms=3,
            color=color,
        )
        if not xs:
            ax.text(
                0.5,
                0.5,
                f"no '{name}' in the trainer metrics",
                ha="center",
                va="center",
                transform=ax.transAxes,
            )
        ax.set_title(title, fontsize=9)
    ax = axes.flat[3]
    xs = [r.step for r in a.steps if r.num_groups]
    ax.bar(xs, [r.zero_variance_fraction for r in a.steps if r.num_groups], color="#C44E52", alpha=0.8)
    ax.axhline(STALL_ZERO_VARIANCE, color="black", lw=0.8, ls=":", label="stall threshold")
    ax.set_ylim(0, 1.05)
    ax.set_title("groups with zero variance (no learning signal)", fontsize=9)
    for ax in axes.flat:
        _shade_stall(ax, a)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("trainer step")
    fig.suptitle(
        a.stall.message() if a.stall is not None else "Learning health: no stall", fontsize=8, wrap=True
    )
    return _save(plt, fig, path)


def _busy_bars(a: RunAnalysis, busy: BusyTime, device: str) -> list[tuple[float, float]]:
    """(start, width) of the intervals `device` computed: its engine's, and the trainer's while the
    device was leased to training (a micro-batch runs on every training device)."""
    bars = [
        (b.start_s, b.end_s - b.start_s) for b in busy.intervals if b.role == "rollout" and b.device == device
    ]
    train = [s for s in a.segments if s.device_id == device and s.role == "train"]
    for b in busy.intervals:
        if b.role != "train":
            continue
        for s in train:
            lo, hi = max(b.start_s, s.start_s), min(b.end_s, s.end_s)
            if hi > lo:
                bars.append((lo, hi - lo))
    return bars


FAULT_COLOR = "#D62728"
FAULT_ROW_H = 0.32  # a row of fault labels above the lanes, in lane units


def _fault_label_rows(marks: list[Mark], span_s: float) -> list[int]:
    """The label row of each fault: the first row where it does not overlap the label before it
    (a label's width estimated from its length: 7-point text on the 9-inch plot)."""
    ends: list[float] = []
    rows = []
    for m in marks:
        width = (len(m.label) + 1) * 0.0072 * span_s
        row = next((i for i, end in enumerate(ends) if end < m.t_s), len(ends))
        if row == len(ends):
            ends.append(0.0)
        ends[row] = m.t_s + width
        rows.append(row)
    return rows


def _mark_faults(ax: Any, marks: list[Mark], span_s: float, top: float) -> None:
    """A red line at each fault over a light span until it was back (the run's end when it never
    was; a stall's span is hatched), labelled with what it hit in rows above the lanes (`top`)."""
    for m, row in zip(marks, _fault_label_rows(marks, span_s), strict=True):
        until = max(span_s if m.until_s is None else m.until_s, m.t_s)
        ax.axvspan(
            m.t_s,
            until,
            color=FAULT_COLOR,
            alpha=0.18,
            lw=0,
            zorder=2.5,
            hatch=None if m.kind == "fault" else "//",
        )
        ax.axvline(m.t_s, color=FAULT_COLOR, lw=1.2, zorder=3)
        ax.text(
            m.t_s,
            top + (row + 0.5) * FAULT_ROW_H,
            f" {m.label}",
            va="center",
            ha="left",
            fontsize=7,
            color=FAULT_COLOR,
        )


def plot_device_roles(
    a: RunAnalysis, path: Path, busy: BusyTime | None = None, faults: list[Mark] | None = None
) -> Path:
    """Which device did rollout or training when (from lease events), with weight publications; where
    the workers logged busy time, the time each device computed is drawn dark inside its lease; each
    fault (app.job.faults) a red line, shaded until its target served again."""
    plt = _pyplot()
    devices = sorted({s.device_id for s in a.segments})
    marks = faults or []
    num_label_rows = max(_fault_label_rows(marks, a.duration_s), default=-1) + 1
    fig, ax = plt.subplots(figsize=(9, 0.5 * max(len(devices), 1) + 1.6 + 0.18 * num_label_rows))
    for i, device in enumerate(devices):
        for role in ROLES:
            bars = [
                (s.start_s, s.end_s - s.start_s)
                for s in a.segments
                if s.device_id == device and s.role == role
            ]
            if bars:
                ax.broken_barh(bars, (i - 0.4, 0.8), facecolors=ROLE_COLORS[role])
        if busy is not None and busy.logged:
            ax.broken_barh(_busy_bars(a, busy, device), (i - 0.15, 0.3), facecolors="#222222")
    for r in a.steps[1:]:
        ax.axvline(r.start_s, color="black", lw=0.5, alpha=0.3)
    top = len(devices) - 0.5
    _mark_faults(ax, marks, a.duration_s, top)
    ax.set_ylim(-0.5, top + num_label_rows * FAULT_ROW_H)
    ax.set_yticks(range(len(devices)), devices)
    ax.set_xlabel("seconds since run start (thin lines: new weight version)")
    ax.set_title(f"Device roles — policy {a.policy or '?'}, {a.num_reassignments} reassignments")
    handles = [plt.Rectangle((0, 0), 1, 1, color=ROLE_COLORS[r]) for r in ROLES]
    labels = list(ROLES)
    if busy is not None and busy.logged:
        handles.append(plt.Rectangle((0, 0), 1, 1, color="#222222"))
        labels.append("busy (computing)")
    if marks:
        handles.append(plt.Rectangle((0, 0), 1, 1, facecolor=FAULT_COLOR, alpha=0.3, edgecolor=FAULT_COLOR))
        labels.append("fault, until back")
    ax.legend(handles, labels, ncol=5, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22))
    ax.set_xlim(0, max(a.duration_s, 1e-6))
    return _save(plt, fig, path)


def plot_tree_and_dedup(a: RunAnalysis, path: Path) -> Path:
    """Tree-token ratio (flat / tree tokens of packed batches) and dedup counts per trainer step."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    xs = [r.step for r in a.steps if r.batch_tokens]
    ax1.bar(xs, [r.tree_token_ratio for r in a.steps if r.batch_tokens], color="#4C72B0")
    ax1.axhline(1.0, color="black", lw=0.8, ls=":")
    ax1.set_xlabel("trainer step")
    ax1.set_ylabel("flat tokens / tree tokens")
    ax1.set_title(f"Tree-token ratio (run: {a.tree_token_ratio:.2f}x)")
    steps = [r.step for r in a.steps]
    exact = [r.num_exact_merged for r in a.steps]
    near = [r.num_near_duplicates for r in a.steps]
    ax2.bar(steps, exact, color="#DD8452", label="exact (merged)")
    ax2.bar(steps, near, bottom=exact, color="#8172B2", label="near (down-weighted)")
    ax2.set_xlabel("trainer step")
    ax2.set_ylabel("duplicate paths")
    ax2.set_title("Deduplicated paths per step")
    ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3, axis="y")
    return _save(plt, fig, path)


def plot_staleness(a: RunAnalysis, path: Path) -> Path:
    """Histogram of trained tokens by staleness (trainer version at training - token's policy version)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    if a.staleness_token_counts:
        xs = list(a.staleness_token_counts)
        ax.bar(xs, list(a.staleness_token_counts.values()), color="#55A868")
        ax.set_xticks(xs)
    ax.set_xlabel("staleness (weight versions behind the trainer)")
    ax.set_ylabel("generated tokens")
    worst = max(a.batch_max_staleness, default=0)
    ax.set_title(f"Token staleness at training (max per batch: {worst})")
    ax.grid(alpha=0.3, axis="y")
    return _save(plt, fig, path)


def plot_time_breakdown(a: RunAnalysis, path: Path) -> Path:
    """Device-time by role, and the trainer's own timings (metrics named *_s) per step on average."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.4))
    total = sum(a.device_time_s.values()) or 1.0
    left = 0.0
    for role in ROLES:
        share = a.device_time_s.get(role, 0.0) / total
        ax1.barh([0], [share], left=left, color=ROLE_COLORS[role], label=f"{role} {share:.0%}")
        left += share
    ax1.set_xlim(0, 1)
    ax1.set_yticks([])
    ax1.set_xlabel("share of device-seconds")
    ax1.set_title("Device time by role")
    ax1.legend(fontsize=8, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    timings: dict[str, list[float]] = {}
    for r in a.steps:
        for k, v in r.trainer_metrics.items():
            if k.endswith("_s") and math.isfinite(v):
                timings.setdefault(k, []).append(v)
    if timings:
        names = sorted(timings)
        ax2.barh(names, [sum(timings[n]) / len(timings[n]) for n in names], color="#DD8452")
        ax2.set_xlabel("seconds per trainer step (mean)")
    else:
        ax2.text(0.5, 0.5, "no trainer timings (*_s metrics)", ha="center", va="center")
    ax2.set_title(f"Trainer step: {a.time_per_step_s:.1f} s wall per step")
    return _save(plt, fig, path)


def write_all(
    a: RunAnalysis, out_dir: Path, busy: BusyTime | None = None, faults: list[Mark] | None = None
) -> dict[str, Path]:
    """Every figure of the report, named by what it shows (`faults`: marked on the device plot)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return {
        "reward": plot_reward(a, out_dir / "reward.png"),
        "learning_health": plot_learning_health(a, out_dir / "learning_health.png"),
        "device_roles": plot_device_roles(a, out_dir / "device_roles.png", busy, faults),
        "tree_dedup": plot_tree_and_dedup(a, out_dir / "tree_dedup.png"),
        "staleness": plot_staleness(a, out_dir / "staleness.png"),
        "time_breakdown": plot_time_breakdown(a, out_dir / "time_breakdown.png"),
    }
