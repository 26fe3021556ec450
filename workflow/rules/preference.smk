# The preference stage's rules; its helpers (the config check, the input functions, what it adds to
# the run's outputs, the page and the nightly gate) are in preference_helpers.smk.


include: "preference_helpers.smk"


# The stage's data: only in the DAG with a preference section (final_outputs, then the preference
# stage, ask for it).
rule prepare_preference:
    input:
        tokenizer=base_model_dir,
        sources=preference_inputs,
    output:
        train="results/{run}/preference/data/train.jsonl",
        heldout="results/{run}/preference/data/heldout.jsonl",
        info="results/{run}/preference/data/dataset_info.json",
        stats="results/{run}/preference/data/stats.json",
        rejected="results/{run}/preference/data/rejected.jsonl",
        tokenized=directory("results/{run}/preference/data/tokenized"),
    log:
        "results/{run}/logs/prepare_preference.log",
    benchmark:
        "results/{run}/timings/prepare_preference.tsv"
    container:
        stage_container()
    params:
        cfg=preference_data_cfg,
    shell:
        "python -m llmft prepare-preference {params.cfg} --tokenizer {input.tokenizer:q}"
        " --out-dir results/{wildcards.run}/preference/data > {log:q} 2>&1"


# The reference model's log-probabilities of every train and held-out sequence (chosen and rejected;
# KTO's rows and KL rows), cached by content in results/cache/reference/<model fingerprint>/ and
# shared by runs: only sequences the store lacks are computed, a killed job resumes from the shards it
# wrote. In the DAG only with preference.reference_logps cached (auto: on GPUs); the stage's training
# then reads them and loads no reference model.
rule preference_reference:
    input:
        model=preference_reference_model,
        info="results/{run}/preference/data/dataset_info.json",
        tokenized="results/{run}/preference/data/tokenized",
    output:
        record="results/{run}/preference/reference/reference.json",
    log:
        "results/{run}/logs/preference_reference.log",
    benchmark:
        "results/{run}/timings/preference_reference.tsv"
    container:
        stage_container()
    params:
        cfg=cfg_arg("sft.precision"),
    shell:
        "python -m llmft reference-logps {params.cfg} --model {input.model:q}"
        " --data-dir results/{wildcards.run}/preference/data --out {output.record:q} > {log:q} 2>&1"


rule render_preference_config:
    input:
        unpack(preference_reference),
        unpack(preference_reference_record),
        start=preference_start,
        info="results/{run}/preference/data/dataset_info.json",
        verify="results/{run}/env/verify.json",
    output:
        yaml="results/{run}/preference/llamafactory.yaml",
        deepspeed="results/{run}/preference/deepspeed.json",
        config="results/{run}/preference/config.json",
    log:
        "results/{run}/logs/render_preference_config.log",
    localrule: True
    container:
        stage_container()
    params:
        cfg=cfg_arg(
            "hardware", "verify", "model", "data.cutoff_len", "sft", "preference"
        ),
        ref=preference_ref_arg,
    shell:
        "python -m llmft render-sft --stage preference {params.cfg} --base-model {input.start:q}"
        " {params.ref:q} --verify {input.verify:q} --data-dir results/{wildcards.run}/preference/data"
        " --out-yaml {output.yaml:q} --out-deepspeed {output.deepspeed:q}"
        " --work-root results/{wildcards.run}/work --out-config {output.config:q} > {log:q} 2>&1"


# As sft: checkpoints in results/{run}/work/preference-<config hash>/ (requeue and resume), the
# divergence guard and verify_env's gate (the numerics canary's) in `sft check`; LoRA publishes its
# new adapter in preference/adapter and the starting model with it merged in preference/model.
rule preference:
    input:
        unpack(preference_reference_record),
        config="results/{run}/preference/config.json",
        yaml="results/{run}/preference/llamafactory.yaml",
        deepspeed="results/{run}/preference/deepspeed.json",
        verify="results/{run}/env/verify.json",
        start=preference_start,
        train="results/{run}/preference/data/train.jsonl",
        heldout="results/{run}/preference/data/heldout.jsonl",
    output:
        **preference_adapter_output(),
        model=directory("results/{run}/preference/model"),
        summary="results/{run}/preference/train_summary.json",
    log:
        "results/{run}/logs/preference.job.log",
    benchmark:
        "results/{run}/timings/preference.tsv"
    container:
        stage_container(per_node=True)
    resources:
        **per_node_resources(),
    params:
        launcher=per_node_launcher,
        python=stage_python(),
        out=preference_output_log,
        page=run_page,
    shell:
        train_shell("preference")


# Each model (base, tuned = sft's, preference) on the held-out pairs: log-probabilities of every
# answer (the report scores them against the stage's reference model) and generation metrics.
rule evaluate_preference:
    input:
        model=preference_eval_model,
        heldout="results/{run}/preference/data/heldout.jsonl",
    output:
        logps="results/{run}/preference/eval/{model}/logps.jsonl",
        metrics="results/{run}/preference/eval/{model}/metrics.json",
        predictions="results/{run}/preference/eval/{model}/predictions.jsonl",
        prompts="results/{run}/preference/eval/{model}/prompts.jsonl",
    log:
        "results/{run}/logs/evaluate_preference_{model}.log",
    benchmark:
        "results/{run}/timings/evaluate_preference_{model}.tsv"
    wildcard_constraints:
        model="base|tuned|preference",
    container:
        stage_container()
    params:
        cfg=cfg_arg("eval", "model.template"),
    shell:
        "python -m llmft evaluate-preference {params.cfg} --model {input.model:q}"
        " --heldout {input.heldout:q} --out-dir results/{wildcards.run}/preference/eval/{wildcards.model}"
        " --label {wildcards.model} --threads {threads} > {log:q} 2>&1"


# The nightly gate on a preference metric (nightly.metric preference_accuracy or reward_margin, with
# nightly.compare_with): this run's preference model and the promoted run's, and their reference
# models, on this run's held-out pairs (every pair, or nightly.gate_max_rows): log-probabilities
# only, no generation; rows.json says which pairs (count and fingerprint). The report scores them.
# With preference.reference_logps cached, the reference models' come from the reference store (only
# pairs it lacks are computed).
rule evaluate_preference_gate:
    input:
        model=pref_gate_model,
        heldout="results/{run}/preference/data/heldout.jsonl",
    output:
        logps="results/{run}/preference/gate/{side}/logps.jsonl",
        rows="results/{run}/preference/gate/{side}/rows.json",
    log:
        "results/{run}/logs/evaluate_preference_gate_{side}.log",
    benchmark:
        "results/{run}/timings/evaluate_preference_gate_{side}.tsv"
    wildcard_constraints:
        side="gate|promoted|gate_reference|promoted_reference",
    container:
        stage_container()
    params:
        cfg=cfg_arg("eval", "model.template", *pref_gate_cache_keys()),
        model=pref_gate_model_path,
        rows=lambda wildcards: gate_rows_words(),
        cache=pref_gate_cache_words,
    shell:
        "python -m llmft evaluate-preference {params.cfg} --model {params.model:q}"
        " --heldout {input.heldout:q} --out-dir results/{wildcards.run}/preference/gate/{wildcards.side}"
        " --label {wildcards.side} --logps-only {params.rows:q} {params.cache:q} --threads {threads}"
        " > {log:q} 2>&1"
