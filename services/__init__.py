"""Gyre services: each runs as its own process (python -m services.<name>) and never imports another."""
