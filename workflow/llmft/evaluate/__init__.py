"""Stage 4, evaluate: base and tuned model on the held-out split.

Eval loss / perplexity and greedy-generation metrics (exact match, LLaMA-Factory's ROUGE and BLEU),
per example and per task. Prompts are encoded as LLaMA-Factory's template encodes them (from the
template table of core/lf/prompts.py where that is exact, else through LLaMA-Factory itself), so the
model sees the token ids LLaMA-Factory's `do_predict` would feed it.

Speed: rows are sorted by length before batching, the batches are spread over one process per GPU
(worker.py), and nothing else runs (no Trainer, no dataset cache). Determinism: the batch plan depends
only on the row lengths, the batch size and a fixed token budget, never on the number of processes,
so a batch's greedy output is the same on 1 GPU or 8.
"""
