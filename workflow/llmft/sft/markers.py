"""The files and exit codes the training processes leave for their launcher and for finalize.

Kept apart from `llmft.sft.callbacks` (which imports transformers, and through it peft: seconds per
process) so that `sft launch` and `sft finalize`, which only read these files, start at once.
"""

DIVERGENCE_FILE = "llmft_divergence.json"
PREEMPTED_FILE = "llmft_preempted.json"
STOP_REQUEST_FILE = "llmft_stop_request"
STEPS_FILE = "llmft_steps.jsonl"
PARAMS_FILE = "llmft_params.json"
START_WEIGHTS_FILE = "llmft_start_weights.json"
EXIT_DIVERGED = 3
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: try again later
