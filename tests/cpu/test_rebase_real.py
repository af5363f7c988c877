"""The real rebase of each engine one release forward (vLLM 0.26.0 -> 0.27.0, SGLang 0.5.17 -> 0.5.18).

`gptools rebase` trusts the sha256 the package index publishes for a release that is not pinned yet; this test does
not: each target wheel is fetched through gpdist.fetch by the file name, size and sha256 pinned here, and handed
to the rebase as a local wheel. The rebase runs into a temporary folder against a copy of build/pins.toml with
pin updates off, so neither the repository's pins nor its patches change.

What is pinned below was observed and checked against the upstream diffs:
- vLLM 0.27.0 adds `kda_prefill_backend` right after `gdn_prefill_backend` (where the patch adds its two fields)
  and `--kda-prefill-backend` right after `--gdn-prefill-backend` (where the patch calls the overlay). Hunk #1
  fails; hunk #2 is placed by GNU patch with fuzz 2 after the new argument, but both sides insert at the same
  point, so the 3-way merge conflicts there: a conflict, not fuzz. No hooked function changed.
- SGLang 0.5.18 adds fields before `__post_init__` (hunk #1: fuzz 2, merged cleanly), moves the body of
  `__post_init__` into `_run_resolution_pipeline` with new handlers around the patch's call (hunk #2 fails and
  conflicts), and moves `add_cli_args` (hunk #3: offset). `BaseRunner._dummy_run` gained `extend_num_tokens_per_req`
  (`DecodeCudaGraphRunner.capture_one_shape` gained `dsa_variant`, but the glue no longer touches it).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpdist.fetch import fetch
from gpdist.pins import Artifact, Pins
from gptools.apply import CONFLICT
from gptools.rebase import NewWheel, rebase

pytestmark = [pytest.mark.network, pytest.mark.slow]

PATCH = "0001-add-graph-persistence-switch.patch"


@dataclass(frozen=True)
class Target:
    version: str
    wheel: Artifact
    conflict_file: str
    # (hunk index, status, line GNU patch names, offset, fuzz)
    hunks: list[tuple[int, str, int, int, int]]
    hook_findings: list[str]
    # what the report says about each hunk GNU patch places but the 3-way merge conflicts on
    conflict_messages: dict[int, str]
    # the later patches of the series: name -> (status, [(file, hunk index, status, line, offset, fuzz)])
    later: dict[str, tuple[str, list[tuple[str, int, str, int, int, int]]]]
    first_line: str
    # the later patches whose 3-way merge also conflicts: name -> files (the report lists them after the first)
    later_conflicts: dict[str, list[str]] = field(default_factory=dict)


TARGETS = {
    "vllm": Target(
        version="0.27.0",
        wheel=Artifact(
            project="vllm",
            filename="vllm-0.27.0-cp38-abi3-manylinux_2_28_x86_64.whl",
            sha256="02d8265e71bab1cf50f93026211c9a75562a7f0a72b3a32ec5e0e8bcdd62ec75",
            size=312887666,
        ),
        conflict_file="vllm/engine/arg_utils.py",
        hunks=[(1, "failed", 735, 0, 0), (2, CONFLICT, 1660, 46, 2)],
        hook_findings=[],
        conflict_messages={
            2: "GNU patch alone would apply it at line 1660 (offset +46 lines, fuzz 2), but the 3-way merge "
            "conflicts at lines 1656-1662"
        },
        later={
            "0002-let-graph-persistence-see-every-cuda-graph-vllm-capt.patch": (
                "fuzzy",
                [
                    ("vllm/compilation/cuda_graph.py", 1, "exact", 12, 0, 0),
                    ("vllm/compilation/cuda_graph.py", 2, "exact", 280, 0, 0),
                    ("vllm/compilation/cuda_graph.py", 3, "exact", 335, 0, 0),
                    ("vllm/v1/worker/gpu/cudagraph_utils.py", 1, "exact", 10, 0, 0),
                    ("vllm/v1/worker/gpu/cudagraph_utils.py", 2, "offset", 344, 1, 0),
                    ("vllm/v1/worker/gpu/cudagraph_utils.py", 3, "offset", 360, 5, 0),
                ],
            ),
            "0003-register-custom-all-reduce-graph-buffers-through-gra.patch": (
                "fuzzy",
                [
                    ("vllm/distributed/device_communicators/custom_all_reduce.py", 1, "exact", 9, 0, 0),
                    ("vllm/distributed/device_communicators/custom_all_reduce.py", 2, "offset", 325, 118, 0),
                ],
            ),
            "0004-let-graph-persistence-choose-the-start-method-of-vll.patch": (
                "clean",
                [("vllm/utils/system_utils.py", 1, "exact", 178, 0, 0)],
            ),
            "0005-tell-graph-persistence-when-vllm-s-cli-chose-spawn-f.patch": (
                "clean",
                [("vllm/entrypoints/serve/utils/api_utils.py", 1, "exact", 165, 0, 0)],
            ),
            "0006-raise-a-refused-graph-persistence-load-in-the-proces.patch": (
                "fuzzy",
                [("vllm/v1/engine/utils.py", 1, "offset", 1250, -19, 0)],
            ),
        },
        first_line=f"4 of 6 patches need work on vllm 0.27.0: {PATCH} (conflict), "
        "0002-let-graph-persistence-see-every-cuda-graph-vllm-capt.patch (fuzzy), "
        "0003-register-custom-all-reduce-graph-buffers-through-gra.patch (fuzzy), "
        "0006-raise-a-refused-graph-persistence-load-in-the-proces.patch (fuzzy)",
    ),
    "sglang": Target(
        version="0.5.18",
        wheel=Artifact(
            project="sglang",
            filename="sglang-0.5.18-cp312-cp312-manylinux_2_34_x86_64.whl",
            sha256="fba7bb31a5de4c014945cbc50e9357c9253cc965a423736c324b2aaccd2270dc",
            size=24019691,
        ),
        conflict_file="sglang/srt/server_args.py",
        hunks=[(1, "fuzz", 3582, 150, 2), (2, "failed", 3470, 0, 0), (3, "offset", 8924, 458, 0)],
        hook_findings=[  # capture_one_shape also gained dsa_variant; the glue touches it no more (not declared)
            "sglang.srt.model_executor.runner.base_runner:BaseRunner._dummy_run: parameters changed: expected (self, "
            "batch_size, run_ctx, forward_mode_override, *, buffers), found (self, batch_size, run_ctx, "
            "forward_mode_override, *, buffers, extend_num_tokens_per_req) at line 370",
        ],
        conflict_messages={},
        later={
            "0002-start-graph-persistence-before-distributed-init.patch": (
                "fuzzy",
                [
                    ("sglang/srt/model_executor/model_runner.py", 1, "offset", 1027, 41, 0),
                ],
            ),
            "0003-let-graph-persistence-size-the-memory-pool.patch": (
                "fuzzy",
                [
                    ("sglang/srt/mem_cache/kv_cache_configurator.py", 1, "offset", 281, 37, 0),
                    ("sglang/srt/mem_cache/kv_cache_configurator.py", 2, "offset", 1931, 154, 0),
                ],
            ),
            "0004-let-graph-persistence-capture-after-every-graph-runn.patch": (
                "conflict",
                [
                    ("sglang/srt/model_executor/model_runner_components/cuda_graph_setup.py", 1, "fuzz", 7, 0, 2),
                    ("sglang/srt/model_executor/model_runner_components/cuda_graph_setup.py", 2, "offset", 189, 35, 0),
                    ("sglang/srt/model_executor/runner/decode_cuda_graph_runner.py", 1, "fuzz", 42, 1, 1),
                    # the hunk that hands upstream's capture block to defer() (2026-12-07) applies with fuzz here
                    ("sglang/srt/model_executor/runner/decode_cuda_graph_runner.py", 2, "fuzz", 457, 46, 2),
                    ("sglang/srt/model_executor/runner/prefill_cuda_graph_runner.py", 1, "failed", 50, 0, 0),
                    ("sglang/srt/model_executor/runner/prefill_cuda_graph_runner.py", 2, "offset", 524, -5, 0),
                ],
            ),
            "0005-let-graph-persistence-see-every-cuda-graph-sglang-ca.patch": (
                "fuzzy",
                [
                    ("sglang/srt/model_executor/runner_backend/breakable_cuda_graph_backend.py", 1, "exact", 23, 0, 0),
                    ("sglang/srt/model_executor/runner_backend/breakable_cuda_graph_backend.py", 2, "exact", 141, 0, 0),
                    ("sglang/srt/model_executor/runner_backend/full_cuda_graph_backend.py", 1, "exact", 23, 0, 0),
                    ("sglang/srt/model_executor/runner_backend/full_cuda_graph_backend.py", 2, "offset", 112, 18, 0),
                    ("sglang/srt/model_executor/runner_backend/full_cuda_graph_backend.py", 3, "offset", 134, 21, 0),
                    (
                        "sglang/srt/model_executor/runner_backend_utils/breakable_cuda_graph/breakable_cuda_graph.py",
                        1,
                        "offset",
                        33,
                        -1,
                        0,
                    ),
                    (
                        "sglang/srt/model_executor/runner_backend_utils/breakable_cuda_graph/breakable_cuda_graph.py",
                        2,
                        "offset",
                        260,
                        -5,
                        0,
                    ),
                    (
                        "sglang/srt/model_executor/runner_backend_utils/breakable_cuda_graph/breakable_cuda_graph.py",
                        3,
                        "offset",
                        375,
                        -5,
                        0,
                    ),
                ],
            ),
            "0006-register-custom-all-reduce-graph-inputs-through-grap.patch": (
                "clean",
                [
                    ("sglang/srt/distributed/device_communicators/custom_all_reduce_v2.py", 1, "exact", 25, 0, 0),
                    ("sglang/srt/distributed/device_communicators/custom_all_reduce_v2.py", 2, "exact", 380, 0, 0),
                ],
            ),
            "0007-keep-torch-symmetric-memory-on-without-multicast-for.patch": (
                "clean",
                [
                    ("sglang/srt/distributed/device_communicators/torch_symm_mem.py", 1, "exact", 113, 0, 0),
                ],
            ),
            "0008-let-graph-persistence-save-once-sglang-holds-its-gr.patch": (
                "fuzzy",
                [("sglang/srt/model_executor/model_runner.py", 1, "offset", 990, 41, 0)],
            ),
            "0009-keep-cuda-graphs-on-for-deepep-normal-mode-under-gra.patch": (
                "fuzzy",
                [("sglang/srt/server_args.py", 1, "offset", 6921, 211, 0)],
            ),
            "0010-raise-a-refused-graph-persistence-load-in-the-proces.patch": (
                "fuzzy",
                [
                    ("sglang/srt/entrypoints/engine.py", 1, "offset", 1727, 77, 0),
                    ("sglang/srt/entrypoints/engine.py", 2, "offset", 1784, 105, 0),
                ],
            ),
        },
        first_line=f"8 of 10 patches need work on sglang 0.5.18: {PATCH} (conflict), "
        "0002-start-graph-persistence-before-distributed-init.patch (fuzzy), "
        "0003-let-graph-persistence-size-the-memory-pool.patch (fuzzy), "
        "0004-let-graph-persistence-capture-after-every-graph-runn.patch (conflict), "
        "0005-let-graph-persistence-see-every-cuda-graph-sglang-ca.patch (fuzzy), "
        "0008-let-graph-persistence-save-once-sglang-holds-its-gr.patch (fuzzy), "
        "0009-keep-cuda-graphs-on-for-deepep-normal-mode-under-gra.patch (fuzzy), "
        "0010-raise-a-refused-graph-persistence-load-in-the-proces.patch (fuzzy)",
        later_conflicts={
            "0004-let-graph-persistence-capture-after-every-graph-runn.patch": [
                "sglang/srt/model_executor/runner/prefill_cuda_graph_runner.py"
            ]
        },
    ),
}


def _series_state(patches_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(patches_dir.iterdir()) if p.is_file()}


@pytest.mark.parametrize("engine", sorted(TARGETS))
def test_rebase_one_release_forward(engine: str, pins: Pins, repo_root: Path, tmp_path: Path) -> None:
    target = TARGETS[engine]
    pin = pins.engine(engine)
    pins_copy = tmp_path / "pins.toml"
    shutil.copyfile(repo_root / "build" / "pins.toml", pins_copy)
    repo_pins_before = (repo_root / "build" / "pins.toml").read_bytes()
    series_before = _series_state(pin.patches_dir)

    path = fetch(target.wheel)  # by name, size and the sha256 pinned above; cached in the sha256-keyed cache
    wheel = NewWheel(target.wheel.filename, path, target.wheel.sha256, path.stat().st_size)
    report = rebase(
        engine, target.version, pins_path=pins_copy, work_root=tmp_path / "rebase", new_wheel=wheel, update=False
    )

    outcome, *later = report.patches
    assert (outcome.name, outcome.status) == (PATCH, CONFLICT)
    assert {
        o.name: (o.status, [(h.file, h.index, h.status, h.line, h.offset, h.fuzz) for h in o.hunks]) for o in later
    } == target.later
    assert {o.name: o.conflict_files for o in later if o.conflict_files} == target.later_conflicts
    assert [(h.index, h.status, h.line, h.offset, h.fuzz) for h in outcome.hunks] == target.hunks
    assert {h.index: h.message for h in outcome.hunks if h.status == CONFLICT} == target.conflict_messages
    assert {h.file for h in outcome.hunks} == {target.conflict_file}
    assert outcome.conflict_files == [target.conflict_file]
    assert report.stopped_at == PATCH and report.conflict_markers == [target.conflict_file]
    assert report.hook_findings == target.hook_findings
    assert not report.pins_updated and not report.repinnable

    tree = Path(report.worktree)
    marked = (tree / target.conflict_file).read_text()
    assert "<<<<<<< " in marked and ">>>>>>> " in marked
    md = (tmp_path / "rebase" / f"{engine}-{target.version}" / "report.md").read_text()
    assert md.splitlines()[0] == target.first_line
    assert f"make rebase ENGINE={engine} VERSION={target.version} FINISH=1" in md
    for h in outcome.hunks:
        assert f"- {h.describe()}" in md

    # Nothing in the repository moved: not the pins, not the series; the copy was not re-pinned either.
    assert (repo_root / "build" / "pins.toml").read_bytes() == repo_pins_before
    assert pins_copy.read_bytes() == repo_pins_before
    assert _series_state(pin.patches_dir) == series_before
