"""`--plot FILE.png`: each policy's device-role timeline (one row per engine unit) and utilization."""

from __future__ import annotations

from pathlib import Path

from services.scheduler.sim.compare import Comparison

_COLORS = {"rollout": "#4C72B0", "train": "#DD8452", "switching": "#999999", "idle": "#EEEEEE"}


def plot_comparison(c: Comparison, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names = list(c.results)
    fig, axes = plt.subplots(len(names), 1, figsize=(12, 3.2 * len(names)), sharex=True)
    hours = 3600.0
    for ax, name in zip(axes, names, strict=True):
        r = c.results[name]
        for uid, t0, t1, label in r.timeline:
            ax.broken_barh([(t0 / hours, (t1 - t0) / hours)], (uid - 0.4, 0.8), color=_COLORS.get(label, "k"))
        for t in r.step_done_s:
            ax.axvline(t / hours, color="k", lw=0.5, alpha=0.3)
        ax.set_ylabel("engine unit")
        ax.set_title(f"{r.policy}: {r.time_per_step_s:.0f} s/step, utilization {r.device_utilization:.0%}")
        ax2 = ax.twinx()
        xs = [t / hours for t, _ in r.utilization_series]
        ys = [u for _, u in r.utilization_series]
        ax2.step(xs, ys, where="post", color="k", lw=0.8)
        ax2.set_ylim(0, 1.05)
        ax2.set_ylabel("busy share")
    axes[-1].set_xlabel("virtual time (h); vertical lines: training steps done")
    fig.legend(handles=[Patch(color=v, label=k) for k, v in _COLORS.items()], loc="upper right", ncol=4)
    fig.suptitle(f"workload {c.workload.name}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
