"""Stage 3, sft: plan, render, pack, launch one torchrun per node, train, publish.

`auto` settings come from the memory planner (plan.py), which also refuses a config that cannot fit
before anything is submitted. render.py writes LLaMA-Factory's YAML and DeepSpeed's JSON; checkpoints
go to a work folder keyed by a hash of the rendered config, outside the declared outputs (Snakemake
deletes the outputs of a failed job): a retried or requeued job with the same config resumes from its
last checkpoint; a changed config starts fresh. Each node's launcher (run.py) runs torchrun over
train.py (LLaMA-Factory's run_exp plus our callbacks); a SIGUSR1 or SIGTERM makes the workers save a
checkpoint and stop, and every node asks Slurm to requeue the job. publish.py publishes the model and
summary.
"""
