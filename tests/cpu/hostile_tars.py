"""JIT-cache tars built header by header, and a catalogue of hostile ones that restore must refuse.

tarfile writes only well-formed tars; the hostile ones (a pax `mtime` of `nan`, a GNU sparse member with garbage
in its sparse map, a checksum that does not add up, a size that is not octal) are written here byte by byte, each
header's checksum computed unless the case is about the checksum. test_jitcache.py runs the catalogue through
jitcache.restore; test_archive_fuzz.py's "tar headers" family puts each into an archive (forged, so that read_shared
hands it over) and runs it through everything that reads an archive.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import random

BLOCK = 512
END = bytes(2 * BLOCK)
POSIX = b"ustar\x0000"
GNU = b"ustar  \x00"
MTIME = 1_700_000_000


def header(
    name: str | bytes,
    *,
    kind: bytes = b"0",
    size: int = 0,
    mode: int = 0o644,
    mtime: int = MTIME,
    magic: bytes = POSIX,
    linkname: bytes = b"",
    fields: dict[int, bytes] | None = None,
    checksum: bytes | None = None,
) -> bytes:
    """One 512-byte ustar header; `fields` overwrite bytes at their offsets before the checksum is computed
    (`checksum` replaces the computed one)."""
    raw = bytearray(BLOCK)
    raw[0:100] = (name.encode() if isinstance(name, str) else name)[:100].ljust(100, b"\0")
    raw[100:108] = b"%07o\0" % mode
    raw[108:116] = raw[116:124] = b"0000000\0"
    raw[124:136] = b"%011o\0" % size
    raw[136:148] = b"%011o\0" % mtime
    raw[156:157] = kind
    raw[157:257] = linkname[:100].ljust(100, b"\0")
    raw[257:265] = magic
    raw[329:337] = raw[337:345] = b"0000000\0"
    for offset, value in (fields or {}).items():
        raw[offset : offset + len(value)] = value
    raw[148:156] = b" " * 8
    raw[148:156] = checksum if checksum is not None else b"%06o\0 " % sum(raw)
    return bytes(raw)


def padded(data: bytes) -> bytes:
    return data + bytes(-len(data) % BLOCK)


def file(name: str | bytes, data: bytes = b"x", **fields: object) -> bytes:
    """A regular-file member: its header and its data."""
    return header(name, size=len(data), **fields) + padded(data)  # type: ignore[arg-type]


def pax(records: dict[str, str] | bytes) -> bytes:
    """A pax extended header ("<length> <key>=<value>\\n" records, or raw record bytes) for the next member."""
    if isinstance(records, bytes):
        data = records
    else:
        data = b""
        for key, value in records.items():
            body = f" {key}={value}\n".encode("utf-8", "surrogateescape")
            n = len(body) + 1
            while len(str(n)) + len(body) != n:
                n = len(str(n)) + len(body)
            data += str(n).encode() + body
    return header("././@PaxHeader", kind=b"x", size=len(data)) + padded(data)


def tar(*members: bytes) -> bytes:
    """Members, then the end-of-archive blocks."""
    return b"".join(members) + END


GOOD = file("triton/good/kernel.json", b"{}")  # a member before the hostile one: nothing may be written of it


def _gnu_sparse() -> bytes:
    """A GNU sparse member (GNU magic, type S) whose sparse map holds garbage instead of octal numbers."""
    fields = {386: b"\xff" * 12 + b"zz" * 6, 482: b"\x01", 483: b"99999999999\0"}
    return header("triton/sparse", kind=b"S", size=10, magic=GNU, fields=fields) + padded(b"0123456789")


def _garbage(seed: int, size: int) -> bytes:
    rng = random.Random(seed)
    return bytes(rng.randrange(256) for _ in range(size))


# label -> (blob, what the refusal says): every one must be a JitCacheError, and nothing may be written
HOSTILE: dict[str, tuple[bytes, str]] = {
    "pax mtime nan": (tar(GOOD, pax({"mtime": "nan"}), file("triton/a")), "pax mtime 'nan' is not a time"),
    "pax mtime inf": (tar(GOOD, pax({"mtime": "inf"}), file("triton/a")), "pax mtime 'inf' is not a time"),
    "pax mtime -inf": (tar(GOOD, pax({"mtime": "-inf"}), file("triton/a")), "pax mtime '-inf' is not a time"),
    "pax mtime 25 digits": (tar(GOOD, pax({"mtime": "1" * 25}), file("triton/a")), "pax mtime '1111"),
    "pax mtime past 2262": (tar(GOOD, pax({"mtime": "9999999999"}), file("triton/a")), "1677 to 2262"),
    "pax mtime exponent": (tar(GOOD, pax({"mtime": "1e9"}), file("triton/a")), "pax mtime '1e9' is not a time"),
    "pax mtime 10 decimals": (tar(GOOD, pax({"mtime": "1.0123456789"}), file("triton/a")), "is not a time"),
    "pax mtime other digits": (tar(GOOD, pax({"mtime": "\u0661\u0662"}), file("triton/a")), "is not a time"),
    "pax mtime empty": (tar(GOOD, pax({"mtime": ""}), file("triton/a")), "pax mtime '' is not a time"),
    "GNU sparse member, malformed map": (tar(GOOD, _gnu_sparse()), "not a POSIX tar header"),
    "sparse member (POSIX header)": (tar(GOOD, header("triton/s", kind=b"S")), "is a GNU sparse file"),
    "pax sparse map": (
        tar(GOOD, pax({"GNU.sparse.map": "0,x,zz"}), file("triton/s")),
        "'GNU.sparse.map': a key SAVE does not write",
    ),
    "symbolic link": (tar(GOOD, header("triton/l", kind=b"2", linkname=b"/etc/passwd")), "is a symbolic link"),
    "hard link": (tar(GOOD, header("triton/h", kind=b"1", linkname=b"triton/good/kernel.json")), "is a hard link"),
    "character device": (tar(GOOD, header("triton/c", kind=b"3")), "is a character device"),
    "block device": (tar(GOOD, header("triton/b", kind=b"4")), "is a block device"),
    "FIFO": (tar(GOOD, header("triton/f", kind=b"6")), "is a FIFO"),
    "contiguous file": (tar(GOOD, header("triton/k", kind=b"7")), "is a contiguous file"),
    "global pax header": (tar(GOOD, header("g", kind=b"g")), "is a global pax header"),
    "GNU long name": (tar(GOOD, header("././@LongLink", kind=b"L", size=4) + padded(b"x/yy")), "is a GNU long"),
    "unknown type": (tar(GOOD, header("triton/q", kind=b"Q")), "is of type b'Q'"),
    "..": (tar(GOOD, file("triton/../../escape")), "not a plain relative path"),
    ".. in a pax path": (tar(GOOD, pax({"path": "triton/../x"}), file("triton/x")), "not a plain relative path"),
    "absolute path": (tar(GOOD, file("/etc/passwd")), "has an absolute path"),
    "absolute pax path": (tar(GOOD, pax({"path": "/tmp/x"}), file("triton/x")), "has an absolute path"),
    "absolute through the prefix": (tar(GOOD, file("x", fields={345: b"/etc"})), "has an absolute path"),
    "dot": (tar(GOOD, file("triton/./a")), "not a plain relative path"),
    "double slash": (tar(GOOD, file("triton//a")), "not a plain relative path"),
    "backslash": (tar(GOOD, file("triton/a\\..\\b")), "not a plain relative path"),
    "NUL in a pax path": (tar(GOOD, pax({"path": "triton/a\0b"}), file("triton/x")), "not a plain relative path"),
    "not in a cache folder": (tar(GOOD, file("toplevel")), "does not lie in a named cache folder"),
    "bad cache name": (tar(GOOD, file(".hidden/a")), "does not lie in a named cache folder"),
    "path too long": (tar(GOOD, pax({"path": "triton/" + "a/" * 2100 + "f"}), file("triton/x")), "longer than"),
    "name too long": (tar(GOOD, pax({"path": "triton/" + "n" * 300}), file("triton/x")), "longer than"),
    "folder that claims bytes": (tar(GOOD, header("triton/d/", kind=b"5", size=512) + bytes(512)), "claims 512"),
    "a file listed twice": (tar(GOOD, file("triton/good/kernel.json")), "is listed twice"),
    "a file with members below it": (tar(GOOD, file("triton/good/kernel.json/x")), "lies below it"),
    "bad checksum": (tar(GOOD, header("triton/a", checksum=b"0000000\0")), "says checksum 0"),
    "size not octal": (tar(GOOD, header("triton/a", fields={124: b"0000000009a\0"})), "has size"),
    "size base-256": (tar(GOOD, header("triton/a", fields={124: b"\x80" + bytes(10) + b"\x01"})), "has size"),
    "mode not octal": (tar(GOOD, header("triton/a", fields={100: b"rwxr-xr\0"})), "has mode"),
    "mtime not octal": (tar(GOOD, header("triton/a", fields={136: b"nan\0"})), "has mtime"),
    "uid not octal": (tar(GOOD, header("triton/a", fields={108: b"root\0"})), "has uid"),
    "devmajor not octal": (tar(GOOD, header("triton/a", fields={329: b"\xff" * 8})), "has devmajor"),
    "GNU magic": (tar(GOOD, file("triton/a", magic=GNU)), "not a POSIX tar header"),
    "v7 header (no magic)": (tar(GOOD, file("triton/a", magic=bytes(8))), "not a POSIX tar header"),
    "pax header too long": (tar(GOOD, pax({"path": "triton/" + "p" * 70_000}), file("triton/x")), "at most"),
    "pax record length wrong": (tar(GOOD, pax(b"99 mtime=1\n"), file("triton/x")), "is malformed at its byte 0"),
    "pax record without =": (tar(GOOD, pax(b"9 mtime1\n"), file("triton/x")), "is malformed"),
    "pax key twice": (tar(GOOD, pax(b"11 mtime=1\n11 mtime=2\n"), file("triton/x")), "'mtime': twice"),
    "pax unknown charset": (tar(GOOD, pax({"hdrcharset": "EBCDIC"}), file("triton/x")), "unknown character set"),
    "pax size": (tar(GOOD, pax({"size": "1"}), file("triton/x")), "'size': a key SAVE does not write"),
    "two pax headers": (tar(GOOD, pax({"mtime": "1"}), pax({"mtime": "2"}), file("triton/x")), "two pax headers"),
    "pax header with no member": (tar(GOOD, pax({"mtime": "1"})), "has no member"),
    "data past the end": (GOOD + file("triton/a", bytes(4096))[: BLOCK + 100], "past the tar's end"),
    "truncated in a header": ((GOOD + file("triton/a"))[: len(GOOD) + 300], "without its end-of-archive blocks"),
    "no end blocks": (GOOD + file("triton/a"), "without its end-of-archive blocks"),
    "one end block": (GOOD + file("triton/a") + bytes(BLOCK), "is not two zero blocks"),
    "bytes after the end": (tar(GOOD) + b"\x01" + bytes(BLOCK - 1), "bytes after its end"),
    "not whole blocks": (tar(GOOD) + bytes(100), "bytes after its end"),
    "empty": (b"", "ends at byte 0"),
    "garbage": (_garbage(1, 10240), "not a POSIX tar header"),
    "text": (b"not a tar at all\n" * 64, "not a POSIX tar header"),
    "gzip": (gzip.compress(tar(GOOD), mtime=0), "it is compressed (gzip)"),
    "xz": (lzma.compress(tar(GOOD)), "it is compressed (xz)"),
    "bzip2": (bz2.compress(tar(GOOD)), "it is compressed (bzip2)"),
}
