"""Benches that drive several services end to end (the application floor; services/ hold none)."""
