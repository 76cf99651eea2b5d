"""The state directory: created when missing, and a file in its way is one line naming SHARDLINE_HOME."""

from __future__ import annotations

import pytest

from infra.paths import shardline_home


def test_the_state_directory_is_created_and_a_file_in_its_way_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLINE_HOME", str(tmp_path / "a" / "home"))
    assert shardline_home() == tmp_path / "a" / "home" and (tmp_path / "a" / "home").is_dir()
    (tmp_path / "file").write_text("x")
    for home in (tmp_path / "file", tmp_path / "file" / "below"):
        monkeypatch.setenv("SHARDLINE_HOME", str(home))
        with pytest.raises(NotADirectoryError) as caught:
            shardline_home()
        assert str(caught.value) == f"SHARDLINE_HOME={home}: a file is in the way of this state directory"
