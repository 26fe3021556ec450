"""The environment verification stage's CLI command (verify-env), which llmft.__main__ collects."""

from __future__ import annotations

from llmft.core.cli import settings_of


def cmd_verify_env(args) -> int:
    from llmft.env.verify import run_verify

    return run_verify(settings_of(args), args.out)


def register(add) -> dict:
    """Add verify-env through llmft.core.cli.adder's `add`; nothing to hide from its imports."""
    add(
        "verify-env",
        cmd_verify_env,
        "out=the verify.json to write",
        help="check this node's environment (stage 1)",
    )
    return {}
