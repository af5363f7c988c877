"""recipes/runtime-deepep-ep2-1gpu/proof.py without a GPU: the report's checks (each fails when its evidence is
missing or differs), the wheel lookup and the install folder rule. The groups themselves need the GPU host."""

from __future__ import annotations

import copy
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from module_file import load_module

REPO = Path(__file__).resolve().parents[2]
PROOF = REPO / "recipes" / "runtime-deepep-ep2-1gpu" / "proof.py"


@pytest.fixture(scope="module")
def proof() -> Any:
    return load_module(PROOF, "deepep_ep2_proof")


def rank(proof: Any, r: int, mode: str) -> dict[str, Any]:
    outs = {f"seed{s}": {"received": 9 + r, "recv_x": f"x{r}{s}", "recv_topk_idx": "i", "recv_topk_weights": "w",
                         "combined": f"c{r}{s}", "combined_finite": True, "combined_sum": 1.5}
            for s in proof.INPUT_SEEDS}  # fmt: skip
    res: dict[str, Any] = {"rank": r, "outputs": outs, "captures": 0, "buffer_s": 0.01, "setup_s": 1.0}
    if mode == "baseline":
        return res
    base = 0x500000000000
    res.update(nvl_buffer_ptr=base + (2 << 20), nvl_in_region=True, region=[hex(base), 16 << 30],
               ipc_handle_magic=hex(proof.GP_IPC_MAGIC), ipc_opens=[[hex(base + (300 << 20)), 270532608]],
               host_allocs=[[hex(0x4F0000000000), 4096, 8]], host_outside=[], setup_tensors={"x": hex(base)},
               archive_host_memory={"ranges": [[0x4F0000000000, 4096]], "words": 2})  # fmt: skip
    if mode == "save":
        res.update(capture_ms=50.0)
    else:
        res.update(load_s=0.5, restored={"nodes": 12, "rebuild_ms": 1.0, "instantiate_ms": 2.0},
                   inputs_at_setup_tensors=True)  # fmt: skip
    return res


def passing(proof: Any) -> dict[str, Any]:
    target = "/tmp/gp-deep-ep"
    msg = f"LOAD refused: model.deepep_num_nvl_bytes: saved '{proof.NVL_BYTES}', live '{proof.OTHER_NVL_BYTES}'"
    return {
        "versions": {"python": "3.12"},
        "install": {"wheel": "deep_ep-1.2.1.post20251110+gp.1-cp312-cp312-manylinux_2_28_x86_64.whl", "pip_rc": 0,
                    "target": target, "smoke_rc": 0,
                    "smoke": f"1.2.1.post20251110+gp.1 {target}/deep_ep/__init__.py {target}/deep_ep_cpp.so True True"},
        "groups": {m: {"wall_s": 10.0, "ranks": [rank(proof, r, m) for r in range(2)]} for m in ("baseline", "save",
                                                                                                 "load")}
        | {"refuse_nvl": {"wall_s": 8.0, "ranks": [{"rank": r, "refused": {"message": msg}, "captures": 0}
                                                   for r in range(2)]}},
    }  # fmt: skip


def failed(proof: Any, res: dict[str, Any]) -> list[str]:
    return proof.render(res, datetime.now(UTC))[1]


def test_a_complete_run_passes_every_check(proof: Any) -> None:
    text, bad = proof.render(passing(proof), datetime.now(UTC))
    assert bad == []
    assert text.splitlines()[0] == "all checks passed"
    assert text.count("| PASS |") >= 18


@pytest.mark.parametrize(
    ("edit", "check"),
    [
        (lambda r: r["groups"]["load"]["ranks"][1]["outputs"]["seed2"].update(combined="other"),
         "LOAD: replay outputs bit-identical"),
        (lambda r: r["groups"]["load"]["ranks"][0].update(nvl_buffer_ptr=1), "LOAD: NVL buffer address identical"),
        (lambda r: r["groups"]["load"]["ranks"][0].update(host_allocs=[["0x1", 4096, 8]]),
         "LOAD: pinned host counter addresses identical"),
        (lambda r: r["groups"]["load"]["ranks"][1].update(captures=1), "LOAD: zero captures"),
        (lambda r: r["groups"]["save"]["ranks"][0].update(ipc_handle_magic="0x0"), "SAVE: IPC handles are"),
        (lambda r: r["groups"]["save"]["ranks"][0].update(host_outside=["host_outside of 8 bytes"]),
         "SAVE: DeepEP's pinned host counters placed"),
        (lambda r: r["groups"]["save"]["ranks"][0].update(archive_host_memory={"ranges": [], "words": 0}),
         "SAVE: the graph reads pinned host memory"),
        (lambda r: r["groups"]["baseline"]["ranks"][0]["outputs"]["seed1"].update(recv_x="y"),
         "SAVE's replay bit-identical to the baseline's"),
        (lambda r: r["groups"]["refuse_nvl"]["ranks"][1]["refused"].update(message="LOAD refused: region base"),
         "LOAD with num_nvl_bytes"),
        (lambda r: r["groups"]["refuse_nvl"]["ranks"][0].update(outputs={}), "LOAD with num_nvl_bytes"),
        (lambda r: r["groups"]["load"]["ranks"][0].update(error="RuntimeError: boom"), "load group ran"),
        (lambda r: r["install"].update(smoke="1.2.1.post20251110 /usr/lib/deep_ep/__init__.py x True True"),
         "`import deep_ep` takes our build"),
        (lambda r: r.update(groups={}), "save group ran"),
    ],
)  # fmt: skip
def test_each_check_fails_without_its_evidence(proof: Any, edit: Any, check: str) -> None:
    res = copy.deepcopy(passing(proof))
    edit(res)
    bad = failed(proof, res)
    assert any(c.startswith(check) for c in bad), bad


def test_the_wheel_for_this_python_is_found_and_a_missing_one_says_what_to_run(proof: Any, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="make build OFFLINE=1"):
        proof.find_wheel(tmp_path, "cp312")
    whl = tmp_path / "deep_ep-1.2.1.post20251110+gp.1-cp312-cp312-manylinux_2_28_x86_64.whl"
    whl.write_bytes(b"")
    (tmp_path / "deep_ep-1.2.1.post20251110+gp.1-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    assert proof.find_wheel(tmp_path, "cp312") == whl


def test_the_install_folder_must_lie_outside_the_repository() -> None:
    p = subprocess.run([sys.executable, str(PROOF), "prove", "--deep-ep-dir", str(REPO / "x")], capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert p.returncode == 2 and "outside" in p.stderr
