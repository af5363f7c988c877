"""Just enough of an OpenAI-compatible HTTP client for the serve proof, with the standard library only.

The GPU host has no network and no `openai` package; the proof needs plain JSON requests, server-sent events for
streaming, and a probe that says why a server did not answer (refused, timed out) without raising.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterable, Iterator
from typing import Any

HOST = "127.0.0.1"
DONE = "[DONE]"
JSON = {"Content-Type": "application/json"}


class ServerError(RuntimeError):
    """The server answered, but not with what the request needed (an HTTP error, an error event, a broken stream)."""


def probe(port: int, path: str, timeout_s: float = 2.0) -> str:
    """GET `path`: the HTTP status as text ("200", "503"), or why there was none ("refused", "timed out", ...)."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return str(response.status)
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "timed out"
    except (ConnectionError, http.client.HTTPException) as exc:
        return type(exc).__name__
    finally:
        conn.close()


def _request(port: int, method: str, path: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout_s)
    try:
        data = None if body is None else json.dumps(body)
        conn.request(method, path, body=data, headers=JSON)
        response = conn.getresponse()
        text = response.read().decode(errors="replace")
    finally:
        conn.close()
    if response.status != 200:
        raise ServerError(f"{method} {path}: HTTP {response.status}: {text[:500]}")
    try:
        return json.loads(text)
    except ValueError:
        raise ServerError(f"{method} {path}: the answer is not JSON: {text[:200]}") from None


def get_json(port: int, path: str, timeout_s: float = 30.0) -> Any:
    return _request(port, "GET", path, None, timeout_s)


def post_json(port: int, path: str, body: dict[str, Any], timeout_s: float = 300.0) -> Any:
    return _request(port, "POST", path, body, timeout_s)


def sse_events(lines: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON objects of a server-sent event stream, up to `data: [DONE]`.

    Events are separated by blank lines; an event's `data:` lines are joined with newlines; comments (`:`) and
    other fields are ignored. A stream that ends without [DONE], or an event that is not JSON, is a ServerError.
    """
    data: list[str] = []
    for raw in lines:
        line = raw.decode(errors="replace").rstrip("\r\n")
        if line:
            field, _, value = line.partition(":")
            if field == "data":
                data.append(value[1:] if value.startswith(" ") else value)
            continue
        if not data:
            continue
        event, data = "\n".join(data), []
        if event == DONE:
            return
        try:
            yield json.loads(event)
        except ValueError:
            raise ServerError(f"a streamed event is not JSON: {event[:200]}") from None
    raise ServerError(f"the stream ended without `data: {DONE}`")


def post_stream(port: int, path: str, body: dict[str, Any], timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """POST a streaming request (`"stream": true` is added); every event until [DONE]. An error event raises."""
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout_s)
    try:
        conn.request("POST", path, body=json.dumps({**body, "stream": True}), headers=JSON)
        response = conn.getresponse()
        if response.status != 200:
            raise ServerError(f"POST {path} (stream): HTTP {response.status}: {response.read()[:500]!r}")
        events = list(sse_events(iter(response.readline, b"")))
    finally:
        conn.close()
    for event in events:
        if "error" in event:
            raise ServerError(f"POST {path} (stream): error event: {json.dumps(event['error'])[:500]}")
    return events
