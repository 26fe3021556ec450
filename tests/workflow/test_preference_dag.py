"""The preference data stage in the DAG (snakemake -n): only with a preference section."""

from tests.conftest import make_workdir, snakemake


def _jobs(out: str) -> dict:
    """Job stats of a dry run: {rule: count}."""
    lines = out.split("Job stats:", 1)[1].splitlines()
    jobs = {}
    for line in lines[3:]:
        parts = line.split()
        if len(parts) != 2 or parts[0] == "total":
            break
        jobs[parts[0]] = int(parts[1])
    return jobs


def test_prepare_preference_is_in_the_dag_only_with_a_preference_section(tmp_path):
    plain = snakemake(make_workdir(tmp_path / "plain"), "-n")
    assert plain.returncode == 0, plain.stderr
    today = _jobs(plain.stdout + plain.stderr)
    assert "prepare_preference" not in today and "prepare_data" in today
    pref = snakemake(make_workdir(tmp_path / "pref", preference={}), "-n", "-p")
    assert pref.returncode == 0, pref.stderr
    out = pref.stdout + pref.stderr
    # the data stage, then the stage's render, training and its evaluation (base, sft, preference model)
    stage = {"prepare_preference": 1, "render_preference_config": 1, "preference": 1}
    stage["evaluate_preference"] = 3
    assert _jobs(out) == {**today, **stage, "all": 1}
    assert "python -m llmft prepare-preference --config-json" in out
    assert "--out-dir results/demo/preference/data" in out
