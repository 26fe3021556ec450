"""Stage 3, sft: plan, render, pack, launch one torchrun per node, train, publish."""
