"""`gyre ui RUN_DIR`: a read-only web dashboard over a run directory (live while the run goes on).

data.py reads the run (events.jsonl, trajectory/trees.jsonl), svg.py draws the charts on the
server, pages.py renders the HTML, server.py serves it behind the run's key. No build step and no
JavaScript library: the pages are HTML and inline SVG, with a few lines of plain JavaScript that
reload the overview and show a node's text.
"""
