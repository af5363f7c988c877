"""Torch symmetric memory without multicast (SGLang patch 0007 and sglang/srt/graphpersist_symm_multicast.py).

The decision logic runs here as it is (the overlay imports only the standard library and graphpersist.engine). The
patched communicator is checked in the built wheel (network: it needs dist/): its `__init__` runs against stand-ins for
torch and the SGLang modules it imports, with rendezvous() reporting no multicast address, so what is pinned down is
the behaviour upstream code gets from the patch: on with the opt-in at world size 2, off (with upstream's warning)
everywhere else.
"""

from __future__ import annotations

import functools
import logging
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from module_file import load_module

REPO = Path(__file__).resolve().parents[2]
OVERLAY_PATH = REPO / "overlays" / "sglang" / "sglang" / "srt" / "graphpersist_symm_multicast.py"
MULTIMEM = {9: [4, 6, 8], 10: [4, 6, 8]}  # TorchSymmMemCommunicator._WORLD_SIZES_MULTIMEM in SGLang 0.5.17


symm = load_module(OVERLAY_PATH, "sglang_symm_multicast_overlay", sys.modules.__setitem__)


@pytest.mark.parametrize("value", ["yes", "true", "2", " 1"])
def test_any_other_value_is_refused_naming_what_to_set(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(symm.ENV, value)
    with pytest.raises(ValueError, match=rf"GRAPHPERSIST_SYMM_MEM_NO_MULTICAST={value!r} is not 1 or 0\. Set .*=1 "
                       "to let torch symmetric memory run its two-shot all-reduce without multicast"):  # fmt: skip
        symm.keep_without_multicast(2, 9, MULTIMEM, inkling_custom_ar=False)


def decided(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, world_size: int, capability: int, inkling: bool
) -> tuple[bool, str]:
    """An opted-in start's decision and the one line it logs."""
    monkeypatch.setenv(symm.ENV, "1")
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        keep = symm.keep_without_multicast(world_size, capability, MULTIMEM, inkling_custom_ar=inkling)
    [record] = caplog.records
    return keep, record.getMessage()


@pytest.mark.parametrize("capability", [9, 10])
def test_world_size_2_runs_two_shot_and_keeps_the_communicator(
    capability: int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert decided(monkeypatch, caplog, 2, capability, False) == (
        True,
        "graphpersist: torch symmetric memory without multicast: the two-shot all-reduce at world size 2 needs none: "
        "communicator on",
    )


@pytest.mark.parametrize("world_size", [4, 6, 8])
def test_multimem_world_sizes_still_need_multicast(
    world_size: int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert decided(monkeypatch, caplog, world_size, 9, False) == (
        False,
        f"graphpersist: torch symmetric memory without multicast: world size {world_size} on SM90 runs the multimem "
        "all-reduce, which needs it: communicator off (as upstream)",
    )


def test_a_capability_without_multimem_sizes_runs_two_shot_at_any_world_size(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert decided(monkeypatch, caplog, 4, 12, False)[0]


def test_inklings_all_reduce_reads_the_multicast_address_so_it_stays_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    keep, line = decided(monkeypatch, caplog, 2, 9, True)
    assert not keep and "SGLANG_OPT_USE_INKLING_CUSTOM_AR" in line


@pytest.mark.parametrize("value", [None, "", "0"])
def test_without_the_opt_in_upstream_decides_and_nothing_is_logged(
    value: str | None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Unset or 0: not opted in; the communicator then stays off, as upstream turns it off."""
    if value is None:
        monkeypatch.delenv(symm.ENV, raising=False)
    else:
        monkeypatch.setenv(symm.ENV, value)
    with caplog.at_level(logging.DEBUG):
        assert symm.keep_without_multicast(2, 9, MULTIMEM, inkling_custom_ar=False) is False
    assert caplog.records == []


@pytest.mark.parametrize(("world_size", "keep", "level"), [(2, True, logging.INFO), (8, False, logging.WARNING)])
def test_with_the_opt_in_the_decision_is_logged(
    world_size: int, keep: bool, level: int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(symm.ENV, "1")
    with caplog.at_level(logging.DEBUG):
        assert symm.keep_without_multicast(world_size, 9, MULTIMEM, inkling_custom_ar=False) is keep
    [record] = caplog.records
    assert record.levelno == level
    assert record.getMessage().startswith("graphpersist: torch symmetric memory without multicast: ")


def test_the_archive_pins_the_opt_in() -> None:
    """A LOAD whose start reduces differently from its SAVE is refused: the variable is a pinned environment fact."""
    from graphpersist.archive.liveenv import PINNED_ENV

    assert symm.ENV in PINNED_ENV


def test_the_symm_recipe_quotes_the_line_the_overlay_logs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    readme = (REPO / "recipes" / "sglang-qwen3-8b-tp2-symm" / "README.md").read_text()
    assert decided(monkeypatch, caplog, 2, 9, False)[1] in readme


def test_the_symm_recipe_sets_the_variable_the_overlay_reads() -> None:
    driver = (REPO / "recipes" / "sglang-qwen3-8b-tp2" / "driver.py").read_text()
    assert f'SYMM_MEM_NO_MULTICAST_ENV = "{symm.ENV}"' in driver


# ------------------------------------------------------------------------------------------- the built wheel

COMMUNICATOR = "sglang/srt/distributed/device_communicators/torch_symm_mem.py"
SIZES = "sglang/srt/distributed/device_communicators/all_reduce_utils.py"
OVERLAY = "sglang/srt/graphpersist_symm_multicast.py"


@pytest.fixture(scope="module")
def built(dist_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The patched communicator, its size table and the overlay, extracted from the built SGLang wheel."""
    [wheel] = sorted(dist_dir.glob("sglang-0.5.17+gp.*.whl"))
    out = tmp_path_factory.mktemp("sglang-symm")
    with zipfile.ZipFile(wheel) as zf:
        for name in (COMMUNICATOR, SIZES, OVERLAY):
            zf.extract(name, out)
    return out


def stand_ins(built: Path, world_size: int, inkling: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """What torch_symm_mem.py imports, in sys.modules for the test's length, with rendezvous() returning no multicast
    address (as on our host)."""
    bf16 = SimpleNamespace(itemsize=2)
    torch = SimpleNamespace(
        bfloat16=bf16,
        Tensor=object,
        device=lambda spec: SimpleNamespace(spec=spec),
        cuda=SimpleNamespace(set_device=lambda device: None, get_device_capability=lambda device: (9, 0)),
    )
    symmetric = SimpleNamespace(
        empty=lambda n, device, dtype: SimpleNamespace(numel=n),
        rendezvous=lambda buffer, name: SimpleNamespace(multicast_ptr=0, buffer_ptrs=[1, 2]),
    )
    dist = SimpleNamespace(get_world_size=lambda group: world_size, ProcessGroup=object)
    envs = SimpleNamespace(
        SGLANG_OPT_USE_INKLING_CUSTOM_AR=SimpleNamespace(get=lambda: inkling),
        SGLANG_OPT_USE_INKLING_FUSED_AR_SCONV=SimpleNamespace(get=lambda: False),
    )
    exec_context = SimpleNamespace(comm=SimpleNamespace(enable_scattered_sconv=False))
    modules: dict[str, Any] = {
        "torch": torch,
        "torch.distributed": dist,
        "torch.distributed._symmetric_memory": symmetric,
        "sglang": SimpleNamespace(),
        "sglang.srt": SimpleNamespace(),
        "sglang.srt.environ": SimpleNamespace(envs=envs),
        "sglang.srt.runtime_context": SimpleNamespace(get_exec=lambda: exec_context),
        "sglang.srt.utils": SimpleNamespace(is_cuda=lambda: True, is_hip=lambda: False),
    }
    torch.distributed = dist
    dist._symmetric_memory = symmetric
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    for name, path in (
        ("sglang.srt.distributed.device_communicators.all_reduce_utils", built / SIZES),
        ("sglang.srt.graphpersist_symm_multicast", built / OVERLAY),
    ):
        load_module(path, name, functools.partial(monkeypatch.setitem, sys.modules))


def communicator(built: Path, monkeypatch: pytest.MonkeyPatch, world_size: int, inkling: bool = False) -> Any:
    """A TorchSymmMemCommunicator of the patched module, built for `world_size` ranks."""
    stand_ins(built, world_size, inkling, monkeypatch)
    module = load_module(built / COMMUNICATOR, "patched_torch_symm_mem")
    return module.TorchSymmMemCommunicator(SimpleNamespace(group_name="tp"), 0)


@pytest.mark.parametrize(
    ("opt_in", "world_size", "inkling", "on"),
    [("1", 2, False, True), (None, 2, False, False), ("0", 2, False, False), ("1", 4, False, False),
     ("1", 2, True, False)],
)  # fmt: skip
def test_the_patched_communicator_stays_on_only_for_two_shot_with_the_opt_in(
    built: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    opt_in: str | None,
    world_size: int,
    inkling: bool,
    on: bool,
) -> None:
    if opt_in is None:
        monkeypatch.delenv(symm.ENV, raising=False)
    else:
        monkeypatch.setenv(symm.ENV, opt_in)
    with caplog.at_level(logging.INFO):
        comm = communicator(built, monkeypatch, world_size, inkling)
    assert comm.disabled is not on
    assert (comm.buffer is not None) is on
    upstream_warning = "multicast operations are not supported" in caplog.text
    assert upstream_warning is not on
    assert ("graphpersist: torch symmetric memory without multicast" in caplog.text) is (opt_in == "1")
