"""deep_ep's persistence defaults (overlays/deep_ep/deep_ep/graphpersist_buffer.py) on their own: no torch, no wheel.

Persistence off returns the caller's Buffer settings unchanged; save and load force the no-fabric NVL path
(use_fabric=False, allow_mnnvl=False) and refuse NVSHMEM with a line per setting and one line of advice; keyword
arguments the pinned DeepEP lacks (NVFP4 dispatch, SGLang's single-batch overlap) get a TypeError that says what to do.
The patched Buffer that calls these is exercised in tests/cpu/test_deep_ep_wheel.py.
"""

from __future__ import annotations

import ast
import itertools
import logging
import sys
from pathlib import Path
from types import ModuleType

import pytest
from module_file import load_module

from graphpersist.switch import SwitchError

OVERLAY = Path(__file__).resolve().parents[2] / "overlays" / "deep_ep" / "deep_ep" / "graphpersist_buffer.py"


@pytest.fixture(scope="module")
def gb() -> ModuleType:
    """The overlay module loaded from its file: importing it as deep_ep.graphpersist_buffer would run deep_ep's
    __init__, which needs torch and the CUDA extension."""
    return load_module(OVERLAY, "gp_test_deep_ep_graphpersist_buffer", sys.modules.__setitem__)


FLAGS = list(itertools.product([False, True], repeat=2))


@pytest.mark.parametrize("environ", [{}, {"GRAPHPERSIST_MODE": ""}, {"GRAPHPERSIST_MODE": "off"}])
@pytest.mark.parametrize(("allow_mnnvl", "use_fabric"), FLAGS)
def test_off_keeps_what_the_caller_asked_for(
    gb: ModuleType, environ: dict, allow_mnnvl: bool, use_fabric: bool
) -> None:
    got = gb.buffer_settings(
        num_rdma_bytes=0, low_latency_mode=False, allow_mnnvl=allow_mnnvl, use_fabric=use_fabric, environ=environ
    )
    assert got == (allow_mnnvl, use_fabric) and got.use_fabric is use_fabric


def test_off_refuses_nothing_not_even_nvshmem(gb: ModuleType) -> None:
    """Off is upstream: low-latency mode and RDMA buffers go through untouched."""
    got = gb.buffer_settings(
        num_rdma_bytes=1 << 30, low_latency_mode=True, allow_mnnvl=True, use_fabric=True, environ={}
    )
    assert got == gb.Settings(allow_mnnvl=True, use_fabric=True)


@pytest.mark.parametrize("mode", ["save", "load"])
@pytest.mark.parametrize(("allow_mnnvl", "use_fabric"), FLAGS)
def test_persistence_takes_the_no_fabric_nvl_path(
    gb: ModuleType, mode: str, allow_mnnvl: bool, use_fabric: bool
) -> None:
    got = gb.buffer_settings(
        num_rdma_bytes=0,
        low_latency_mode=False,
        allow_mnnvl=allow_mnnvl,
        use_fabric=use_fabric,
        environ={"GRAPHPERSIST_MODE": mode},
    )
    assert got == gb.Settings(allow_mnnvl=False, use_fabric=False)


