"""Standard benchmarks (lm-eval-harness tasks, `eval.benchmarks`) on the base and the tuned model.

tasks: which tasks the config names, refused before any job when lm-eval does not know one or its
data is not on this machine (nodes are offline). run: one benchmark job, reused by content.
"""
