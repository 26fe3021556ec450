"""Stage 2, prepare_data: read, validate, clean, dedup, length-filter and split the rows."""
