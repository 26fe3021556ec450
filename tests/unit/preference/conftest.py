"""Fixtures the preference stage's tests share with the planner's."""

from tests.unit.sft.conftest import model  # noqa: F401
