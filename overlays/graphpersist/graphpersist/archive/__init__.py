"""Writing and reading archives: atomic on write, verified on read.

Why the care: LOAD replays raw device addresses and kernel handles out of these files. A half-written or
bit-rotted archive must therefore never be loadable. The writer stages everything in a sibling folder, fsyncs
it, writes manifest.json (with every file's sha256 and size) last, and only then renames the folder into place;
the reader accepts a folder only if the manifest parses and every file matches it, with no file missing or extra.
Reading is total: whatever the folder holds (hostile JSON, symbolic links, odd names, unreadable files), opening it
either succeeds or raises ArchiveError naming each problem; JSON goes through graphpersist.archive.safejson.

Several processes (one per rank) can write one archive: the owner creates the writer, the other ranks open
writers on the owner's `staging` folder (`ArchiveWriter(root, world, staging=owner.staging)`), write their
files, and the owner calls `commit()` once all of them are done (the engine's barrier, not ours).

The code is split along its seams: archive_base (ArchiveError, payload paths, content checks), archive_write
(ArchiveWriter, staging, publish), archive_read (open_archive, Archive, file checks) and archive_side (the
staging/trash folders next to an archive and their writers' liveness). This module keeps the public names.
"""

from __future__ import annotations

from graphpersist.archive.base import (
    ADVICE,
    ADVICE_OLDER_FORMAT,
    ADVICE_OTHER_FORMAT,
    MAX_RECORD_BYTES,
    ArchiveError,
    archive_path,
)
from graphpersist.archive.read import Archive, open_archive, read_shared
from graphpersist.archive.side import remove_stale_partials
from graphpersist.archive.write import ArchiveWriter

__all__ = [
    "ADVICE",
    "ADVICE_OLDER_FORMAT",
    "ADVICE_OTHER_FORMAT",
    "MAX_RECORD_BYTES",
    "Archive",
    "ArchiveError",
    "ArchiveWriter",
    "archive_path",
    "open_archive",
    "read_shared",
    "remove_stale_partials",
]
