"""The README's reliability table is the one the fault tests declare (tests/reliability.py)."""

from tests.conftest import REPO
from tests.reliability import BEGIN, END, MODULES, table


def test_readme_reliability_table_is_the_tests():
    readme = (REPO / "README.md").read_text()
    assert BEGIN in readme and END in readme
    copy = readme[readme.index(BEGIN) : readme.index(END) + len(END)]
    fresh = table()
    assert copy == fresh, "README's reliability table is stale: python -m tests.reliability"
    # every module the table reads exists and declares at least one row
    for module in MODULES:
        assert f"`{module.replace('.', '/')}.py::" in fresh, module
