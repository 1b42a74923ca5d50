"""Gyre: online RL for LLM agents on extremely long tasks.

Layers (imports only point down this list):
  gyre.v1            generated contracts (proto/gyre/v1)
  gyre.*             shared runtime: config, errors, bus, rpc, store, embedded servers, model
  services.*         scheduler, rollout, trajectory, trainer (never import each other)
  app           the application: the `gyre` command, launcher, job driver, report, analytics;
                     reaches each service by module name
The arrows are import-linter contracts in pyproject.toml, checked by `make lint`.
"""

__version__ = "0.1.0"
