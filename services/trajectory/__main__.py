"""`python -m services.trajectory --config run.yaml`: the trajectory service process."""

from pathlib import Path

from gyre.service import run_service
from services.trajectory.config import TrajectoryConfig
from services.trajectory.service import build

raise SystemExit(
    run_service("trajectory", TrajectoryConfig, build, migrations_dir=Path(__file__).with_name("migrations"))
)
