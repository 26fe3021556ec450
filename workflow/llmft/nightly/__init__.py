"""Nightly retrains: run when the data changed, promote by a gate, keep N runs."""
