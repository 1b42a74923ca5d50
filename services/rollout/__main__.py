"""`python -m services.rollout --config run.yaml`: run the rollout service."""

from gyre.service import run_service

from .config import RolloutConfig
from .service import build

raise SystemExit(run_service("rollout", RolloutConfig, build, migrations_dir=None))
