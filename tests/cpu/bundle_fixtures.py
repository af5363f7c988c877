"""Wheels and a package index made in a test, for `gptools bundle` (no network)."""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import threading
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename


def make_wheel(folder: Path, name: str, version: str, requires=(), files=None, tag="py3-none-any") -> Path:
    """A minimal valid wheel: METADATA with Requires-Dist, WHEEL, RECORD with hashes, and a module."""
    dist = name.replace("-", "_")
    files = dict(files or {f"{dist}/__init__.py": f"__version__ = {version!r}\n"})
    info = f"{dist}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    files[f"{info}/METADATA"] = meta
    files[f"{info}/WHEEL"] = f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n"
    record = []
    for path, text in files.items():
        data = text.encode() if isinstance(text, str) else text
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = "\n".join(record) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{dist}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for p, text in files.items():
            zf.writestr(p, text)
    return path


class FakeIndex:
    """A PEP 691 (JSON) simple index over a folder of wheels, read at each request, so a wheel added to the folder is
    a new release on the index. `served` replaces the bytes of a file name (what a tampering mirror would send) and
    `advertised` the sha256 the listing gives for it. `requests` records every path asked for."""

    def __init__(self, folder: Path, url: str):
        self.folder = folder
        self.url = url
        self.served: dict[str, bytes] = {}
        self.advertised: dict[str, str] = {}
        self.requests: list[str] = []

    def listing(self, project: str) -> dict:
        files = []
        for whl in sorted(self.folder.glob("*.whl")):
            if canonicalize_name(parse_wheel_filename(whl.name)[0]) != project:
                continue
            digest = self.advertised.get(whl.name) or hashlib.sha256(whl.read_bytes()).hexdigest()
            files.append({"filename": whl.name, "url": f"{self.url}/files/{whl.name}", "hashes": {"sha256": digest}})
        return {"meta": {"api-version": "1.0"}, "name": project, "files": files}

    def body(self, path: str) -> tuple[bytes, str] | None:
        parts = [p for p in path.split("/") if p]
        if len(parts) == 2 and parts[0] == "simple":
            return json.dumps(self.listing(canonicalize_name(parts[1]))).encode(), "application/vnd.pypi.simple.v1+json"
        if len(parts) == 2 and parts[0] == "files" and (self.folder / parts[1]).is_file():
            return self.served.get(parts[1]) or (self.folder / parts[1]).read_bytes(), "application/octet-stream"
        return None


@contextmanager
def fake_index(folder: Path) -> Iterator[FakeIndex]:
    """Serve `folder` as a package index on 127.0.0.1 (a free port) for the duration; yields the index, whose `url`
    + "/simple" is what GP_INDEX_URL would name."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            index.requests.append(self.path)
            found = index.body(self.path)
            if found is None:
                self.send_error(404)
                return
            data, ctype = found
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    index = FakeIndex(folder, f"http://127.0.0.1:{server.server_address[1]}")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield index
    finally:
        server.shutdown()
        server.server_close()
