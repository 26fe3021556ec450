"""Stage 5, report: the run page, its figures and the trend across runs.

One self-contained HTML page (inline SVG, no script, no network at view time), the same figures and
tables as files for `snakemake --report`, summary.json, and a trend page across runs. Every piece of
dataset or model text goes through `esc` (html.escape), and the pages carry a Content-Security-Policy
that allows no script and no request, so a slip in escaping could not run anything either.
"""
