"""The scheduler service (see docs/architecture.md)."""
