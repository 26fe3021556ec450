"""Stage 4, evaluate: base and tuned model on the held-out split."""
