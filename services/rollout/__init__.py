"""The rollout service (see docs/architecture.md)."""
