"""The persistence switch: precedence (flag/keyword > environment > off) and one-line refusals of bad values."""

from __future__ import annotations

import argparse
import copy
import pickle
from pathlib import Path

import pytest

from graphpersist import switch
from graphpersist.switch import Mode, SwitchError, resolve


def test_off_is_the_default() -> None:
    s = resolve(env={})
    assert s.mode is Mode.OFF
    assert s.directory is None
    assert s.mode_source == "default"
    assert not s.enabled


@pytest.mark.parametrize("mode", ["save", "load"])
def test_keyword_beats_environment(tmp_path: Path, mode: str) -> None:
    env = {"GRAPHPERSIST_MODE": "off", "GRAPHPERSIST_DIR": "/elsewhere"}
    s = resolve(mode, str(tmp_path), env=env)
    assert s.mode is Mode(mode)
    assert s.directory == tmp_path
    assert s.mode_source == "keyword graph_persist"
    assert s.dir_source == "keyword graph_persist_dir"


def test_keyword_off_beats_environment_save() -> None:
    s = resolve("off", env={"GRAPHPERSIST_MODE": "save"})
    assert s.mode is Mode.OFF
    assert s.mode_source == "keyword graph_persist"


def test_environment_beats_default(tmp_path: Path) -> None:
    s = resolve(env={"GRAPHPERSIST_MODE": "load", "GRAPHPERSIST_DIR": str(tmp_path)})
    assert (s.mode, s.directory, s.mode_source, s.dir_source) == (
        Mode.LOAD,
        tmp_path,
        "GRAPHPERSIST_MODE",
        "GRAPHPERSIST_DIR",
    )
    assert s.describe() == f"graphpersist: mode=load dir={tmp_path} (from GRAPHPERSIST_MODE, GRAPHPERSIST_DIR)"


def test_mode_and_directory_resolve_independently(tmp_path: Path) -> None:
    s = resolve("save", env={"GRAPHPERSIST_DIR": str(tmp_path)})
    assert (s.mode_source, s.dir_source) == ("keyword graph_persist", "GRAPHPERSIST_DIR")


def test_empty_environment_variable_counts_as_unset() -> None:
    assert resolve(env={"GRAPHPERSIST_MODE": ""}).mode is Mode.OFF


def test_relative_directory_becomes_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve("save", "archive", env={}).directory == tmp_path / "archive"


def test_enum_value_is_accepted(tmp_path: Path) -> None:
    assert resolve(Mode.SAVE, tmp_path, env={}).mode is Mode.SAVE


@pytest.mark.parametrize("bad", ["sav", "SAVE", "Load", " off", "on", "1", "true", ""])
def test_bad_keyword_value_is_refused_naming_value_source_and_allowed(bad: str) -> None:
    with pytest.raises(SwitchError) as err:
        resolve(bad, "/tmp/x", env={})
    assert str(err.value) == (
        f"graphpersist: invalid persistence mode {bad!r} (from keyword graph_persist); expected one of: off, save, load"
    )


@pytest.mark.parametrize("bad", ["sav", "LOAD", "yes"])
def test_bad_environment_value_is_refused(bad: str) -> None:
    with pytest.raises(
        SwitchError,
        match=r"^graphpersist: invalid persistence mode .* \(from GRAPHPERSIST_MODE\); "
        r"expected one of: off, save, load$",
    ):
        resolve(env={"GRAPHPERSIST_MODE": bad})


@pytest.mark.parametrize("bad", [1, True, 0.5, ["save"]])
def test_non_string_mode_is_refused(bad: object) -> None:
    with pytest.raises(SwitchError, match=r"invalid persistence mode .*expected one of: off, save, load"):
        resolve(bad, "/tmp/x", env={})


def test_explicit_keyword_overrides_a_bad_environment_value() -> None:
    # An explicit keyword wins, so a stale bad variable does not block the start.
    assert resolve("off", env={"GRAPHPERSIST_MODE": "bogus"}).mode is Mode.OFF


def test_switch_error_is_a_value_error() -> None:
    assert issubclass(SwitchError, ValueError)


@pytest.mark.parametrize("mode", ["save", "load"])
def test_save_or_load_without_directory_is_refused(mode: str) -> None:
    with pytest.raises(SwitchError) as err:
        resolve(mode, env={})
    assert str(err.value) == (
        f"graphpersist: persistence mode {mode!r} (from keyword graph_persist) needs an archive directory; "
        "set --graph-persist-dir, keyword graph_persist_dir or GRAPHPERSIST_DIR"
    )


@pytest.mark.parametrize("bad", ["", "   ", 42])
def test_bad_directory_is_refused(bad: object) -> None:
    with pytest.raises(SwitchError, match=r"\(from keyword graph_persist_dir\)"):
        resolve("save", bad, env={})


def test_load_needs_an_existing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(SwitchError, match=rf"^graphpersist: cannot LOAD {missing} \(from GRAPHPERSIST_DIR\): "):
        resolve("load", env={"GRAPHPERSIST_DIR": str(missing)})


def test_save_refuses_a_file_as_directory(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(SwitchError, match="exists and is not a directory"):
        resolve("save", f, env={})


def test_off_ignores_directory_without_checking_it() -> None:
    s = resolve("off", "", env={"GRAPHPERSIST_DIR": "/does/not/exist"})
    assert s.directory is None and s.dir_source is None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="engine", exit_on_error=False)
    switch.add_arguments(p)
    return p


def test_cli_values_carry_their_flag_into_the_log_line(tmp_path: Path) -> None:
    ns = _parser().parse_args(["--graph-persist", "save", "--graph-persist-dir", str(tmp_path)])
    s = resolve(ns.graph_persist, ns.graph_persist_dir, env={"GRAPHPERSIST_MODE": "load"})
    assert s.describe() == f"graphpersist: mode=save dir={tmp_path} (from --graph-persist, --graph-persist-dir)"


def test_cli_defaults_defer_to_environment() -> None:
    ns = _parser().parse_args([])
    assert (ns.graph_persist, ns.graph_persist_dir) == (None, None)


def test_cli_bad_value_is_refused_with_the_flag_named(capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser(prog="engine")
    switch.add_arguments(p)
    with pytest.raises(SystemExit) as exc:
        p.parse_args(["--graph-persist", "sav"])
    assert exc.value.code == 2
    assert (
        "graphpersist: invalid persistence mode 'sav' (from --graph-persist); expected one of: off, save, load"
        in capsys.readouterr().err
    )


def test_cli_help_names_both_flags_and_the_environment() -> None:
    text = _parser().format_help()
    for needle in (
        "--graph-persist {off,save,load}",
        "--graph-persist-dir DIR",
        "GRAPHPERSIST_MODE",
        "GRAPHPERSIST_DIR",
    ):
        assert needle in text


def test_tagged_cli_value_survives_pickle_and_copy() -> None:
    value = switch.Given("save", "--graph-persist")
    for clone in (pickle.loads(pickle.dumps(value)), copy.deepcopy(value), copy.copy(value)):
        assert clone == "save" and clone.source == "--graph-persist"
