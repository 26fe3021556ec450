"""Real tokenizers x LLaMA-Factory templates x row formats: our reading and SFTEncoder give exactly
LLaMA-Factory's tokens, and the README's compatibility matrix is what this measures (tests/compat.py).

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


def test_readme_matrix_is_the_measured_one(matrix):
    missing = [f for f in compat.FAMILIES if real_tokenizer_path(f) is None]
    if missing:
        pytest.skip(f"tokenizers not fetched ({', '.join(missing)}): run bash tests/setup-tokenizers.sh")
    copy = compat.readme_copy()
    assert copy is not None, "README.md has no compatibility matrix markers"
    fresh = compat.table(list(matrix.values()))
    assert compat.without_speed(copy) == compat.without_speed(fresh), (
        "README's compatibility matrix is stale: python -m tests.compat --write"
    )


def test_the_table_ignores_only_the_speed_column():
    cells = [compat.Cell("f", "t", "alpaca", 3, True, "", True, 1234.5)]
    slower = [compat.Cell("f", "t", "alpaca", 3, True, "", True, 12.0)]
    other = [compat.Cell("f", "t", "alpaca", 3, True, "", False, 1234.5)]
    assert compat.without_speed(compat.table(cells)) == compat.without_speed(compat.table(slower))
    assert compat.without_speed(compat.table(cells)) != compat.without_speed(compat.table(other))
    assert "| 1,200 |" in compat.table(cells)
