"""The run report: `run_dir/report.md`, `run_dir/summary.json` and PNG plots, from `events.jsonl` alone.

It depends on nothing but the event log (see `app.job.eventlog`), so a report can be rebuilt
for any run directory, long after the services are gone:

    python -m app.job.report runs/quickstart

`summary.json` holds the headline numbers in machine-readable form (`gyre compare` reads it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from app.job import plots
from app.job.analysis import (
    LEARNED_RULE,
    MIN_SAMPLES_PER_WINDOW,
    TOO_FEW_TO_JUDGE,
    Interval,
    RunAnalysis,
    analyse,
)
from app.job.busy import BusyTime, load_busy_time
from app.job.eventlog import EVENT_LOG_NAME, read_events
from app.job.faults import RunFaults, faults_markdown, read_faults
from app.job.stall_rule import STALL_RULE

REPORT_NAME = "report.md"
SUMMARY_NAME = "summary.json"
OUTCOME_NAME = "outcome.json"  # {"completed": bool, "reason": str}, written by `gyre run` before the report


def incomplete_reason(run_dir: Path, extra: dict[str, Any] | None = None) -> str | None:
    """Why the run did not complete (from `extra` job_completed/job_end_reason, else outcome.json);
    None when it completed or nothing says otherwise."""
    info: dict[str, Any] = {}
    if extra and "job_completed" in extra:
        info = {"completed": extra["job_completed"], "reason": extra.get("job_end_reason", "")}
    elif (run_dir / OUTCOME_NAME).is_file():
        try:
            info = json.loads((run_dir / OUTCOME_NAME).read_text())
        except ValueError:
            info = {"completed": False, "reason": f"{OUTCOME_NAME} is unreadable"}
    if not info or info.get("completed", True):
        return None
    return str(info.get("reason") or "unknown reason")


@dataclass(frozen=True)
class Report:
    analysis: RunAnalysis
    report_path: Path
    summary_path: Path
    plot_paths: dict[str, Path]
    summary: dict[str, Any]


def _num(x: float) -> float | None:
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x


def _interval_json(iv: Interval) -> dict[str, Any] | None:
    """An interval for summary.json; None when it has no sample (its mean would be nan)."""
    if iv.n == 0 or not math.isfinite(iv.mean):
        return None
    return {"mean": _num(iv.mean), "low": _num(iv.low), "high": _num(iv.high), "n": iv.n}


def finite_json(value: Any) -> Any:
    """`value` with every non-finite float replaced by None: JSON has no nan (summary.json)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(v) for v in value]
    return value


def _iv(iv: Interval) -> str:
    return iv.fmt() if iv.n and math.isfinite(iv.mean) else f"n/a (n={iv.n})"


