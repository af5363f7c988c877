"""Where a SAVE's or a LOAD's time went, as one line for an engine's log. No torch at import (engine glue and its
CPU tests import it without CUDA)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def of_save(summary: Mapping[str, Any]) -> str:
    """Saver.save's summary: serialization inside the preparation, then the rank's files, the shared files, commit."""
    split = summary["split_s"]
    parts = summary.get("write_split_s") or {}
    of_write = " (" + ", ".join(f"{k} {v:.2f} s" for k, v in parts.items()) + ")" if parts else ""
    zeroed = len(summary.get("zeroed_params", {}))
    return (f"serialize {summary['serialize_s']:.2f} s of prepare {split['prepare']:.2f} s, "
            f"write {split['write']:.2f} s{of_write}, shared files {split['shared']:.2f} s, "
            f"commit {split['commit']:.2f} s; "
            f"{summary['images']} kernel images; unread parameter bytes zeroed in {zeroed} "
            f"kernel(s); graph addresses by phase {summary.get('pointer_phases')}")  # fmt: skip


def of_load(timings: Mapping[str, float]) -> str:
    """LoadResult.timings: validation (and the reading done ahead in a thread, graphpersist.loadahead), memory,
    images, then the graphs' rebuild, instantiation and upload."""
    t = timings
    ahead = f" (read ahead in {t['read_ahead_s']:.3f} s)" if t.get("read_ahead_s") else ""
    return (f"open + validate {t['validate_s']:.3f} s{ahead}, memory {t['memory_s']:.3f} s, "
            f"images {t['images_s']:.3f} s, "
            f"graphs {t['graphs_s']:.3f} s: rebuild {t['rebuild_s']:.3f} s, instantiate {t['instantiate_s']:.3f} s, "
            f"upload {t['upload_s']:.3f} s")  # fmt: skip
