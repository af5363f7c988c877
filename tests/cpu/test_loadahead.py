"""A rank's archive read ahead of its LOAD (graphpersist.loadahead): the same archive and plan LOAD's own reading
gives, only for its folder and rank and while the folder holds that archive; otherwise LOAD reads it itself, and
the CPU stage's refusal is LOAD's own."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from archive_fixtures import forge, write_loadable_archive

from graphpersist import loadstage
from graphpersist.archive import ArchiveError, open_archive
from graphpersist.loadahead import ReadAhead


@pytest.fixture
def loadable(tmp_path: Path) -> Path:
    return write_loadable_archive(tmp_path / "archive")


def test_the_archive_read_ahead_is_the_one_load_reads_with_its_plan(loadable: Path) -> None:
    ahead = ReadAhead(loadable, 1)
    archive = ahead.archive_for(loadable, 1)
    assert archive is not None and archive.root == open_archive(loadable).root
    plan, own = ahead.plan(), loadstage.rank_stage(open_archive(loadable, keep_rank=1), 1)
    assert sorted(plan.graphs) == sorted(own.graphs) and plan.graphs and plan.notes == own.notes
    assert plan.record == own.record
    assert ahead.seconds is not None and ahead.seconds > 0


def test_another_folder_or_rank_is_read_by_load_itself(loadable: Path, tmp_path: Path) -> None:
    other = shutil.copytree(loadable, tmp_path / "other")
    ahead = ReadAhead(loadable, 1)
    assert ahead.archive_for(other, 1) is None
    assert ahead.archive_for(loadable, 0) is None
    assert ahead.archive_for(loadable, 1) is not None


def test_an_archive_replaced_since_it_was_read_is_read_again(loadable: Path, tmp_path: Path) -> None:
    """A SAVE renames a new folder into place: what the thread read is not what LOAD would read now."""
    ahead = ReadAhead(loadable, 1)
    ahead.plan()  # done reading
    newer = shutil.copytree(loadable, tmp_path / "newer")
    os.rename(loadable, tmp_path / "older")
    os.rename(newer, loadable)
    assert ahead.archive_for(loadable, 1) is None


def test_an_archive_the_thread_could_not_open_is_opened_by_load_itself(loadable: Path) -> None:
    """LOAD's own open meets the problem if it lasts (and a read that met a SAVE half-way through is not final)."""
    (loadable / "rank_1" / "rank.json").write_text("{}")  # not what the manifest committed to
    ahead = ReadAhead(loadable, 1)
    assert ahead.archive_for(loadable, 1) is None
    with pytest.raises(ArchiveError, match=re.escape("rank_1/rank.json")):
        open_archive(loadable, keep_rank=1)


def test_a_problem_the_cpu_stage_met_is_raised_where_load_runs_it(loadable: Path) -> None:
    """The archive opens (its digests were forged to match), so the facts are compared first; then the stage's
    refusal, the same one LOAD's own stage raises."""
    rel = "rank_1/graphs/index.json"
    index = json.loads((loadable / rel).read_bytes())
    index["descs"][0]["edges"] = [[0, "x", 0, 0, 0]]
    forge(loadable, rel, json.dumps(index).encode())
    with pytest.raises(ArchiveError) as own:
        loadstage.rank_stage(open_archive(loadable, keep_rank=1), 1)
    ahead = ReadAhead(loadable, 1)
    assert ahead.archive_for(loadable, 1) is not None
    with pytest.raises(ArchiveError, match=re.escape(str(own.value))):
        ahead.plan()
