"""Wheel metadata edits: version stamping, the runtime requirement, and RECORD."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class WheelName:
    """The parts of a wheel file name: {distribution}-{version}-{python}-{abi}-{platform}.whl."""

    distribution: str
    version: str
    tags: str

    @classmethod
    def parse(cls, filename: str) -> WheelName:
        if not filename.endswith(".whl"):
            raise ValueError(f"{filename} is not a wheel file name")
        parts = filename[: -len(".whl")].split("-")
        if len(parts) not in (5, 6):
            raise ValueError(f"{filename}: unexpected wheel file name")
        return cls(parts[0], parts[1], "-".join(parts[-3:]))

    def with_version(self, version: str) -> WheelName:
        return WheelName(self.distribution, version, self.tags)

    @property
    def filename(self) -> str:
        return f"{self.distribution}-{self.version}-{self.tags}.whl"

    @property
    def dist_info(self) -> str:
        return f"{self.distribution}-{self.version}.dist-info"


def record_digest(data: bytes) -> str:
    """RECORD's hash form: sha256, urlsafe base64 without padding."""
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def hex_to_record_digest(hexdigest: str) -> str:
    return "sha256=" + base64.urlsafe_b64encode(bytes.fromhex(hexdigest)).rstrip(b"=").decode()


def parse_record(text: str) -> dict[str, tuple[str, str]]:
    """RECORD rows as path -> (hash, size); RECORD's own row has empty fields."""
    return {row[0]: (row[1], row[2]) for row in csv.reader(io.StringIO(text)) if row}


def render_record(rows: list[tuple[str, str, str]]) -> bytes:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for row in rows:
        writer.writerow(row)
    return buf.getvalue().encode()


def requires(metadata: str, project: str) -> bool:
    """Whether METADATA's headers already declare a requirement on `project` (any version, any marker)."""
    head = metadata.partition("\n\n")[0]
    want = _canonical(project)
    return any(
        line.startswith("Requires-Dist: ") and _canonical(re.split(r"[=<>!~ ;\[(]", line[15:], maxsplit=1)[0]) == want
        for line in head.split("\n")
    )


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def stamp_metadata(metadata: str, version: str, requirement: str | list[str] | None, *, name: str | None = None) -> str:
    """Set the Version header (and the Name header when `name` is given: a renamed distribution) and add the
    Requires-Dist lines after the existing ones (headers end at the first blank line)."""
    head, sep, body = metadata.partition("\n\n")
    if not sep:  # headers only, no blank line after them
        head, sep = head.rstrip("\n"), "\n"
    lines = head.split("\n")
    for header, value in (("Version", version), ("Name", name)):
        if value is None:
            continue
        found = [i for i, line in enumerate(lines) if line.startswith(f"{header}: ")]
        if len(found) != 1:
            raise ValueError(f"METADATA must have exactly one {header} header")
        lines[found[0]] = f"{header}: {value}"
    wanted = [requirement] if isinstance(requirement, str) else list(requirement or [])
    for req in wanted:
        project = re.split(r"[=<>!~ ;\[]", req, maxsplit=1)[0]
        if requires("\n".join(lines), project):
            raise ValueError(f"METADATA already requires {project.lower()}")
        req_lines = [i for i, line in enumerate(lines) if line.startswith("Requires-Dist: ")]
        at = (req_lines[-1] + 1) if req_lines else len(lines)
        lines.insert(at, f"Requires-Dist: {req}")
    return "\n".join(lines) + sep + body
