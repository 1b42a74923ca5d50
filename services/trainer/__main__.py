"""`python -m services.trainer --config run.yaml`: run the trainer service."""

from gyre.service import run_service
from services.trainer.config import TrainerConfig
from services.trainer.service import build

raise SystemExit(run_service("trainer", TrainerConfig, build, migrations_dir=None))
