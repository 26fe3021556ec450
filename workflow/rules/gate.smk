include: "gate_helpers.smk"


# The nightly gate (llmft.nightly.gate), only with nightly.compare_with (the nightly sets it when a
# model is promoted): this run's model and the promoted one on the same held-out rows (eval/gate and
# eval/promoted; on a preference nightly.metric the preference stage's preference/gate/), each
# benchmark task against nightly.max_benchmark_drop, and the verdict. The report renders gate.json;
# the nightly promotes or refuses as it says.
if SETTINGS.nightly.compare_with:

    rule gate:
        input:
            compared=compared_inputs,
            benchmarks=benchmark_inputs,
        output:
            gate="results/{run}/nightly/gate.json",
        log:
            "results/{run}/logs/gate.log",
        localrule: True
        container:
            stage_container()
        params:
            cfg=gate_cfg(),
        shell:
            "python -m llmft gate {params.cfg} --run-dir results/{wildcards.run}"
            " --out {output.gate:q} > {log:q} 2>&1"
