"""`python -m app.cli ...` runs the `gyre` command (the same entry point as the console script)."""

import sys

from app.cli import main

sys.exit(main())
