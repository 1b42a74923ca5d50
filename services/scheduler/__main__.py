"""`python -m services.scheduler --config run.yaml`: the scheduler service process."""

from pathlib import Path

from gyre.service import run_service
from services.scheduler.config import SchedulerConfig
from services.scheduler.service import build

raise SystemExit(
    run_service("scheduler", SchedulerConfig, build, migrations_dir=Path(__file__).with_name("migrations"))
)
