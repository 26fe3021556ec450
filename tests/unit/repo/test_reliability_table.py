"""docs/reliability.md's table is the one the tests' reliability markers make (tests/reliability.py):
every test a row names is one pytest collects, carrying that row's wording as its marker, and every
such marker has its row."""

import pytest

from tests.reliability import DOC, collect, documented, rows, table


def test_the_reliability_table_is_the_tests_markers():
    found = collect()
    assert {"tests/workflow/test_faults.py", "tests/slurm/test_node_lost.py"} <= {
        entry["test"].split("::")[0] for entry in found
    }
    assert documented(DOC.read_text()) == table(found), f"{DOC} is stale: python -m tests.reliability --write"


ROW = 'fault="f", seen="s", steps_lost="none", data_lost="none"'
SUITE = f"""import pytest


@pytest.mark.reliability({ROW})
def helper():
    pass


class TestRows:
    @pytest.mark.parametrize("n", [1, 2])
    @pytest.mark.reliability({ROW})
    def test_one(self, n):
        pass


@pytest.mark.reliability({ROW})
def test_two():
    pass
"""


def test_a_row_names_the_node_ids_pytest_collects_and_nothing_it_does_not(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests/test_rows.py").write_text(SUITE)
    (row,) = rows(collect(tmp_path))
    # a class and parameters as pytest names them; the marked helper is no test, so no row names it
    assert row["tests"] == ["tests/test_rows.py::TestRows::test_one", "tests/test_rows.py::test_two"]
    (tmp_path / "tests/test_rows.py").write_text(SUITE.replace('seen="s"', "seen=''"))
    with pytest.raises(RuntimeError, match="a reliability marker takes exactly"):
        collect(tmp_path)
