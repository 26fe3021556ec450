# The Snakemake helpers of rules/data.smk, which includes this file first (a snakefile holds
# rules or functions, not both); what every rule file shares is in rules/common.smk.
def parent_marker():
    """What of the parent a continued run's data depends on: its data fingerprint (a parent that
    prepared other rows changes which rows are new)."""
    if not LINEAGE:
        return ""
    stats = Path(SETTINGS.model.continue_from) / "data" / "stats.json"
    return json.loads(stats.read_text()).get("fingerprint", "")


def dataset_inputs(wildcards):
    """The data files prepare_data reads; for a LLaMA-Factory dataset entry, the entry's file and
    the dataset_info.json (editing the entry's columns or tags changes what is read)."""
    out = []
    for i, src in enumerate(SETTINGS.data.sources):
        if src.get("dataset_info"):
            entry = resolve_lf_entry(src, Path.cwd(), where=f"data.sources[{i}]")
            out += [entry["path"], entry["dataset_info"]]
        elif src["path"] == BUILTIN_DATA:
            out.append(f"results/{wildcards.run}/data/synthetic.jsonl")
        else:
            out.append(src["path"])
    return out
