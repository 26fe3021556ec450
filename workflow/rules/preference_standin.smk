# TEMPORARY: a stand-in for the preference data stage's prepare_preference rule (another change),
# writing the agreed files from a synthetic word task (llmft.data.preference_standin). Delete this
# file and its include when prepare_preference is merged.
rule prepare_preference:
    output:
        train="results/{run}/preference/data/train.jsonl",
        heldout="results/{run}/preference/data/heldout.jsonl",
        info="results/{run}/preference/data/dataset_info.json",
        stats="results/{run}/preference/data/stats.json",
        rejected="results/{run}/preference/data/rejected.jsonl",
    log:
        "results/{run}/logs/prepare_preference.log",
    container:
        stage_container()
    params:
        rows=lambda wildcards: int(PREF["data"].get("synthetic_rows", 300)),
        method=lambda wildcards: PREF["method"],
    shell:
        "python -m llmft.data.preference_standin --out-dir results/{wildcards.run}/preference/data"
        " --rows {params.rows} --method {params.method} > {log:q} 2>&1"
