"""State an engine prepares in setup for its captures (graphpersist.engine.prepared), written once for every engine:
which tensors it is, and the refusals when the captures changed it (SAVE) or LOAD prepared another (torch stood in)."""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from graphpersist import engine
from graphpersist.errors import PersistError


class Tensor:
    """torch.Tensor as the walk reads it."""

    def __init__(self, ptr: int, cuda: bool = True) -> None:
        self.ptr, self.is_cuda, self.dtype, self.shape = ptr, cuda, "torch.int32", (4,)

    def data_ptr(self) -> int:
        return self.ptr

    def stride(self) -> tuple[int, ...]:
        return (1,)


class Module:
    """torch.nn.Module: its tensors are setup tensors, never walked."""


@pytest.fixture(autouse=True)
def torch(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = ModuleType("torch")
    fake.Tensor = Tensor  # type: ignore[attr-defined]
    fake.nn = SimpleNamespace(Module=Module)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", fake)


def described(ptr: int) -> list[Any]:
    return [ptr, "torch.int32", [4], [1]]


def backend() -> SimpleNamespace:
    """An attention backend with per-shape metadata for batch sizes 1 and 8, and state that is not per shape."""
    layer = Module()
    layer.weight = Tensor(0x999)  # type: ignore[attr-defined]
    per_shape = {
        1: SimpleNamespace(page_table=Tensor(0x100), cpu_copy=Tensor(0x200, cuda=False)),
        8: [Tensor(0x300), {"cu_seqlens": Tensor(0x400)}, layer],
        16: Tensor(0x500),
    }
    return SimpleNamespace(
        decode_metadata=per_shape,
        by_name={"workspace": Tensor(0x600)},
        deep={1: {"a": {"b": {"c": {"d": Tensor(0x700)}}}}},
    )


def test_the_per_shape_tensors_are_the_cuda_tensors_under_a_captured_size_by_path() -> None:
    assert engine.per_shape_tensors(backend(), "attn_backend", [1, 8]) == {
        "attn_backend.decode_metadata[1].page_table": described(0x100),
        "attn_backend.decode_metadata[8][0]": described(0x300),
        "attn_backend.decode_metadata[8][1]['cu_seqlens']": described(0x400),
    }  # a CPU tensor, a size not captured, state not per shape, a module's and one too deep are left out


def prepared_state(read: list[dict[str, list[Any]]]) -> engine.PreparedState:
    return engine.PreparedState("attn_shapes", "the attention backend's per-shape state", lambda: read[0],
                                advice="use --attention-backend fa3")  # fmt: skip


def test_save_records_the_prepared_state_the_captures_left_as_it_was() -> None:
    before = {"a[1]": described(0x100)}
    assert prepared_state([dict(before)]).after_capture(before) == before


def test_save_refuses_state_the_captures_changed_naming_the_first_path_both_values_and_the_count() -> None:
    before = {"a[1]": described(0x100), "a[8]": described(0x300)}
    after = {"a[1]": described(0x180), "a[2]": described(0x200), "a[8]": described(0x300)}
    with pytest.raises(PersistError) as refused:
        prepared_state([after]).after_capture(before)
    assert str(refused.value) == (
        "graphpersist: the attention backend's per-shape state changed during the capture (a[1]: prepared "
        f"{described(0x100)}, captured {described(0x180)}; 2 in all), so LOAD could not prepare it exactly: SAVE "
        "refused (use --attention-backend fa3)"
    )


def test_load_accepts_the_state_save_prepared_and_refuses_another_naming_saved_and_live() -> None:
    live = {"a[1]": described(0x100)}
    state = prepared_state([live])
    state.check_saved(live, {"attn_shapes": dict(live)})
    with pytest.raises(PersistError) as refused:
        state.check_saved(live, {"attn_shapes": {"a[1]": described(0x140)}})
    assert str(refused.value) == (
        f"graphpersist: the attention backend's per-shape state differs from SAVE's (a[1]: saved {described(0x140)}, "
        f"live {described(0x100)}; 1 in all): LOAD refused. Re-run with mode=save for this configuration."
    )
    with pytest.raises(PersistError, match=r"\(a\[1\]: saved None, live "):
        state.check_saved(live, {})  # an archive whose rank notes lack the state
