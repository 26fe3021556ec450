"""Atomic outputs: no half-written file survives an error, and outputs are readable by others."""

import pytest
from llmft.core.io import atomic_path, write_json


def test_outputs_are_readable_by_others(tmp_path):
    write_json(tmp_path / "x.json", {"a": 1})
    assert (tmp_path / "x.json").stat().st_mode & 0o044 == 0o044
    with atomic_path(tmp_path / "d", directory=True) as tmp:
        (tmp / "f").write_text("x")
    assert (tmp_path / "d").stat().st_mode & 0o055 == 0o055


def test_an_error_leaves_neither_target_nor_temporary(tmp_path):
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "out.txt") as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed mid-write")
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "dir", directory=True) as tmp:
        (tmp / "f").write_text("half")
        raise RuntimeError("killed mid-write")
    assert list(tmp_path.iterdir()) == []


def test_a_directory_output_replaces_the_old_one_whole(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "stale").write_text("old")
    with atomic_path(tmp_path / "d", directory=True) as tmp:
        (tmp / "fresh").write_text("new")
    assert [p.name for p in (tmp_path / "d").iterdir()] == ["fresh"]
