"""gptools.jsonfile: a proof report reads the same whether it is stored as report.json or report.json.gz."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from gptools import jsonfile

DATA = {"headline": "all checks passed", "runs": {"load": {"ok": True, "start_to_ready_s": 14.13}}, "n": [1, 2]}


def test_either_name_reads_whichever_file_exists(tmp_path: Path) -> None:
    jsonfile.dump_gz(tmp_path / "report.json", DATA)
    assert not (tmp_path / "report.json").exists() and (tmp_path / "report.json.gz").is_file()
    assert jsonfile.load(tmp_path / "report.json") == DATA
    assert jsonfile.load(tmp_path / "report.json.gz") == DATA
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "report.json").write_text(json.dumps(DATA))  # an older runner's plain report
    assert jsonfile.load(plain / "report.json.gz") == DATA


def test_the_bytes_depend_on_the_data_alone(tmp_path: Path) -> None:
    """No time or file name in the gzip header: an unchanged report commits as an unchanged file."""
    (tmp_path / "a").mkdir()
    a = jsonfile.dump_gz(tmp_path / "a" / "report.json.gz", DATA)
    b = jsonfile.dump_gz(tmp_path / "report.json.gz", DATA)
    assert a.read_bytes() == b.read_bytes()
    assert json.loads(gzip.decompress(b.read_bytes())) == DATA


def test_writing_the_gzipped_report_removes_its_plain_twin(tmp_path: Path) -> None:
    (tmp_path / "report.json").write_text("{}")
    jsonfile.dump_gz(tmp_path / "report.json.gz", DATA)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json.gz"]


def test_values_json_cannot_hold_are_written_as_text(tmp_path: Path) -> None:
    jsonfile.dump_gz(tmp_path / "r.json.gz", {"path": tmp_path})
    assert jsonfile.load(tmp_path / "r.json.gz") == {"path": str(tmp_path)}


def test_missing_and_broken_files_raise_what_readers_already_catch(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        jsonfile.load(tmp_path / "result.json")
    (tmp_path / "result.json").write_text("{not json")
    with pytest.raises(ValueError):
        jsonfile.load(tmp_path / "result.json")
    (tmp_path / "run.json.gz").write_bytes(b"\x1f\x8b" + b"truncated")
    with pytest.raises(OSError):
        jsonfile.load(tmp_path / "run.json")
