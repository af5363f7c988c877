"""A small, reproducible ZIP writer for wheels.

zipfile cannot copy a member's compressed bytes unchanged, and recompressing 700 MB of upstream native code on
every build would be slow and would make "native libraries stay byte-identical" a claim about zlib rather than
about us. This writer copies untouched members raw (same compressed bytes, same CRC) and deflates only what we
changed, with one fixed timestamp and fixed permissions, so equal inputs give equal wheels.
"""

from __future__ import annotations

import struct
import time
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

_LOCAL_SIG = 0x04034B50
_CENTRAL_SIG = 0x02014B50
_END_SIG = 0x06054B50
_VERSION = 20  # 2.0: deflate, no zip64
_MADE_BY = (3 << 8) | _VERSION  # unix
_LIMIT = 0xFFFFFFFF


@dataclass(frozen=True)
class RawMember:
    """The compressed bytes of one member of an existing zip, as stored."""

    method: int
    crc: int
    compress_size: int
    file_size: int
    data: bytes


def read_raw(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> RawMember:
    """Read a member's compressed payload without decompressing it."""
    fp = zf.fp
    assert fp is not None
    fp.seek(info.header_offset)
    header = fp.read(30)
    sig, *_rest = struct.unpack("<IHHHHHIIIHH", header)
    if sig != _LOCAL_SIG:
        raise ValueError(f"{info.filename}: bad local header in {zf.filename}")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    fp.seek(info.header_offset + 30 + name_len + extra_len)
    data = fp.read(info.compress_size)
    if len(data) != info.compress_size:
        raise ValueError(f"{info.filename}: truncated member in {zf.filename}")
    return RawMember(info.compress_type, info.CRC, info.compress_size, info.file_size, data)


def dos_datetime(epoch: int) -> tuple[int, int]:
    t = time.gmtime(epoch)
    if t.tm_year < 1980:
        raise ValueError("ZIP timestamps start in 1980")
    dos_time = (t.tm_hour << 11) | (t.tm_min << 5) | (t.tm_sec // 2)
    dos_date = ((t.tm_year - 1980) << 9) | (t.tm_mon << 5) | t.tm_mday
    return dos_time, dos_date


class ReproducibleZip:
    """Write members in the order given, each with the same timestamp and a normalised mode."""

    def __init__(self, path: Path, epoch: int) -> None:
        self.path = path
        self._fp: BinaryIO = path.open("wb")
        self._time, self._date = dos_datetime(epoch)
        self._central: list[bytes] = []
        self._names: set[str] = set()

    def __enter__(self) -> ReproducibleZip:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._fp.close()
            self.path.unlink(missing_ok=True)

    def add_bytes(self, name: str, data: bytes, executable: bool = False) -> None:
        comp = zlib.compressobj(6, zlib.DEFLATED, -15)
        packed = comp.compress(data) + comp.flush()
        raw = RawMember(zipfile.ZIP_DEFLATED, zlib.crc32(data), len(packed), len(data), packed)
        self.add_raw(name, raw, executable)

    def add_raw(self, name: str, raw: RawMember, executable: bool = False) -> None:
        if name in self._names:
            raise ValueError(f"duplicate member {name}")
        self._names.add(name)
        if raw.compress_size >= _LIMIT or raw.file_size >= _LIMIT or self._fp.tell() >= _LIMIT:
            raise ValueError(f"{name}: zip64 is not supported by this writer")
        encoded = name.encode("utf-8")
        flags = 0x800 if not name.isascii() else 0
        offset = self._fp.tell()
        common = struct.pack(
            "<HHHHHIII", _VERSION, flags, raw.method, self._time, self._date, raw.crc, raw.compress_size, raw.file_size
        )
        self._fp.write(struct.pack("<I", _LOCAL_SIG) + common + struct.pack("<HH", len(encoded), 0) + encoded)
        self._fp.write(raw.data)
        mode = 0o100755 if executable else 0o100644
        self._central.append(
            struct.pack("<IH", _CENTRAL_SIG, _MADE_BY)
            + common
            + struct.pack("<HHHHHII", len(encoded), 0, 0, 0, 0, mode << 16, offset)
            + encoded
        )

    def close(self) -> None:
        start = self._fp.tell()
        for entry in self._central:
            self._fp.write(entry)
        size = self._fp.tell() - start
        count = len(self._central)
        if count > 0xFFFF:
            raise ValueError("too many members for a non-zip64 archive")
        self._fp.write(struct.pack("<IHHHHIIH", _END_SIG, 0, 0, count, count, size, start, 0))
        self._fp.close()
