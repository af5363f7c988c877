"""What each rank record commits to beyond the file table: its own content, and the files it owns.

manifest.json's file table lists every file's sha256, and open_archive refuses a file that differs from it. That
catches damage, not an edit followed by a regenerated table (by hand, or by a tool that "repairs" checksums): the
table then agrees with the edited file. So the writer also records, in each rank record's `extra.digests`:

    "files":    {archive path: sha256} of every file under the rank's folder (rank.json itself excepted) and, in
                rank 0's record, of the shared top-level files (not images/: each image is named by its sha256
                already);
    "manifest": rank 0's only: the sha256 of manifest.json as canonical JSON without its file table (`files`) and
                its creation info (`created`): the format, the world facts LOAD compares and the ranks. The file table
                commits to each record by its sha256, so the record cannot commit to the table; the creation info
                (time, host; shown, never compared) is left out so that two SAVEs of the same content write the same
                records;
    "record":   the sha256 of the record itself as canonical JSON, this one field left out.

open_archive refuses a record without digests (format 3 requires them: stripping them must not turn the checks off),
a record that does not hash to its `record`, a manifest.json that does not hash to rank 0's `manifest`, a committed
file whose table entry says another sha256 (or that the table lacks), and a rank or shared file no record commits
to. With the pointer inventory's fingerprint, each image's and each declared state's sha256, and each graph's part
hashes in the graph index, every byte LOAD uses is bound to the record that names it, the records to the table, and
the rest of manifest.json to rank 0's record: a changed byte anywhere is refused unless every digest on its way up
is recomputed.

Not a signature: whoever can write an archive can recompute every digest. An archive runs code on the GPU; take one
only from where you would take code.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from graphpersist.archive import codec
from graphpersist.archive.manifest import (
    IMAGES_DIR,
    MANIFEST_NAME,
    RANK_DIR,
    RANK_RECORD_NAME,
    FileEntry,
    RankRecord,
    RecordDigests,
    rank_dir,
)
from graphpersist.archive.shown import shown

KEY = "digests"  # the key in a rank record's `extra` (RankExtra.digests, whose parser checks its shape)


def record_digest(record: Mapping[str, Any]) -> str:
    """sha256 of a rank record in canonical JSON, without extra.digests.record: of codec.to_dict(record) when it is
    written, of the JSON object read back when it is checked (the same object: the writer writes codec.to_json())."""
    data = dict(record)
    extra = dict(data.get("extra") or {})
    digests = extra.get(KEY)
    if isinstance(digests, Mapping):
        extra[KEY] = {k: v for k, v in digests.items() if k != "record"}
    data["extra"] = extra
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def manifest_digest(manifest: Mapping[str, Any]) -> str:
    """sha256 of manifest.json in canonical JSON without its file table and creation info: of
    codec.to_dict(manifest) when rank 0's record is written, of the JSON object read back when it is checked."""
    data = {k: v for k, v in manifest.items() if k not in ("files", "created")}
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def owned(rel: str, rank: int) -> bool:
    """Whether rank `rank`'s record commits to archive path `rel`: its own folder's files, and rank 0 the shared
    top-level files (kernel images are committed by their sha256 in the image records instead)."""
    top = rel.split("/", 1)[0]
    if top == rank_dir(rank):
        return rel != f"{top}/{RANK_RECORD_NAME}"
    return rank == 0 and rel != MANIFEST_NAME and top != IMAGES_DIR and not RANK_DIR.fullmatch(top)


def committed(record: RankRecord, files: Mapping[str, str], manifest: Mapping[str, Any] | None = None) -> RankRecord:
    """`record` with extra.digests set: the sha256 of `files` (what it owns, see owned()), of `manifest` (rank 0's:
    manifest.json's object, whose file table is left out) and of itself."""
    if record.extra.digests is not None:
        raise ValueError(f"extra.{KEY} is written by the archive writer, not given")
    if (manifest is None) != (record.rank != 0):
        raise ValueError("rank 0's record, and only it, commits to manifest.json")
    owned_files = dict(sorted(files.items()))
    manifest_sha = None if manifest is None else manifest_digest(manifest)
    digests = RecordDigests(files=owned_files, record="", manifest=manifest_sha)
    data = codec.to_dict(dataclasses.replace(record, extra=dataclasses.replace(record.extra, digests=digests)))
    digests = dataclasses.replace(digests, record=record_digest(data))
    return dataclasses.replace(record, extra=dataclasses.replace(record.extra, digests=digests))


def problems(
    records: Mapping[int, RankRecord],
    files: Mapping[str, FileEntry],
    manifest: Mapping[str, Any],
    check: set[int] | None = None,
    docs: Mapping[int, Mapping[str, Any]] | None = None,
) -> list[str]:
    """Why the records' commitments do not hold for this manifest and its file table ([] when they do).

    `manifest` is manifest.json's object as read (what rank 0's record commits to); `check` limits which records are
    verified (a rank's LOAD needs its own and rank 0's, for the manifest and the shared files); `docs` are the
    records' JSON objects as read (hashed as they are; else each record's to_dict())."""
    out: list[str] = []
    trusted: dict[int, dict[str, str]] = {}
    for rank, record in sorted(records.items()):
        if check is not None and rank not in check:
            continue
        where = f"{rank_dir(rank)}/{RANK_RECORD_NAME}"
        digests = record.extra.digests
        if digests is None:
            out.append(
                f"{where} has no extra.{KEY}: every record of this format commits to its files (digests removed, "
                "or written by a release before format 3)"
            )
            continue
        doc = docs[rank] if docs is not None and rank in docs else codec.to_dict(record)
        if record_digest(doc) != digests.record:
            out.append(
                f"{where} does not hash to its extra.{KEY}.record: it was changed after SAVE wrote it (and the file "
                f"table regenerated to match)"
            )
            continue
        if (digests.manifest is None) != (rank != 0):
            out.append(f"{where}: extra.{KEY}.manifest is rank 0's, and rank 0's only")
            continue
        if digests.manifest is not None and digests.manifest != manifest_digest(manifest):
            out.append(
                f"{MANIFEST_NAME} does not hash to {where}'s extra.{KEY}.manifest: it was changed after SAVE wrote it "
                "(its format, world facts or ranks)"
            )
        trusted[rank] = digests.files
        for rel, sha in sorted(digests.files.items()):
            entry = files.get(rel)
            if not owned(rel, rank):
                out.append(f"{where} commits to {shown(rel, 120)}, which is not rank {rank}'s to commit to")
            elif entry is None:
                out.append(f"{where} commits to {shown(rel, 120)}, which {MANIFEST_NAME} does not list")
            elif entry.sha256 != sha:
                out.append(
                    f"{shown(rel, 120)}: sha256 {shown(entry.sha256[:16])}… in {MANIFEST_NAME}, {sha[:16]}… in {where} "
                    "(the file changed after SAVE and the file table was regenerated to match)"
                )
    for rank, owned_files in trusted.items():
        for rel in files:
            if owned(rel, rank) and rel not in owned_files:
                what = f"rank {rank}'s folder" if rel.startswith(f"{rank_dir(rank)}/") else "the shared files"
                out.append(
                    f"{shown(rel, 120)} is in {what} but {rank_dir(rank)}/{RANK_RECORD_NAME} does not commit to it"
                )
    return out
