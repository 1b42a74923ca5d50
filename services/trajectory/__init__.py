"""The trajectory service (see docs/architecture.md)."""
