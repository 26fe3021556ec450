"""Stage 5, report: the run page, its figures and the trend across runs."""
