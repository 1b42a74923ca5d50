"""The trajectory store's trees written into the run directory, for `gyre ui` after the run.

`gyre run` calls `export_trees` once the job is over and before the deployment stops (Postgres
still runs): every group's branch tree (services/trajectory/tree_view.py) goes to
`<run_dir>/trajectory/trees.jsonl`. A failure is reported and never fails the run: the report
does not need the trees.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

TREES_DIR = "trajectory"


def trees_path(run_dir: Path) -> Path:
    from services.trajectory.tree_view import TREES_FILE

    return run_dir / TREES_DIR / TREES_FILE


def export_trees(database_url: str, run_id: str, run_dir: Path) -> Path | None:
    """Write every group's tree view; return the file (None when the export failed, said on stderr)."""
    from gyre import store
    from services.trajectory.tree_view import write_group_views

    started = time.time()
    path = trees_path(run_dir)
    engine = store.create_engine(database_url)
    try:
        num_groups = write_group_views(engine, run_id, path)
    except Exception as exc:  # the report and the dashboard's curves do not need the trees
        print(f"warning: no tree export ({exc!r})", file=sys.stderr, flush=True)
        return None
    finally:
        engine.dispose()
    print(f"trees of {num_groups} groups in {path} ({time.time() - started:.1f} s)", flush=True)
    return path
