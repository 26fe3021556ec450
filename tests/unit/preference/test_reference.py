"""The reference step (llmft.preference.reference) and the trainers' cached reference
(llmft.preference.refpatch) on a tiny Llama: LLaMA-Factory's own DPO and KTO loss, metrics and
gradients are the same with the resident reference model and with the cached log-probabilities; a
stale or foreign cache is refused by name; a second pass computes only new or changed sequences; a
pass killed after its first shard resumes from it."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("llamafactory")

VOCAB = 97


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The demo's tiny model: builtin:tiny's builder at its default shape (random init)."""
    from llmft.core.assets import build_tiny_model

    folder = tmp_path_factory.mktemp("ref_model") / "model"
    build_tiny_model(folder)
    return folder


@pytest.fixture(scope="module")
def demo_data(model_dir, tmp_path_factory):
    """prepare_preference's DPO pairs and KTO rows of the builtin tasks, tokenized for the demo's
    model, and the config evaluate reads them with."""
    from llmft.core.config import validate
    from llmft.core.lf.chat_templates import for_model
    from llmft.core.settings import Config
    from llmft.preference.data import prepare_preference

    root = tmp_path_factory.mktemp("ref_data")
    cfg = Config.from_dict(validate({"preference": {}}))
    template = for_model(cfg.model, model_dir)[0]
    opts = {"cutoff_len": 96, "heldout_fraction": 0.3, "split_salt": "s", "invalid_rows": "fail",
            "max_dropped_fraction": 0.5, "clean_text": False, "max_row_bytes": None,
            "synthetic_rows": 40}  # fmt: skip
    for kind, source in (("dpo", "builtin:synthetic_pairs"), ("kto", "builtin:synthetic_kto")):
        prepare_preference(
            [{"path": source}], root / kind, str(model_dir), template, {**opts, "method": kind}
        )
    return root, cfg


def _sequence(gen, n, prompt):
    ids = torch.randint(3, VOCAB, (n,), generator=gen).tolist()
    return ids, [-100] * prompt + ids[prompt:]


