from gyre.store.alembic_env import run_env
from services.scheduler.models import Base

run_env(Base.metadata)