def test_an_overridden_request_is_said_once_per_buffer(gb: ModuleType, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        gb.buffer_settings(
            num_rdma_bytes=0,
            low_latency_mode=False,
            allow_mnnvl=True,
            use_fabric=True,
            environ={"GRAPHPERSIST_MODE": "save"},
        )
        gb.buffer_settings(
            num_rdma_bytes=0,
            low_latency_mode=False,
            allow_mnnvl=False,
            use_fabric=False,
            environ={"GRAPHPERSIST_MODE": "save"},
        )
    [record] = caplog.records
    assert record.getMessage().startswith(
        "graphpersist: deep_ep.Buffer: use_fabric=True, allow_mnnvl=True set to False (persistence save)"
    )


@pytest.mark.parametrize("mode", ["save", "load"])
def test_low_latency_mode_is_refused_naming_it_and_normal_mode(gb: ModuleType, mode: str) -> None:
    with pytest.raises(gb.PersistRefusal) as err:
        gb.buffer_settings(
            num_rdma_bytes=0,
            low_latency_mode=True,
            allow_mnnvl=False,
            use_fabric=False,
            environ={"GRAPHPERSIST_MODE": mode},
        )
    first, advice = str(err.value).splitlines()
    assert first.startswith(
        f"graphpersist: cannot take deep_ep.Buffer under graph persistence (mode {mode}, from GRAPHPERSIST_MODE): "
        "low_latency_mode=True: low-latency mode runs on NVSHMEM"
    )
    assert advice == gb.NORMAL_MODE_ADVICE
    assert "normal (high-throughput) mode" in advice and "--deepep-mode normal" in advice
    assert "--all2all-backend deepep_high_throughput" in advice


def test_an_rdma_buffer_is_refused_and_every_refused_setting_has_its_line(gb: ModuleType) -> None:
    with pytest.raises(gb.PersistRefusal) as err:
        gb.buffer_settings(
            num_rdma_bytes=1 << 30,
            low_latency_mode=True,
            allow_mnnvl=True,
            use_fabric=True,
            environ={"GRAPHPERSIST_MODE": "save"},
        )
    lines = str(err.value).splitlines()
    assert len(lines) == 3 and all(line.startswith("graphpersist: ") for line in lines[:2])
    assert ": low_latency_mode=True: " in lines[0]
    assert ": num_rdma_bytes=1073741824: an RDMA buffer is allocated by NVSHMEM" in lines[1]
    assert lines[2] == gb.NORMAL_MODE_ADVICE
    assert isinstance(err.value, ValueError)


def test_a_bad_mode_is_refused_by_the_runtime_switch(gb: ModuleType) -> None:
    with pytest.raises(SwitchError, match=r"invalid persistence mode 'saev' \(from GRAPHPERSIST_MODE\)"):
        gb.buffer_settings(
            num_rdma_bytes=0,
            low_latency_mode=False,
            allow_mnnvl=False,
            use_fabric=False,
            environ={"GRAPHPERSIST_MODE": "saev"},
        )


def test_no_unsupported_arguments_is_a_no_op(gb: ModuleType) -> None:
    assert gb.refuse_unsupported("low_latency_dispatch", {}) is None


def test_nvfp4_dispatch_is_refused_with_what_to_use_instead(gb: ModuleType) -> None:
    with pytest.raises(TypeError) as err:
        gb.refuse_unsupported("low_latency_dispatch", {"use_nvfp4": True, "x_global_scale": object()})
    assert isinstance(err.value, gb.UnsupportedByThisBuild)
    [line] = str(err.value).splitlines()
    assert line.startswith("graphpersist: deep_ep.Buffer.low_latency_dispatch() got use_nvfp4, x_global_scale: ")
    assert "has no NVFP4 low-latency dispatch" in line
    assert "--deepep-dispatcher-output-dtype fp8 or bf16" in line and "VLLM_DEEPEPLL_NVFP4_DISPATCH=0" in line


def test_single_batch_overlap_and_unknown_arguments_are_refused(gb: ModuleType) -> None:
    hopper = {"overlap": True, "packed_recv_count": 1, "comp_signal": 2, "block_m": 64, "threshold": 1, "num_sms": 3}
    with pytest.raises(gb.UnsupportedByThisBuild) as err:
        gb.refuse_unsupported("low_latency_combine", {**hopper, "frobnicate": 1})
    overlap, other = str(err.value).splitlines()
    assert overlap.startswith(
        "graphpersist: deep_ep.Buffer.low_latency_combine() got overlap, packed_recv_count, comp_signal, block_m, "
        "threshold, num_sms: "
    )
    assert overlap.endswith("has no single-batch-overlap combine; start SGLang without --enable-single-batch-overlap")
    assert other.startswith("graphpersist: deep_ep.Buffer.low_latency_combine() got unexpected keyword argument(s) ")
    assert "frobnicate" in other


def test_the_overlay_imports_only_the_standard_library_at_module_level() -> None:
    """Importing deep_ep must not pull in more than upstream does; graphpersist is read only when a mode is set."""
    tree = ast.parse(OVERLAY.read_text())
    top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    modules = {a.name.split(".")[0] for n in top if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module.split(".")[0] for n in top if isinstance(n, ast.ImportFrom) and n.module}
    assert modules <= set(sys.stdlib_module_names) | {"__future__"}, modules