def _rows(kind: str, count: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(count):
        n, p = 6 + (i * 5) % 13, 2 + i % 4
        if kind == "dpo":
            (ci, cl), (ri, rl) = _sequence(gen, n, p), _sequence(gen, n + 3 - i % 5, p)
            rows.append({"chosen_input_ids": ci, "chosen_labels": cl, "rejected_input_ids": ri,
                         "rejected_labels": rl})  # fmt: skip
        else:
            (ti, tl), (ki, kl) = _sequence(gen, n, p), _sequence(gen, n + 2, p)
            rows.append({"input_ids": ti, "labels": tl, "kl_input_ids": ki, "kl_labels": kl,
                         "kto_tags": i % 3 != 0})  # fmt: skip
    return rows


def _write_data(folder, train: list[dict], heldout: list[dict]):
    """prepare_preference's tokenized/ folder (only the columns the reference step reads)."""
    from datasets import Dataset, DatasetDict

    def split(rows):
        return Dataset.from_dict({k: [r[k] for r in rows] for k in rows[0]})

    DatasetDict({"train": split(train), "validation": split(heldout)}).save_to_disk(str(folder / "tokenized"))
    return folder


def _pass(model_dir, data_dir, tmp_path, **kw):
    from llmft.preference import reference

    kw.setdefault("processes", 1)
    return reference.reference_pass(str(model_dir), str(data_dir), str(tmp_path / "reference.json"),
                                    store_root=str(tmp_path / "store"), **kw)  # fmt: skip


def _padded(pairs: list[tuple[list, list]]) -> dict:
    """A right-padded batch as LLaMA-Factory's collators make it."""
    longest = max(len(ids) for ids, _ in pairs)
    ids = torch.zeros(len(pairs), longest, dtype=torch.long)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for r, (row_ids, row_labels) in enumerate(pairs):
        ids[r, : len(row_ids)], mask[r, : len(row_ids)] = torch.tensor(row_ids), 1
        labels[r, : len(row_ids)] = torch.tensor(row_labels)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _dpo_batch(rows):
    sides = [(r["chosen_input_ids"], r["chosen_labels"]) for r in rows]
    return _padded(sides + [(r["rejected_input_ids"], r["rejected_labels"]) for r in rows])


def _kto_batch(rows):
    batch = _padded([(r["input_ids"], r["labels"]) for r in rows])
    kl = _padded([(r["kl_input_ids"], r["kl_labels"]) for r in rows])
    batch.update({f"kl_{k}": v for k, v in kl.items()})
    batch["kto_tags"] = torch.tensor([r["kto_tags"] for r in rows])
    return batch


def _policy(model_dir):
    """The policy: the reference's weights, moved a little (so the loss is not at its start value)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def _trainer(kind, policy, ref_model, tmp_path):
    from llamafactory.hparams import FinetuningArguments
    from llamafactory.train.dpo.trainer import CustomDPOTrainer
    from llamafactory.train.kto.trainer import CustomKTOTrainer
    from transformers import Seq2SeqTrainingArguments

    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True)
    fa = FinetuningArguments(stage=kind, pref_beta=0.1, pref_loss="sigmoid", finetuning_type="full")
    cls = CustomDPOTrainer if kind == "dpo" else CustomKTOTrainer
    return cls(model=policy, ref_model=ref_model, args=args, finetuning_args=fa, processor=None,
               tokenizer=None)  # fmt: skip


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_cached_reference_gives_llamafactorys_loss_metrics_and_gradients(kind, model_dir, tmp_path):
    from llmft.preference import reference, refpatch
    from transformers import AutoModelForCausalLM

    rows = _rows(kind, 6, seed=1)
    data = _write_data(tmp_path / "data", rows[:4], rows[4:])
    record = _pass(model_dir, data, tmp_path)
    assert record["computed"] == record["sequences"] == 12 and record["kind"] == kind
    batch = _dpo_batch(rows[:3]) if kind == "dpo" else _kto_batch(rows[:3])

    resident_policy = _policy(model_dir)
    cached_policy = copy.deepcopy(resident_policy)
    ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    resident = _trainer(kind, resident_policy, ref_model, tmp_path)
    theirs_loss, theirs = resident.get_batch_loss_metrics(resident_policy, copy.deepcopy(batch))
    theirs_loss.backward()

    refpatch.patch_trainers()
    cached = _trainer(kind, cached_policy, None, tmp_path)
    cached._llmft_reference = refpatch.CachedReference(reference.load_record(tmp_path / "reference.json"))
    ours_loss, ours = cached.get_batch_loss_metrics(cached_policy, copy.deepcopy(batch))
    ours_loss.backward()
    # the patched trainer with no cache attached is LLaMA-Factory's own (the resident trainer's path)
    assert getattr(resident, "_llmft_reference", None) is None and cached.ref_model is None

    assert torch.allclose(ours_loss, theirs_loss, atol=1e-6, rtol=1e-5), (ours_loss, theirs_loss)
    assert theirs_loss.item() > 0 and set(ours) == set(theirs)
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    pairs = zip(resident_policy.named_parameters(), cached_policy.named_parameters(), strict=True)
    for (name, a), (_, b) in pairs:
        assert torch.allclose(a.grad, b.grad, atol=1e-6, rtol=1e-4), name


def test_a_sequence_the_cache_lacks_stops_the_step_by_name(model_dir, tmp_path):
    from llmft.preference import reference, refpatch

    rows = _rows("dpo", 4, seed=2)
    _pass(model_dir, _write_data(tmp_path / "data", rows[:3], rows[3:]), tmp_path)
    cache = refpatch.CachedReference(reference.load_record(tmp_path / "reference.json"), "rec.json")
    assert cache.lookup(**_dpo_batch(rows[:2])).shape == (4,)
    with pytest.raises(reference.ReferenceError, match=r"rec.json: no value for a sequence of \d+ tokens"):
        cache.lookup(**_dpo_batch(_rows("dpo", 1, seed=9)))


def test_a_stale_or_foreign_cache_is_refused_by_name(model_dir, tmp_path):
    import shutil

    from llmft.preference import reference

    rows = _rows("dpo", 4, seed=4)
    data = _write_data(tmp_path / "data", rows[:3], rows[3:])
    moved = tmp_path / "model"
    shutil.copytree(model_dir, moved)
    record = _pass(moved, data, tmp_path)
    store = reference.Store(tmp_path / "store", record["model"], "fp32")
    shard = store.shards / record["shards"][0]

    # a shard whose content no longer matches its checksum: the training step refuses it by name
    text = shard.read_text()
    data_json = json.loads(text)
    data_json["logps"][0] += 1.0
    shard.write_text(json.dumps(data_json))
    with pytest.raises(reference.ReferenceError, match=f"reference shard {shard}.*checksum"):
        reference.load_record(tmp_path / "reference.json")
    # ... and the reference step sets it aside and computes its sequences again
    again = _pass(moved, data, tmp_path)
    assert again["computed"] == again["sequences"] == 8 and shard.with_suffix(".refused").is_file()
    reference.load_record(tmp_path / "reference.json")

    # another model's shard placed in this model's store: named, never used
    foreign = dict(data_json, model="0" * 32)
    (store.shards / "foreign.json").write_text(json.dumps(foreign))
    assert "fingerprint" in store.shard_problem(store.shards / "foreign.json")[0]

    # the model folder changed after the reference step: the record is stale
    config = json.loads((moved / "config.json").read_text())
    (moved / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    stale = r"reference log-probabilities .*reference.json are of model .* stale"
    with pytest.raises(reference.ReferenceError, match=stale):
        reference.load_record(tmp_path / "reference.json")


def test_a_second_pass_computes_only_new_or_changed_sequences(model_dir, tmp_path, caplog):
    from llmft.preference import reference

    rows = _rows("dpo", 8, seed=5)
    first = _pass(model_dir, _write_data(tmp_path / "d1", rows[:5], rows[5:6]), tmp_path, shard_sequences=4)
    assert (first["computed"], first["reused"]) == (12, 0)
    # one pair's rejected answer changed, two new pairs: 1 + 4 new sequences
    changed = copy.deepcopy(rows[:5])
    changed[2]["rejected_input_ids"] = changed[2]["rejected_input_ids"][:-1] + [5]
    caplog.set_level("INFO", logger="llmft.preference.reference")
    second = _pass(model_dir, _write_data(tmp_path / "d2", changed + rows[6:8], rows[5:6]), tmp_path)
    assert (second["sequences"], second["computed"], second["reused"]) == (16, 5, 11)
    assert "16 sequences, 11 in the store, 5 to compute" in caplog.text
    assert len(reference.load_record(tmp_path / "reference.json")) >= 16
    unchanged = _pass(model_dir, tmp_path / "d2", tmp_path)
    assert (unchanged["computed"], unchanged["reused"]) == (0, 16)
    # a night whose sequences are all in the store starts no process and imports no torch (which, with
    # the GPU count it was asked for, was most of such a night's reference step)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    args = [str(model_dir), str(tmp_path / "d2"), str(tmp_path / "warm.json"), str(tmp_path / "store")]
    proc = subprocess.run([sys.executable, "-c", WARM_PASS, *args], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["computed=0", "reused=16", "torch=False"]


def test_two_processes_share_the_shards(model_dir, tmp_path):
    """Data parallel: shards dealt over two processes (one per GPU; here two CPU processes), the
    values those of one process."""
    from llmft.preference import reference

    rows = _rows("dpo", 5, seed=7)
    data = _write_data(tmp_path / "data", rows[:4], rows[4:])
    two = _pass(model_dir, data, tmp_path / "two", processes=2, shard_sequences=4)
    one = _pass(model_dir, data, tmp_path / "one", processes=1, shard_sequences=4)
    assert (two["computed"], len(two["shards"])) == (10, 3) and two["shards"] == one["shards"]
    a = reference.load_record(tmp_path / "two/reference.json")
    b = reference.load_record(tmp_path / "one/reference.json")
    assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], abs=1e-5) for k in a)


def test_the_padded_forward_where_varlen_cannot_run_gives_the_same_values(model_dir):
    """fp32 on a GPU or a node without torch's varlen kernel: LLaMA-Factory's padded forward, the
    same sums as the padding-free one."""
    from llmft.preference import reference

    model = reference.load_model(str(model_dir), "fp32", "cpu")
    shard = [(str(i), ids, labels) for i, r in enumerate(_rows("dpo", 4, seed=8))
             for ids, labels in ((r["chosen_input_ids"], r["chosen_labels"]),)]  # fmt: skip
    free = reference.compute_shard(model, shard, "cpu", 40, 0, padfree=True)
    padded = reference.compute_shard(model, shard, "cpu", 40, 0, padfree=False)
    assert padded == pytest.approx(free, rel=1e-5, abs=1e-4) and len(free) == 4
    assert reference.padfree_runs("cpu", "fp32") and not reference.padfree_runs("cuda:0", "fp32")


WARM_PASS = textwrap.dedent(
    """
    import sys
    from llmft.preference import reference
    model, data, out, store = sys.argv[1:]
    record = reference.reference_pass(model, data, out, store_root=store)  # processes: one per GPU
    print(f"computed={record['computed']} reused={record['reused']} torch={'torch' in sys.modules}")
    """
)
KILLED_AFTER_FIRST_SHARD = textwrap.dedent(
    """
    import os, signal, sys
    from llmft.preference import reference

    written = reference.write_shard

    def write_then_die(*args):  # the pass is killed as soon as its first shard is on disk
        name = written(*args)
        os.kill(os.getpid(), signal.SIGKILL)

    reference.write_shard = write_then_die
    model, data, out, store = sys.argv[1:]
    reference.reference_pass(model, data, out, store_root=store, processes=1, shard_sequences=3)
    """
)


def test_a_killed_pass_resumes_from_its_last_shard(model_dir, tmp_path):
    from llmft.preference import reference

    rows = _rows("dpo", 6, seed=6)
    data = _write_data(tmp_path / "data", rows[:5], rows[5:])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    args = [str(model_dir), str(data), str(tmp_path / "reference.json"), str(tmp_path / "store")]
    proc = subprocess.run([sys.executable, "-c", KILLED_AFTER_FIRST_SHARD, *args], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert not (tmp_path / "reference.json").exists()
    shards = list((tmp_path / "store").rglob("shards/*.json"))
    assert len(shards) == 1 and not list((tmp_path / "store").rglob("shards/.*"))  # no partial file
    record = _pass(model_dir, data, tmp_path, shard_sequences=3)
    assert (record["sequences"], record["reused"], record["computed"]) == (12, 3, 9)
    assert len(record["shards"]) == 4 and shards[0].name in record["shards"]
    assert reference.read_sequences(data)[0] == "dpo"


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_the_gates_reference_scores_from_the_store_are_evaluates(kind, model_dir, demo_data, tmp_path):
    """evaluate-preference --logps-only --reference-cache (the gate's reference models): the held-out
    rows' log-probabilities from the reference store equal evaluate's own pass on the same rows, with
    the same answer tokens, prompts and row fingerprint; a second pass computes nothing."""
    from llmft.core.io import read_json, read_jsonl
    from llmft.evaluate.cli import evaluation as _evaluation
    from llmft.preference import evaluate, reference

    root, cfg = demo_data
    heldout = str(root / kind / "heldout.jsonl")
    score_answers = _evaluation()[0]  # evaluate's loss pass, as the CLI gives it to the stage
    evaluate.logps(cfg, str(model_dir), heldout, str(tmp_path / "theirs/logps.jsonl"), max_rows=5,
                   score_answers=score_answers)  # fmt: skip
    out = tmp_path / "ours/logps.jsonl"
    kw = {"store_root": str(tmp_path / "store"), "processes": 1}
    ours = reference.heldout_logps(str(model_dir), str(root / kind), str(out), 5, "fp32", **kw)
    theirs = read_jsonl(tmp_path / "theirs/logps.jsonl")
    assert len(ours) == len(theirs) == 5 and read_jsonl(out) == ours
    values = ("chosen", "rejected") if kind == "dpo" else ("logp",)
    same = (
        ("chosen_tokens", "rejected_tokens", "prompt") if kind == "dpo" else ("tokens", "kto_tag", "prompt")
    )
    for a, b in zip(ours, theirs, strict=True):
        assert all(a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-4) for k in values), (a, b)
        assert all(a[k] == b[k] for k in (*same, "index", "kind")), (a, b)
    assert read_json(out.parent / "rows.json") == read_json(tmp_path / "theirs/rows.json")
    # the gate needs no KL rows: 5 pairs' 10 sequences, or 5 KTO rows
    assert read_json(out.parent / "reference.json")["computed"] == (10 if kind == "dpo" else 5)
    reference.heldout_logps(str(model_dir), str(root / kind), str(out), 5, "fp32", **kw)
    assert read_json(out.parent / "reference.json")["computed"] == 0
