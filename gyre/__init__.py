"""Gyre: online RL for LLM agents on extremely long tasks.

Layers (imports only point down this list):
  gyre.v1            generated contracts (proto/gyre/v1)
  gyre.*             shared runtime: config, errors, bus, rpc, store, embedded servers, model
  services.*         scheduler, rollout, trajectory, trainer (never import each other)
  gyre.cli           the `gyre` command: reaches services by module name
"""

__version__ = "0.1.0"
