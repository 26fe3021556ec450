"""Stage 1, verify_env: node facts, collectives, the numerics canary, and the rules that judge them."""
