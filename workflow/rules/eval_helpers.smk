# The Snakemake helpers of rules/eval.smk, which includes this file first (a snakefile holds
# rules or functions, not both); what every rule file shares is in rules/common.smk.
def eval_model_path(wildcards, input):
    """The model folder evaluate scores: its input, or (which=promoted) nightly.compare_with's model."""
    if wildcards.which == "promoted":
        return f"{SETTINGS.nightly.compare_with}/sft/model"
    return input.model


def eval_rows(wildcards):
    """evaluate's row words: none for base and tuned (eval.max_rows, the page's rows); the gate's
    (gate_rows_words) for the two models the nightly gate compares.
    """
    return gate_rows_words() if wildcards.which in ("promoted", "gate") else []


def eval_reused(wildcards):
    """The page's scores of the tuned model (eval/tuned), which the gate's pass over the same model
    takes when it scores the same rows: nightly.gate_max_rows equal to eval.max_rows (both the first
    N held-out rows). evaluate checks the model and the rows' fingerprint before it takes them.
    """
    same_rows = SETTINGS.nightly.gate_max_rows == SETTINGS.eval.max_rows
    if wildcards.which == "gate" and same_rows:
        return f"results/{wildcards.run}/eval/tuned/metrics.json"
    return []


def eval_reuse_words(wildcards):
    """evaluate's `--reuse` words (quoted by the rule's {params.reuse:q}): eval_reused's folder."""
    reused = eval_reused(wildcards)
    return ["--reuse", str(Path(reused).parent)] if reused else []
