"""The application layer: the `gyre` command, the launcher, the job driver, reports and analytics.

It sits on top of everything else: it may import the runtime (`gyre.*`), the contracts
(`gyre.v1`) and reach each service by module name (the launcher starts every service as its own
process). Nothing below it imports it; `make lint` enforces that with import-linter.
"""
