"""The trainer service (see docs/architecture.md)."""
