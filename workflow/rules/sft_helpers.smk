# The Snakemake helpers of rules/sft.smk, which includes this file first (a snakefile holds
# rules or functions, not both); what every rule file shares is in rules/common.smk.
# sft keys that change neither the plan nor the tokens it trains: a new learning rate re-renders the
# YAML, not the lineage (render-sft refuses a lineage whose plan is not its own, naming the file).
SFT_UNPLANNED = {
    "learning_rate",
    "lr_scheduler_type",
    "warmup_ratio",
    "decay_ratio",
    "weight_decay",
    "max_grad_norm",
    "seed",
    "logging_steps",
    "save_steps",
    "tracking",
    "divergence_factor",
    "requeue_on_preempt",
    "collective_timeout_minutes",
}


def lineage_cfg():
    """The lineage's config slice: the keys of the plan it counts tokens under, and a continued run's
    parent, epochs and replay share."""
    return cfg_arg(
        "hardware",
        "verify",
        "data.cutoff_len",
        *(f"sft.{key}" for key in _SLICE_SOURCE["sft"] if key not in SFT_UNPLANNED),
        *continue_keys(
            "model.continue_from", "nightly.continue_epochs", "nightly.replay_fraction"
        ),
    )


def sft_adapter_output():
    """sft's extra output under LoRA: the adapter, beside the merged model."""
    if SETTINGS.sft.finetuning_type != "lora":
        return {}
    return {"adapter": directory("results/{run}/sft/adapter")}
