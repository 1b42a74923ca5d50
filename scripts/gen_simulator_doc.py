"""Regenerate the figures of docs/simulator.md from the simulator itself.

    .venv/bin/python scripts/gen_simulator_doc.py [--seeds 5] [--out docs/simulator.md] [--json-out F]
    .venv/bin/python scripts/gen_simulator_doc.py --from-json F     # re-render without simulating

Every workload (the built-ins and examples/workloads/*.yaml) runs as `gyre sim --workload W --json
--seeds N` would; the sensitivity table reruns `xlong` (its seed) with each assumed [G] parameter at
0.5x and 1.5x. `--cache DIR` keeps each workload-seed result so an interrupted run resumes;
`--partial` renders only what is cached (each workload then says how many seeds it got). The prose
is scripts/simulator_doc_template.md; every figure in the page is filled in here.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import pickle
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gyre.workload import BUILTIN_WORKLOADS, Workload, builtin, load_workload_file  # noqa: E402
from services.scheduler.sim.compare import Comparison, SeedComparison, compare, with_seed  # noqa: E402

SENSITIVITY_WORKLOAD = "xlong"  # the headline workload, where Elastic moves devices (about 10 s a comparison)
PARTIAL_CUTOFF_S = 3600.0  # [G] one hour after a group's first execution ended

# Assumed [G] parameters of the cost model and workload, as (label, path into the workload dump).
ASSUMED: list[tuple[str, tuple[str, ...]]] = [
    ("bandwidth_efficiency", ("hardware", "bandwidth_efficiency")),
    ("peak_flops (H200 dense BF16)", ("hardware", "peak_flops")),
    ("host_bandwidth_bytes_s", ("hardware", "host_bandwidth_bytes_s")),
    ("kv_memory_reserve", ("hardware", "kv_memory_reserve")),
    ("train_mfu", ("costs", "train_mfu")),
    ("prefill_mfu", ("costs", "prefill_mfu")),
    ("elastic_role_change_s", ("costs", "elastic_role_change_s")),
    ("planning_context_share", ("costs", "planning_context_share")),
    ("train_microbatch_tokens", ("costs", "train_microbatch_tokens")),
    ("context_median_tokens", ("domains", "0", "context_median_tokens")),
    ("execution_env_scale_sigma", ("domains", "0", "execution_env_scale_sigma")),
]


def _scaled(w: Workload, path: tuple[str, ...], factor: float) -> Workload | None:
    data: Any = w.model_dump()
    node = data
    for key in path[:-1]:
        node = node[int(key)] if isinstance(node, list) else node[key]
    value = node[path[-1]] * factor
    if path[-1] in ("bandwidth_efficiency", "train_mfu", "prefill_mfu"):
        value = min(1.0, value)
    if path[-1] == "kv_memory_reserve":
        value = min(0.9, value)
    node[path[-1]] = value
    try:
        return Workload.model_validate(data)
    except ValueError:
        return None


def _workloads() -> list[tuple[str, Workload]]:
    out = [(f"--workload {name}", builtin(name)) for name in BUILTIN_WORKLOADS]
    for f in sorted((ROOT / "examples" / "workloads").glob("*.yaml")):
        out.append((f"--workload-file examples/workloads/{f.name}", load_workload_file(f)))
    # Gyre's partial-progress scoring on the paper's setting (tokens trained reported beside it).
    x = builtin("xlong")
    sem = x.service.model_copy(update={"train_unfinished_after_s": PARTIAL_CUTOFF_S})
    out.append(
        (
            f"--workload xlong --train-unfinished-after-s {PARTIAL_CUTOFF_S:.0f}",
            x.model_copy(update={"service": sem}),
        )
    )
    return out


def _compare(w: Workload) -> Comparison:
    c = compare(w)
    for r in c.results.values():  # only the figures travel back from the worker
        r.timeline, r.utilization_series, r.snapshots = [], [], []
    return c


def _cached(cache: Path | None, key: str, w: Workload) -> Comparison:
    """`_compare(w)`, kept on disk under `cache` so an interrupted regeneration resumes."""
    if cache is None:
        return _compare(w)
    f = cache / (key.replace("/", "_") + ".pkl")
    if f.exists():
        return pickle.loads(f.read_bytes())
    c = _compare(w)
    f.write_bytes(pickle.dumps(c))
    return c


def _task(args: tuple[Path | None, str, Workload]) -> Comparison:
    return _cached(*args)


def compute(
    seeds: int, workers: int, cache: Path | None, partial: bool = False, skip_sensitivity: bool = False
) -> dict[str, Any]:
    """Every figure of the page: per workload the `gyre sim --json --seeds N` object, and the
    sensitivity ratios of `xlong` at 0.5x / 1.5x of each assumed parameter. Workload-seed pairs run
    in `workers` processes; each is the same `compare` that `gyre sim` runs."""
    jobs = _workloads()
    tasks = [
        (cache, f"{cmd} seed {w.seed + i}", with_seed(w, w.seed + i)) for cmd, w in jobs for i in range(seeds)
    ]
    base = builtin(SENSITIVITY_WORKLOAD)
    scaled = [(label, f, _scaled(base, path, f)) for label, path in ASSUMED for f in (0.5, 1.5)]
    sens_tasks = [(cache, "sensitivity reference", base)] + [
        (cache, f"sensitivity {label} x{f}", w) for label, f, w in scaled if w is not None
    ]
    # Cheapest first, so that what finishes first is whole workloads.
    order = sorted(
        range(len(tasks)),
        key=lambda i: tasks[i][2].num_units * len(tasks[i][2].domains) * tasks[i][2].num_steps,
    )
    # Whole workloads first: an interrupted run (`--partial`) renders them without the sensitivity rows.
    queue = [tasks[i] for i in order] + ([] if skip_sensitivity else sens_tasks)
    if partial:  # render what an interrupted run finished; say how many seeds each workload got
        queue = [t for t in queue if t[0] is not None and (t[0] / (t[1].replace("/", "_") + ".pkl")).exists()]
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        results = dict(zip([t[1] for t in queue], pool.map(_task, queue, chunksize=1), strict=True))
    runs = []
    for cmd, w in jobs:
        got = [results[t[1]] for t in tasks if t[1].startswith(f"{cmd} seed ") and t[1] in results]
        if not got:
            print(f"not run: {cmd}", flush=True)
            continue
        out = SeedComparison(w, got).to_json()
        out["command"] = f"gyre sim {cmd} --json --seeds {len(got)}"
        runs.append(out)
        print(out["command"], out["speedup"]["vs_best_baseline"], flush=True)
    if not all(t[1] in results for t in sens_tasks):
        return {"seeds": seeds, "runs": runs, "sensitivity": None}  # not run: the page says so
    sens_done = iter(results[t[1]] for t in sens_tasks)
    sens: dict[str, Any] = {"reference": next(sens_done).ratios(), "rows": []}
    rows: dict[str, dict[str, Any]] = {}
    for label, f, scaled_w in scaled:
        row = rows.setdefault(label, {"parameter": label})
        row[str(f)] = None if scaled_w is None else next(sens_done).ratios()
    sens["rows"] = list(rows.values())
    return {"seeds": seeds, "runs": runs, "sensitivity": sens}


def _fmt(v: dict[str, float]) -> str:
    return f"{v['mean']:.2f} [{v['low']:.2f}, {v['high']:.2f}]"


def _fmt3(v: dict[str, float]) -> str:
    return f"{v['mean']:.3f}x [{v['low']:.3f}, {v['high']:.3f}]"


def _drifting(out: dict[str, Any]) -> bool:
    """A workload whose schedule drifts over the measured steps (more than one drift phase)."""
    return len(out["drift_phases"]) > 1


def _pair(r: dict[str, float] | None) -> str:
    return "invalid (does not fit)" if r is None else f"{r['vs_best_baseline']:.3f} / {r['vs_colocate']:.3f}"


def render(data: dict[str, Any]) -> str:
    runs = data["runs"]
    head = [
        "| workload | vs best baseline | vs best baseline, by makespan | vs Colocate | vs swept Async | vs Async at half "
        "| vs Async at a split tuned on another seed | vs per-phase oracle "
        "| vs paper Colocate | vs paper Async "
        "| Elastic s/step | generated tokens trained (Elastic / paper Async) | Elastic makespan / lower bound | best Async rollout devices per seed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for out in runs:
        s, e = out["speedup"], out["elastic"]
        name = out["workload"] + (
            " + cut-off" if out["service"]["train_unfinished_after_s"] is not None else ""
        )
        oracle = _fmt(s["vs_phase_oracle"]) if _drifting(out) else "-"
        head.append(
            f"| {name} | {_fmt(s['vs_best_baseline'])} | {_fmt(out['makespan_speedup']['vs_best_baseline'])} | "
            f"{_fmt(s['vs_colocate'])} | {_fmt(s['vs_async'])} | "
            f"{_fmt(s['vs_async_half'])} | {_fmt(s['vs_async_reused']) if 'vs_async_reused' in s else '-'} | {oracle} | "
            f"{_fmt(s['vs_paper_colocate'])} | {_fmt(s['vs_paper_async'])} | {e['time_per_step_s']['mean']:,.0f} | "
            f"{e['generated_trained_share']:.1%} / {out['paper_async']['generated_trained_share']:.1%} | "
            f"{e['makespan_over_lower_bound']:.2f} | {out['best_async_rollout_devices']} |"
        )
    commands = "\n".join(out["command"] for out in runs)
    plain = [r for r in runs if r["service"]["train_unfinished_after_s"] is None]
    stationary = [r for r in plain if not _drifting(r)]
    drifting = [r for r in plain if _drifting(r)]
    means = [r["speedup"]["vs_best_baseline"]["mean"] for r in plain]
    still = [r["speedup"]["vs_best_baseline"]["mean"] for r in stationary]
    summary = (
        f"Over the {len(plain)} workloads at the live services' defaults (no cut-off), Elastic's speedup over the best "
        f"baseline averages {sum(means) / len(means):.3f}x (per-workload means from {min(means):.3f}x to "
        f"{max(means):.3f}x); over the {len(stationary)} stationary ones {sum(still) / len(still):.3f}x."
    )
    sens = data["sensitivity"]
    if sens is None:
        rows = [
            "**Not rerun for this page** (`--skip-sensitivity`: the regeneration had no time for its "
            f"{2 * len(ASSUMED) + 1} whole comparisons of `{SENSITIVITY_WORKLOAD}`); the table of the "
            "previous page, in git history, was measured with an earlier Elastic."
        ]
    else:
        rows = [
            f"| assumed parameter (`{SENSITIVITY_WORKLOAD}`, its seed) | x0.5: vs best / vs Colocate | x1.5: vs best / vs Colocate |",
            "|---|---|---|",
            f"| (defaults) | {_pair(sens['reference'])} | {_pair(sens['reference'])} |",
        ]
        rows += [f"| {r['parameter']} | {_pair(r['0.5'])} | {_pair(r['1.5'])} |" for r in sens["rows"]]
    xlong = next(r for r in plain if r["workload"] == "xlong")
    cut = [
        r for r in runs if r["workload"] == "xlong" and r["service"]["train_unfinished_after_s"] is not None
    ]

    def met(ok: bool) -> str:
        return "met" if ok else "**not met**"

    below = [
        f"{r['workload']} {r['speedup']['vs_best_baseline']['mean']:.3f}x "
        f"[{r['speedup']['vs_best_baseline']['low']:.3f}, {r['speedup']['vs_best_baseline']['high']:.3f}]"
        for r in stationary
        if r["speedup"]["vs_best_baseline"]["mean"] < 0.98
    ]
    below_reused = [
        f"{r['workload']} {_fmt3(r['speedup']['vs_async_reused'])}"
        for r in stationary
        if "vs_async_reused" in r["speedup"] and r["speedup"]["vs_async_reused"]["mean"] < 0.98
    ]
    below_makespan = [
        f"{r['workload']} {_fmt3(r['makespan_speedup']['vs_best_baseline'])}"
        for r in stationary
        if r["makespan_speedup"]["vs_best_baseline"]["mean"] < 0.98
    ]
    xs = xlong["speedup"]
    xc = xlong["makespan_speedup_ceiling"]
    ceiling_mean = sum(r["makespan_speedup_ceiling"]["vs_best_baseline"]["mean"] for r in plain) / len(plain)
    ceilings = [
        "| workload | ceiling vs best baseline | ceiling vs per-phase oracle | ceiling vs Colocate "
        "| ceiling vs paper Colocate | ceiling vs paper Async | Elastic makespan / lower bound |",
        "|---|---|---|---|---|---|---|",
    ]
    for out in runs:
        c = out["makespan_speedup_ceiling"]
        name = out["workload"] + (
            " + cut-off" if out["service"]["train_unfinished_after_s"] is not None else ""
        )
        ceilings.append(
            f"| {name} | {_fmt(c['vs_best_baseline'])} | "
            f"{_fmt(c['vs_phase_oracle']) if _drifting(out) else '-'} | {_fmt(c['vs_colocate'])} | "
            f"{_fmt(c['vs_paper_colocate'])} | {_fmt(c['vs_paper_async'])} | "
            f"{out['elastic']['makespan_over_lower_bound']:.2f} |"
        )
    loosest = max(plain, key=lambda r: r["makespan_speedup_ceiling"]["vs_best_baseline"]["mean"])
    rest = [r["makespan_speedup_ceiling"]["vs_best_baseline"]["mean"] for r in plain if r is not loosest]
    ceilings.append("")
    ceilings.append(
        f"Mean ceiling over the best baseline across the {len(plain)} workloads without a cut-off: "
        f"{ceiling_mean:.3f}x; without {loosest['workload']}, the highest "
        f"({loosest['makespan_speedup_ceiling']['vs_best_baseline']['mean']:.2f}x): {sum(rest) / len(rest):.3f}x. "
        f"Even with every other workload at its ceiling, a 1.2x mean needs "
        f"{1.2 * len(plain) - sum(rest):.2f}x on {loosest['workload']}."
    )
    worst = min(
        ((r["workload"], v) for r in stationary for v in r["speedup_per_seed"]["vs_best_baseline"]),
        key=lambda x: x[1],
    )

    def reach(target: float, ceiling: dict[str, float]) -> str:
        if ceiling["mean"] < target:
            return f"out of reach of any policy on the mean (ceiling {_fmt(ceiling)} < {target}x)"
        return f"within the ceiling ({_fmt(ceiling)})"

    status = [
        f"- Elastic >= 0.98x of the best baseline on every stationary workload (mean over seeds): {met(not below)}"
        + (f"; below: {', '.join(below)}" if below else "")
        + f" (lowest single seed: {worst[0]} {worst[1]:.3f}x).",
        "- The same on makespans (the whole run, warm-up included; the swept best split as above): "
        f"{met(not below_makespan)}" + (f"; below: {', '.join(below_makespan)}." if below_makespan else "."),
        "- Against Async at the split tuned on another seed (what a sweep buys an operator on the next "
        f"run), >= 0.98x on every stationary workload: {met(not below_reused)}"
        + (f"; below: {', '.join(below_reused)}." if below_reused else "."),
        f"- Mean >= 1.2x over all workloads: {met(sum(means) / len(means) >= 1.2)} ({sum(means) / len(means):.3f}x; "
        f"the mean makespan ceiling over the best baseline is {ceiling_mean:.3f}x"
        + (
            ", below 1.2x: out of reach of any policy on makespans)."
            if ceiling_mean < 1.2
            else ", within reach in principle)."
        ),
        f"- xlong >= 2.0x vs Colocate at equal work: {met(xs['vs_colocate']['mean'] >= 2.0)} ({_fmt(xs['vs_colocate'])}; "
        f"{reach(2.0, xc['vs_colocate'])}).",
        f"- Paper-baselines row on xlong >= 1.85x vs Colocate and >= 1.78x vs Async: "
        f"{met(xs['vs_paper_colocate']['mean'] >= 1.85 and xs['vs_paper_async']['mean'] >= 1.78)} "
        f"({_fmt(xs['vs_paper_colocate'])}, {reach(1.85, xc['vs_paper_colocate'])}; and "
        f"{_fmt(xs['vs_paper_async'])}, {reach(1.78, xc['vs_paper_async'])}).",
    ]
    for r in drifting:
        c, ce = r["speedup"], r["makespan_speedup_ceiling"]
        status.append(
            f"- Drifting `{r['workload']}`: >= 1.10x the best single fixed split "
            f"{met(c['vs_best_baseline']['mean'] >= 1.10)} ({_fmt(c['vs_best_baseline'])}, "
            f"{reach(1.10, ce['vs_best_baseline'])}); >= 1.05x the per-phase oracle "
            f"{met(c['vs_phase_oracle']['mean'] >= 1.05)} ({_fmt(c['vs_phase_oracle'])}, "
            f"{reach(1.05, ce['vs_phase_oracle'])}); against the oracle stitched from per-phase minima "
            f"{_fmt(c['vs_phase_oracle_stitched'])}; against Async at half {_fmt(c['vs_async_half'])}."
        )
    for r in cut:
        c = r["speedup"]
        status.append(
            f"- With the {r['service']['train_unfinished_after_s']:.0f} s cut-off on xlong (Elastic trains "
            f"{r['elastic']['generated_trained_share']:.1%} of generated tokens, the paper rows 100%): "
            f"{_fmt(c['vs_paper_colocate'])} vs paper Colocate, {_fmt(c['vs_paper_async'])} vs paper Async, "
            f"{_fmt(c['vs_colocate'])} vs Colocate with the same cut-off."
        )
    co = xlong["colocate"]
    calibration = (
        f"rollout is {co['rollout_share']:.1%} of the step (target 70–90%), the last 10% of executions take "
        f"{co['tail_share']:.1%} of rollout time (target >= 40%)."
    )
    template = (ROOT / "scripts" / "simulator_doc_template.md").read_text()
    return (
        template.replace("{{HEADLINE}}", "\n".join(head))
        .replace("{{COMMANDS}}", commands)
        .replace("{{SUMMARY}}", summary)
        .replace("{{SENSITIVITY}}", "\n".join(rows))
        .replace("{{SEEDS}}", str(data["seeds"]))
        .replace("{{CUTOFF}}", f"{PARTIAL_CUTOFF_S:.0f}")
        .replace("{{STATUS}}", "\n".join(status))
        .replace("{{CALIBRATION}}", calibration)
        .replace("{{CEILINGS}}", "\n".join(ceilings))
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--workers", type=int, default=2, help="processes (each runs whole workload-seed pairs)")
    p.add_argument("--out", default=str(ROOT / "docs" / "simulator.md"))
    p.add_argument("--json-out", help="also write every figure as JSON here")
    p.add_argument("--cache", help="directory keeping each workload-seed result (resumes an interrupted run)")
    p.add_argument("--partial", action="store_true", help="with --cache: render only what is cached")
    p.add_argument("--from-json", help="render from a JSON written by --json-out instead of simulating")
    p.add_argument(
        "--skip-sensitivity",
        action="store_true",
        help="do not rerun the sensitivity table (the page then says it was not rerun)",
    )
    args = p.parse_args()
    data = (
        json.loads(Path(args.from_json).read_text())
        if args.from_json
        else compute(
            args.seeds,
            args.workers,
            Path(args.cache) if args.cache else None,
            args.partial,
            args.skip_sensitivity,
        )
    )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(data, indent=1))
    Path(args.out).write_text(render(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