def _distribution(values: list[int]) -> dict[str, float | None]:
    """mean, median and sigma of log (for lognormal workload fits) of positive values."""
    pos = [v for v in values if v > 0]
    if not pos:
        return {"n": 0, "mean": None, "median": None, "log_sigma": None}
    logs = [math.log(v) for v in pos]
    mu = sum(logs) / len(logs)
    sigma = math.sqrt(sum((x - mu) ** 2 for x in logs) / (len(logs) - 1)) if len(logs) > 1 else 0.0
    ordered = sorted(pos)
    return {
        "n": len(pos),
        "mean": sum(pos) / len(pos),
        "median": float(ordered[len(ordered) // 2]),
        "log_sigma": sigma,
    }


def _mean_metric(a: RunAnalysis, name: str) -> float:
    vals = [r.trainer_metrics[name] for r in a.steps if name in r.trainer_metrics]
    return sum(vals) / len(vals) if vals else math.nan


def _mean_switch_s(a: RunAnalysis) -> float:
    spans = [s.end_s - s.start_s for s in a.segments if s.role == "switching"]
    return sum(spans) / len(spans) if spans else math.nan


def busy_summary(a: RunAnalysis, busy: BusyTime) -> dict[str, Any]:
    """Busy device-seconds per role beside leased ones, the busy-based idle share, and the training
    role's share of leased and of busy device-time (of the pool's device-time). Empty without a log."""
    if not busy.logged:
        return {}
    num_devices = len({s.device_id for s in a.segments})
    pool_s = num_devices * a.duration_s
    per_role = busy.device_s()
    return {
        "busy_device_s": per_role,
        "idle_fraction_busy": _num(idle) if (idle := busy.idle_fraction(num_devices)) is not None else None,
        "train_lease_share": _num(a.device_time_s.get("train", 0.0) / pool_s if pool_s > 0 else math.nan),
        "train_busy_share": _num(per_role.get("train", 0.0) / pool_s if pool_s > 0 else math.nan),
    }


def summary_of(
    a: RunAnalysis, extra: dict[str, Any] | None = None, busy: BusyTime | None = None
) -> dict[str, Any]:
    """Headline numbers of a run (JSON-ready: non-finite numbers become null)."""
    out: dict[str, Any] = {
        **(busy_summary(a, busy) if busy is not None else {}),
        "run_id": a.run_id,
        "policy": a.policy,
        "num_steps": a.num_steps,
        "duration_s": _num(a.duration_s),
        "time_per_step_s": _num(a.time_per_step_s),
        "device_idle_fraction": _num(a.device_idle_fraction),
        "device_time_s": a.device_time_s,
        "num_devices": len({s.device_id for s in a.segments}),
        "num_reassignments": a.num_reassignments,
        "tokens_per_s": _num(a.tokens_per_s),
        "num_llm_calls": a.num_llm_calls,
        "num_completion_tokens": a.num_completion_tokens,
        "num_migrations": a.num_migrations,
        "tree_token_ratio": _num(a.tree_token_ratio),
        "num_exact_merged": sum(r.num_exact_merged for r in a.steps),
        "num_near_duplicates": sum(r.num_near_duplicates for r in a.steps),
        "max_batch_staleness": max(a.batch_max_staleness, default=None),
        "executions": a.execution_counts,
        "context_events": a.num_context_events,
        "num_events": a.num_events,
        "reward_curve": [_num(r.reward_mean) for r in a.steps],
        "num_groups_scored": sum(r.num_groups for r in a.steps),
        "batch_tokens": sum(r.batch_tokens for r in a.steps),
        "execution_context_tokens": _distribution(a.execution_context_tokens),
        "execution_num_calls": _distribution(a.execution_num_calls),
        "execution_generated_tokens": _distribution(a.execution_generated_tokens),
        "mean_switch_s": _num(_mean_switch_s(a)),
        "train_device_s": a.device_time_s.get("train", 0.0),
        "trainer_step_s": _num(_mean_metric(a, "step_s")),
        "trainer_tokens_per_step": _num(_mean_metric(a, "num_tokens")),
        "rollout_device_s": a.device_time_s.get("rollout", 0.0),
    }
    v = a.verdict
    if v is not None:
        out.update(
            reward_first20=_interval_json(v.first20),
            reward_last20=_interval_json(v.last20),
            reward_delta=_interval_json(v.delta),
            learned=v.learned,
            verdict=v.outcome,
            first20_steps=list(v.first_steps),
            last20_steps=list(v.last_steps),
        )
    else:
        out.update(
            reward_first20=None,
            reward_last20=None,
            reward_delta=None,
            learned=False,
            verdict=TOO_FEW_TO_JUDGE,
        )
    out["min_samples_per_window"] = MIN_SAMPLES_PER_WINDOW
    out["learned_rule"] = LEARNED_RULE
    out.update(learning_health_summary(a))
    if extra:
        out.update(extra)
    return out


def learning_health_summary(a: RunAnalysis) -> dict[str, Any]:
    """Oracle reward, the last window's share of it, trainer health means and the stall (or None)."""
    oracle = [x for r in a.steps for x in r.oracle_samples]
    out: dict[str, Any] = {"oracle_reward": _num(sum(oracle) / len(oracle)) if oracle else None}
    v = a.verdict
    if v is not None:
        l0, l1 = v.last_steps
        last_oracle = [x for r in a.steps if l0 <= r.step <= l1 for x in r.oracle_samples]
        if last_oracle and math.isfinite(v.last20.mean):
            out["reward_last20_of_oracle"] = v.last20.mean / (sum(last_oracle) / len(last_oracle))
    groups = sum(r.num_groups for r in a.steps)
    out["zero_variance_group_fraction"] = (
        sum(r.num_zero_variance_groups for r in a.steps) / groups if groups else None
    )
    for name in ("entropy", "kl_behaviour", "clip_fraction"):
        out[f"trainer_{name}_mean"] = _num(_mean_metric(a, name))
    st = a.stall
    out["stall"] = (
        None
        if st is None
        else {
            "first_step": st.first_step,
            "last_step": st.last_step,
            "zero_variance_fraction": st.zero_variance_fraction,
            "reward": st.reward,
            "oracle": st.oracle,
            "message": st.message(),
        }
    )
    out["stall_rule"] = STALL_RULE
    return out


def learning_health_markdown(a: RunAnalysis, rel: dict[str, str]) -> list[str]:
    """report.md's learning-health section: why the run learns, or why it stopped."""
    lines = [
        "## Learning health",
        "",
        f"![learning health]({rel['learning_health']})",
        "",
        f"**{a.stall.message()}**" if a.stall is not None else "No stall.",
        "",
        f"Rule: {STALL_RULE}. Entropy (nats) is that of the policy at the generated tokens; KL is the k3 "
        "estimate of KL(behaviour || policy) over the trained tokens (how far the weights moved since the "
        "tokens were sampled); clip fraction is the share of trained tokens whose importance ratio lies "
        "outside the clip range; the oracle is the reward a perfect policy gets on the same tasks (the "
        "environment's own number).",
        "",
        "| step | reward | oracle | zero-variance groups | entropy | KL to behaviour | clip fraction |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in a.steps:
        m = r.trainer_metrics
        lines.append(
            f"| {r.step} | {_fmt(r.reward_mean, 3)} | {_fmt(r.oracle_mean, 3)} | "
            f"{_fmt(r.zero_variance_fraction)} ({r.num_zero_variance_groups}/{r.num_groups}) | "
            f"{_fmt(m.get('entropy', math.nan), 3)} | {_fmt(m.get('kl_behaviour', math.nan), 4)} | "
            f"{_fmt(m.get('clip_fraction', math.nan), 3)} |"
        )
    return [*lines, ""]


def headline(a: RunAnalysis, incomplete: str | None = None) -> list[str]:
    """The lines `gyre run` prints at the end (and report.md repeats). A run that did not complete
    (`incomplete`: why) says so first and never claims it learned."""
    v = a.verdict
    if incomplete is not None:
        seen = "n/a" if v is None else f"{v.delta.fmt()} over the steps it ran"
        return [
            f"run did NOT complete: {incomplete}",
            f"improvement:    {seen}",
            "learned: not judged (the run did not complete)",
        ]
    if v is None:
        return [
            "reward_first20: n/a (fewer than 2 trainer steps)",
            "reward_last20: n/a",
            f"learned: {TOO_FEW_TO_JUDGE} (fewer than 2 trainer steps)",
        ]
    lines = [
        f"reward_first20: {_iv(v.first20)}  (steps {v.first_steps[0]}-{v.first_steps[1]}, 95% bootstrap CI)",
        f"reward_last20:  {_iv(v.last20)}  (steps {v.last_steps[0]}-{v.last_steps[1]}, 95% bootstrap CI)",
    ]
    if v.judged:
        lines.append(f"improvement:    {v.delta.fmt()}  -> learned: {v.outcome}")
    else:
        lines.append(f"learned: {TOO_FEW_TO_JUDGE} ({v.why_not_judged()})")
    share = learning_health_summary(a).get("reward_last20_of_oracle")
    if share is not None:
        lines.append(f"reward_last20 / oracle: {share:.1%}")
    if a.stall is not None:  # a stall is said in the run's output, not only in report.md
        lines.append(a.stall.message())
    return lines


def _fmt(x: float, digits: int = 2) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def service_counters(run_dir: Path) -> dict[str, float]:
    """The trajectory service's final counters (final_stats.json written by `gyre run`), or {}."""
    path = run_dir / "final_stats.json"
    try:
        values = json.loads(path.read_text())["trajectory"]["values"]
        return {k: float(v) for k, v in values.items()}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def supervisor_restarts(run_dir: Path) -> dict[str, int]:
    """Service -> times the launcher's supervisor restarted it (final_stats.json), or {}."""
    try:
        restarts = json.loads((run_dir / "final_stats.json").read_text())["launcher"]["restarts"]
        return {str(k): int(v) for k, v in restarts.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _device_time_table(a: RunAnalysis, busy: BusyTime | None, total_dev: float) -> list[str]:
    """Leased device-seconds per role and, where the workers logged it, busy ones beside them."""
    if busy is None or not busy.logged:
        return [
            "| role | device-seconds leased | share |",
            "|---|---:|---:|",
            *[f"| {role} | {sec:.1f} | {sec / total_dev:.0%} |" for role, sec in a.device_time_s.items()],
        ]
    done = busy.device_s()
    rows = []
    for role, sec in a.device_time_s.items():
        b = done.get(role)
        used = f"{b:.1f} | {b / sec:.0%}" if b is not None and sec > 0 else "- | -"
        rows.append(f"| {role} | {sec:.1f} | {sec / total_dev:.0%} | {used} |")
    return [
        "| role | device-seconds leased | share | device-seconds busy | busy / leased |",
        "|---|---:|---:|---:|---:|",
        *rows,
    ]


def _busy_lines(a: RunAnalysis, busy: BusyTime | None) -> list[str]:
    if busy is None or not busy.logged:
        return ["", "No busy-time log in this run directory (pacing/*.jsonl): busy time is not shown."]
    s = busy_summary(a, busy)
    return [
        "",
        f"Idle share by busy time (1 - busy device-seconds / pool device-seconds, the simulator's "
        f"definition): **{_fmt(s['idle_fraction_busy'], 3)}**. Training held "
        f"{_fmt(s['train_lease_share'], 3)} of the pool's device-time by lease and computed "
        f"{_fmt(s['train_busy_share'], 3)} of it. In the plot, the dark line inside a lease is the time "
        f"that device computed.",
        *_elastic_lease_lines(a, s),
    ]


def _elastic_lease_lines(a: RunAnalysis, s: dict[str, Any]) -> list[str]:
    """Under elastic: training's lease share against max(one device's share, 2 x its busy share), and
    why a run with at most one reassignment kept its split (the policy's cost rules)."""
    devices = len({seg.device_id for seg in a.segments})
    lease, busy = s["train_lease_share"], s["train_busy_share"]
    if a.policy != "elastic" or not devices or not all(isinstance(x, float) for x in (lease, busy)):
        return []
    bound = max(1.0 / devices, 2.0 * busy)
    verdict = "within" if lease <= bound else "over"
    lines = [
        "",
        f"Training's lease share {_fmt(lease, 3)} is {verdict} max(one device's share "
        f"{_fmt(1.0 / devices, 3)}, 2 x its busy share {_fmt(2.0 * busy, 3)}) = {_fmt(bound, 3)}.",
    ]
    if a.num_reassignments <= 1:
        lines.append(
            "Elastic held its split after the trainer's first device: it lends the trainer more only for "
            "a step whose training outlasts two role changes, and moves a device otherwise only when the "
            "trainer's step cadence exceeds `elastic_min_step_over_switch` role changes "
            "(docs/scheduler.md), so on short steps it keeps the split it took at the start."
        )
    return lines


def render_markdown(
    a: RunAnalysis,
    plot_paths: dict[str, Path],
    run_dir: Path,
    incomplete: str | None = None,
    busy: BusyTime | None = None,
    faults: RunFaults | None = None,
) -> str:
    """report.md text (`incomplete`: why the run did not complete, stated at the top)."""
    counters = service_counters(run_dir)
    restarts = supervisor_restarts(run_dir)
    service_ratio = (
        counters["batched_flat_tokens"] / counters["batched_tokens"]
        if counters.get("batched_tokens")
        else math.nan
    )
    rel = {
        k: p.relative_to(run_dir).as_posix() if p.is_relative_to(run_dir) else str(p)
        for k, p in plot_paths.items()
    }
    lines = [f"# Gyre run report: `{a.run_id or run_dir.name}`", ""]
    if incomplete is not None:
        lines += [f"**This run did not complete** ({incomplete}); its numbers cover only what ran.", ""]
    lines += [
        f"Policy **{a.policy or 'unknown'}**, {a.num_steps} trainer steps in {_fmt(a.duration_s, 1)} s "
        f"({_fmt(a.time_per_step_s, 1)} s per step), {len({s.device_id for s in a.segments})} devices, "
        f"{a.num_reassignments} device reassignments.",
        "",
        "## Did it learn?",
        "",
        "```",
        *headline(a, incomplete),
        "```",
        "",
        f"Rule: {LEARNED_RULE}. One sample per group and trainer step: the mean score of the group's "
        "executions that ended in that step (final reward if finished, else partial progress = milestones "
        "reached / total), as the environment reported them; intervals are 95% percentile-bootstrap "
        "intervals (5000 resamples, fixed seed). The scored groups' reward (the trainer's signal) is "
        "plotted too.",
        "",
        f"![reward]({rel['reward']})",
        "",
        "| step | groups scored | reward | scored reward | progress | tree ratio | exact dups | near dups | batches |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in a.steps:
        lines.append(
            f"| {r.step} | {r.num_groups} | {_fmt(r.reward_mean, 3)} | "
            f"{_fmt(sum(r.scored_samples) / len(r.scored_samples) if r.scored_samples else math.nan, 3)} | "
            f"{_fmt(r.progress_mean, 3)} | "
            f"{_fmt(r.tree_token_ratio)} | {r.num_exact_merged} | {r.num_near_duplicates} | {r.num_batches} |"
        )
    total_dev = sum(a.device_time_s.values()) or 1.0
    lines += ["", *learning_health_markdown(a, rel)]
    lines += [
        "## Devices",
        "",
        f"![device roles]({rel['device_roles']})",
        "",
        *_device_time_table(a, busy, total_dev),
        "",
        f"Share of device-time without a lease or in a handoff (idle + switching, by lease): "
        f"**{_fmt(a.device_idle_fraction, 3)}**.",
        *_busy_lines(a, busy),
        "",
        "Services restarted by the supervisor: "
        + (", ".join(f"{svc} {n}x" for svc, n in sorted(restarts.items())) or "none")
        + " (a service that exits unexpectedly is restarted within the launcher's budget).",
        "",
        *faults_markdown(faults if faults is not None else read_faults(run_dir, a.start_unix_s)),
        "## Trajectories: trees and dedup",
        "",
        f"![tree and dedup]({rel['tree_dedup']})",
        "",
        f"- LLM calls: {a.num_llm_calls}; generated tokens: {a.num_completion_tokens} "
        f"({_fmt(a.tokens_per_s, 1)} tokens/s); live migrations: {a.num_migrations}",
        f"- context events (non-prefix histories): {a.num_context_events or 'none'}",
        f"- tree-token ratio over all batches (flat tokens / tree tokens): {_fmt(a.tree_token_ratio)}{'x' if math.isfinite(a.tree_token_ratio) else ''} from "
        f"batch-ready events; {_fmt(service_ratio)}{'x' if math.isfinite(service_ratio) else ''} from the trajectory service's final counters "
        f"({int(counters.get('batches_built', 0))} batches built)",
        f"- exact duplicates merged: {sum(r.num_exact_merged for r in a.steps)}; "
        f"near duplicates down-weighted: {sum(r.num_near_duplicates for r in a.steps)}",
        f"- executions: {a.execution_counts or 'none'}",
        "",
        "## Staleness",
        "",
        f"![staleness]({rel['staleness']})",
        "",
        "Staleness of a generated token = the trainer's weight version when the first batch after its "
        "execution ended was announced, minus the version that generated the token (an estimate: the "
        "event stream does not say which batch holds which token). Per batch, the exact bound "
        "(trainer version - oldest policy version in the batch) peaked at "
        f"{max(a.batch_max_staleness, default=0)}. Tokens never trained before the run stopped: "
        f"{a.num_untrained_tokens}.",
        "",
        "## Time breakdown",
        "",
        f"![time breakdown]({rel['time_breakdown']})",
        "",
    ]
    metric_names = sorted({k for r in a.steps for k in r.trainer_metrics})
    if metric_names:
        lines += ["Trainer metrics (mean over steps):", "", "| metric | mean |", "|---|---:|"]
        for name in metric_names:
            vals = [r.trainer_metrics[name] for r in a.steps if name in r.trainer_metrics]
            lines.append(f"| {name} | {_fmt(sum(vals) / len(vals), 4)} |")
        lines.append("")
    lines += ["Events recorded: " + ", ".join(f"{k} {n}" for k, n in a.num_events.items()), ""]
    return "\n".join(lines)


def configured_policy(run_dir: Path) -> str:
    """The policy the run's scheduler was started with (<run_dir>/config.yaml), "" if unknown."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        return ""
    raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    return str((raw.get("scheduler") or {}).get("policy") or "")


def build_report(run_dir: Path, *, extra: dict[str, Any] | None = None, seed: int = 0) -> Report:
    """Read `run_dir/events.jsonl`, write report.md, summary.json and plots/*.png; return them."""
    events_path = run_dir / EVENT_LOG_NAME
    if not events_path.is_file():
        raise FileNotFoundError(f"{events_path} does not exist: pass the run directory of a `gyre run`")
    analysis = analyse(read_events(events_path), seed=seed)
    analysis.policy = configured_policy(run_dir) or analysis.policy
    incomplete = incomplete_reason(run_dir, extra)
    busy = load_busy_time(run_dir, analysis.start_unix_s, analysis.duration_s)
    faults = read_faults(run_dir, analysis.start_unix_s)
    plot_paths = plots.write_all(analysis, run_dir / "plots", busy, faults.marks())
    report_path = run_dir / REPORT_NAME
    report_path.write_text(
        render_markdown(analysis, plot_paths, run_dir, incomplete, busy, faults), encoding="utf-8"
    )
    counters = service_counters(run_dir)
    if counters.get("batched_tokens"):
        extra = {
            **(extra or {}),
            "service_tree_token_ratio": counters["batched_flat_tokens"] / counters["batched_tokens"],
        }
    summary = summary_of(analysis, extra, busy)
    summary["completed"] = incomplete is None
    if incomplete is not None:  # a run that died is never reported as having learned
        summary["learned_over_steps_run"] = summary["learned"]
        summary["learned"] = False
    summary_path = run_dir / SUMMARY_NAME
    text = json.dumps(finite_json(summary), indent=2, sort_keys=True, allow_nan=False)
    summary_path.write_text(text + "\n", encoding="utf-8")
    return Report(analysis, report_path, summary_path, plot_paths, summary)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.job.report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="run directory holding events.jsonl")
    args = parser.parse_args(argv)
    try:
        report = build_report(args.run_dir)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(headline(report.analysis, incomplete_reason(args.run_dir))))
    print(f"report: {report.report_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
