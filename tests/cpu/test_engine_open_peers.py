"""LOAD's re-opening of the peers' buffers a post-capture registration opened by legacy CUDA IPC handle (vLLM's custom
all-reduce): graphpersist.engine.open_peers, with the driver's export and open stood in and the ranks' exchange a
list. The order matters: under the interposer each open maps at the next address SAVE recorded."""

from __future__ import annotations

from typing import Any

import pytest

from graphpersist import engine
from graphpersist.memory import legacyipc


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The export and open calls, in order; a handle is `b"<rank's buffer address>"`, opened at 1000 + that address."""
    calls: list[str] = []

    def export(ptr: int) -> bytes:
        calls.append(f"export {ptr}")
        return str(ptr).encode()

    def open_(handle: bytes) -> int:
        calls.append(f"open {handle.decode()}")
        return 1000 + int(handle)

    monkeypatch.setattr(legacyipc, "export_handle", export)
    monkeypatch.setattr(legacyipc, "open_handle", open_)
    return calls


def test_each_peers_buffer_is_opened_once_buffer_by_buffer_in_rank_order(driver: list[str]) -> None:
    """Rank 1 of 3: its own two buffers are exported, never opened; the peers' buffers 0 then 1, peers 0 then 2; a
    handle two buffers share (one allocation) is opened once."""
    sent: list[Any] = []

    def gather(mine: Any) -> list[Any]:
        sent.append(mine)
        return [[b"10", b"11"], mine, [b"30", b"30"]]

    opened = engine.open_peers([20, 21], gather, rank=1)
    assert sent == [[b"20", b"21"]]
    assert driver == ["export 20", "export 21", "open 10", "open 30", "open 11"]
    assert opened == {b"10": 1010, b"30": 1030, b"11": 1011}


def test_no_buffers_open_nothing(driver: list[str]) -> None:
    assert engine.open_peers([], lambda mine: [mine, mine], rank=0) == {} and driver == []
