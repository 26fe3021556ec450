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
