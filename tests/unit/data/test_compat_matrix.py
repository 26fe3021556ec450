"""Real tokenizers x LLaMA-Factory templates x row formats: our reading and SFTEncoder give exactly
LLaMA-Factory's tokens, and docs/tokenizers.md's compatibility matrix is what this measures (tests/compat.py).

All cells run in one module-scoped fixture: LLaMA-Factory and the tokenizers load once per process.
A family whose tokenizer tests/setup-tokenizers.sh has not fetched is skipped, saying so; under CI
and `make test` that skip fails the run (tests/skipgate.py)."""

import pytest

from tests import compat
from tests.conftest import real_tokenizer, real_tokenizer_path

CELLS = [
    (family, template, fmt.name)
    for family, templates in compat.FAMILIES.items()
    for template in templates
    for fmt in compat.FORMATS
]


@pytest.fixture(scope="module")
def matrix() -> dict:
    return {(c.family, c.template, c.format): c for c in compat.run_all()}


@pytest.mark.parametrize(("family", "template", "fmt"), CELLS, ids=["-".join(c) for c in CELLS])
def test_cell_is_token_exact(matrix, family, template, fmt):
    real_tokenizer(family)  # skips when absent
    cell = matrix[(family, template, fmt)]
    assert cell.exact, f"{family} / {template} / {fmt}: {cell.first_difference}"
    assert cell.rows == compat.N_ROWS


def test_the_documented_matrix_is_the_measured_one(matrix):
    missing = [f for f in compat.FAMILIES if real_tokenizer_path(f) is None]
    if missing:
        pytest.skip(f"tokenizers not fetched ({', '.join(missing)}): run bash tests/setup-tokenizers.sh")
    copy = compat.doc_copy()
    assert copy is not None, "docs/tokenizers.md has no compatibility matrix markers"
    assert copy == compat.table(list(matrix.values())), (
        "docs/tokenizers.md's compatibility matrix is stale: python -m tests.compat --write"
    )


def test_the_table_holds_no_machine_dependent_figure():
    """rows/s depends on the machine, so the committed table leaves it out (no figure quoted two ways)."""
    cells = [compat.Cell("f", "t", "alpaca", 3, True, "", True, 1234.5)]
    slower = [compat.Cell("f", "t", "alpaca", 3, True, "", True, 12.0)]
    other = [compat.Cell("f", "t", "alpaca", 3, True, "", False, 1234.5)]
    assert compat.table(cells) == compat.table(slower)
    assert compat.table(cells) != compat.table(other)
    assert "rows/s" not in compat.table(cells)
