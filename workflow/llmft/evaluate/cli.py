"""The evaluation stage's CLI command (evaluate), which llmft.__main__ collects, and the scoring
it lends the preference stage's evaluation (`evaluation`)."""

from __future__ import annotations

from llmft.core.cli import add_max_rows, settings_of
from llmft.core.imports import UNUSED_BY_INFERENCE
from llmft.evaluate.reuse import reuse


def cmd_evaluate(args) -> int:
    cfg = settings_of(args)
    if args.reuse and reuse(
        cfg, args.model, args.heldout, args.max_rows, args.reuse, args.out_dir, args.label
    ):
        print(f"{args.label}: the same model and held-out rows as {args.reuse}: its scores taken")
        return 0
    from llmft.evaluate.run import evaluate

    evaluate(
        cfg,
        args.model,
        args.heldout,
        args.out_dir,
        label=args.label,
        processes=args.processes,
        threads=args.threads,
        max_rows=args.max_rows,
    )
    return 0


def evaluation() -> tuple:
    """evaluate's loss pass and generation, which the preference stage's evaluation runs (handed to it
    by llmft.__main__: a stage imports no other stage)."""
    from llmft.evaluate.run import answer_nll, evaluate

    return answer_nll, evaluate


def register(add) -> dict:
    """Add evaluate through llmft.core.cli.adder's `add`; return the packages its libraries would
    import for nothing there (llmft.core.imports.hidden)."""
    p = add(
        "evaluate",
        cmd_evaluate,
        "model=the model folder to score",
        "heldout=the held-out rows (JSONL)",
        "out-dir=the folder for metrics.json and predictions.jsonl",
        "label=base, tuned, gate or promoted",
        help="score a model on the held-out split",
    )
    p.add_argument("--processes", type=int, default=0, help="0 = one per GPU (one on CPU)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads per process (0 = torch default)")
    add_max_rows(p)
    p.add_argument(
        "--reuse",
        default="",
        help="an evaluation folder whose scores are taken when it scored this model on the same rows",
    )
    return {cmd_evaluate: UNUSED_BY_INFERENCE}
