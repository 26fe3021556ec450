# The Snakemake helpers of rules/env.smk, which includes this file first (a snakefile holds
# rules or functions, not both); what every rule file shares is in rules/common.smk.
def quarantine_keys():
    """The nightly keys verify_env's stack quarantine reads, only in a night's run (one with
    nightly.compare_with): other runs' verify_env params stay as they were."""
    if not SETTINGS.nightly.compare_with:
        return ()
    return (
        "nightly.compare_with",
        "nightly.on_stack_change",
        "nightly.quarantine_passed",
    )


def quantization_keys():
    """The keys that make verify_env check bitsandbytes, only when they ask for it: switching between
    full, freeze and plain LoRA does not rerun verify_env."""
    if SETTINGS.sft.quantization_bit == "none":
        return []
    return ["sft.finetuning_type", "sft.quantization_bit"]
