"""A cache folder a library takes from an environment variable, else from its default (graphpersist.engine.env_folder):
written once for every engine's cache resolvers."""

from __future__ import annotations

from pathlib import Path

import pytest

from graphpersist import engine


def test_the_variable_names_the_folder_when_set_user_expanded_and_read_when_asked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    resolve = engine.env_folder("SOME_CACHE_DIR", lambda: tmp_path / "default")
    monkeypatch.setenv("SOME_CACHE_DIR", "~/mine")
    assert resolve() == tmp_path / "mine"
    monkeypatch.setenv("SOME_CACHE_DIR", "/elsewhere")
    assert resolve() == Path("/elsewhere")


@pytest.mark.parametrize("value", [None, ""])
def test_unset_or_empty_the_default_is_the_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, value: str | None
) -> None:
    if value is None:
        monkeypatch.delenv("SOME_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("SOME_CACHE_DIR", value)
    assert engine.env_folder("SOME_CACHE_DIR", lambda: tmp_path / "default")() == tmp_path / "default"
