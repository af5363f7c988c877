"""breakdown: the one-line SAVE and LOAD timings both engines log, from the runtime's own summaries."""

from __future__ import annotations

from graphpersist import breakdown


def test_a_save_line_names_each_step_and_its_seconds() -> None:
    summary = {
        "serialize_s": 3.81,
        "images": 4,
        "split_s": {"prepare": 5.5, "write": 2.25, "shared": 1.0, "commit": 0.125},
        "pointer_phases": {"weights": 3},
        "zeroed_params": {"k1": [(4, 8)], "k2": [(180, 184)]},
    }
    line = breakdown.of_save(summary)
    assert line == ("serialize 3.81 s of prepare 5.50 s, write 2.25 s, shared files 1.00 s, commit 0.12 s; "
                    "4 kernel images; unread parameter bytes zeroed in 2 kernel(s); "
                    "graph addresses by phase {'weights': 3}")  # fmt: skip


def test_a_save_line_splits_the_write_where_the_summary_does() -> None:
    summary = {
        "serialize_s": 3.81,
        "images": 4,
        "split_s": {"prepare": 5.5, "write": 2.25, "shared": 1.0, "commit": 0.125},
        "write_split_s": {"images": 0.25, "records": 1.5, "files": 0.5},
    }
    line = breakdown.of_save(summary)
    assert line.startswith("serialize 3.81 s of prepare 5.50 s, write 2.25 s (images 0.25 s, records 1.50 s, "
                           "files 0.50 s), shared files 1.00 s, commit 0.12 s; ")  # fmt: skip


def test_a_load_line_splits_the_graphs_into_rebuild_instantiate_and_upload() -> None:
    timings = {"validate_s": 0.08, "memory_s": 0.01, "images_s": 0.04, "graphs_s": 0.9, "rebuild_s": 0.2,
               "instantiate_s": 0.31, "upload_s": 0.25}  # fmt: skip
    line = breakdown.of_load(timings)
    assert line.startswith("open + validate 0.080 s, memory 0.010 s, images 0.040 s, graphs 0.900 s: ")
    assert line.endswith("rebuild 0.200 s, instantiate 0.310 s, upload 0.250 s")


def test_a_load_line_says_what_was_read_ahead() -> None:
    timings = {"validate_s": 0.01, "read_ahead_s": 0.45, "memory_s": 0.01, "images_s": 0.04, "graphs_s": 0.9,
               "rebuild_s": 0.2, "instantiate_s": 0.31, "upload_s": 0.25}  # fmt: skip
    assert breakdown.of_load(timings).startswith("open + validate 0.010 s (read ahead in 0.450 s), memory 0.010 s, ")
