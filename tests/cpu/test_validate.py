"""Every kind of drift between SAVE and LOAD refuses the LOAD, naming the field, the saved and the live value."""

from __future__ import annotations

from pathlib import Path

import pytest
from archive_fixtures import REGION_BASE, live_for, world, write_archive

from graphpersist.archive import Archive, open_archive
from graphpersist.liveenv import PINNED_ENV, collect_live, merge, pinned_env, world_facts
from graphpersist.manifest import World
from graphpersist.validate import (
    ADVICE,
    MISSING,
    LoadRefused,
    Mismatch,
    check,
    check_or_refuse,
    compare,
    evaluate,
    flatten,
)


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Archive:
    return open_archive(write_archive(tmp_path_factory.mktemp("v") / "archive"))


def refusal(archive: Archive, live: dict, rank: int = 0) -> list[str]:
    with pytest.raises(LoadRefused) as info:
        check_or_refuse(archive, live, rank)
    return str(info.value).splitlines()


def test_matching_live_facts_load(archive):
    check_or_refuse(archive, live_for(0), 0)
    check_or_refuse(archive, live_for(1), 1)


# One case per drift class: (field, live value, the exact line users read).
DRIFT = [
    ("format_version", 2, "format_version: saved 1, live 2"),
    ("engine.name", "sglang", "engine.name: saved 'vllm', live 'sglang'"),
    ("engine.version", "0.27.0+gp.1", "engine.version: saved '0.26.0+gp.1', live '0.27.0+gp.1'"),
    (
        "engine.commit",
        "f" * 40,
        f"engine.commit: saved '0123456789abcdef0123456789abcdef01234567', live '{'f' * 40}'",
    ),
    ("distribution.version", "2", "distribution.version: saved '1', live '2'"),
    ("torch.version", "2.10.0+cu128", "torch.version: saved '2.9.0+cu128', live '2.10.0+cu128'"),
    ("cuda.runtime", "12.9", "cuda.runtime: saved '12.8', live '12.9'"),
    ("cuda.driver", "575.51.03", "cuda.driver: saved '570.133.20', live '575.51.03'"),
    ("cuda.driver_api", "12.9", "cuda.driver_api: saved '12.8', live '12.9'"),
    ("nccl.version", "2.26.2", "nccl.version: saved '2.27.3', live '2.26.2'"),
    ("gpu.model", "NVIDIA A100-SXM4-80GB", "gpu.model: saved 'NVIDIA H200', live 'NVIDIA A100-SXM4-80GB'"),
    ("gpu.compute_capability", "8.0", "gpu.compute_capability: saved '9.0', live '8.0'"),
    ("parallel.world_size", 4, "parallel.world_size: saved 2, live 4"),
    ("parallel.tp_size", 4, "parallel.tp_size: saved 2, live 4"),
    ("parallel.pp_size", 2, "parallel.pp_size: saved 1, live 2"),
    ("parallel.ep_size", 2, "parallel.ep_size: saved 1, live 2"),
    ("parallel.rank", 1, "parallel.rank: saved 0, live 1"),
    ("model.dtype", "float16", "model.dtype: saved 'bfloat16', live 'float16'"),
    (
        "model.config_fingerprint",
        "sha256:00",
        f"model.config_fingerprint: saved 'sha256:{'ab' * 32}', live 'sha256:00'",
    ),
    ("capture.sizes", [1, 2, 4], "capture.sizes: saved [1, 2, 4, 8], live [1, 2, 4]"),
    ("capture.modes", ["piecewise"], "capture.modes: saved ['full'], live ['piecewise']"),
    ("env.NCCL_NVLS_ENABLE", None, "env.NCCL_NVLS_ENABLE: saved '0', live <unset>"),
    ("env.NCCL_ALGO", "Ring", "env.NCCL_ALGO: saved <unset>, live 'Ring'"),
    ("env.CUDA_VISIBLE_DEVICES", "1,0", "env.CUDA_VISIBLE_DEVICES: saved <unset>, live '1,0'"),
    ("flags.enforce_eager", True, "flags.enforce_eager: saved false, live true"),
    ("region.base", REGION_BASE + 0x1000, f"region.base: saved {REGION_BASE:#x}, live {REGION_BASE + 0x1000:#x}"),
    ("region.size", 32 << 30, f"region.size: saved {64 << 30:#x}, live {32 << 30:#x}"),
]


@pytest.mark.parametrize(("field", "live_value", "line"), DRIFT, ids=[case[0] for case in DRIFT])
def test_each_drift_class_is_refused_with_its_field_values_and_advice(archive, field, live_value, line):
    lines = refusal(archive, live_for(0, **{field: live_value}))
    assert lines == [f"graphpersist: cannot LOAD {archive.root}: 1 mismatch", f"  {line}", ADVICE]


def test_drift_classes_cover_every_saved_fact(archive):
    """A new manifest field without a drift case here would be compared but never proven to be."""
    from graphpersist.validate import saved_facts

    covered = {field for field, _, _ in DRIFT}
    uncovered = {f for f in saved_facts(archive, 0) if f not in covered and not f.startswith(("env.", "flags."))}
    assert uncovered == set()


def test_all_mismatches_are_listed_not_just_the_first(archive):
    live = live_for(0, **{"parallel.tp_size": 4, "model.dtype": "float16", "env.NCCL_NVLS_ENABLE": "1"})
    lines = refusal(archive, live)
    assert lines[0] == f"graphpersist: cannot LOAD {archive.root}: 3 mismatches"
    assert lines[1:-1] == [
        "  parallel.tp_size: saved 2, live 4",
        "  model.dtype: saved 'bfloat16', live 'float16'",
        "  env.NCCL_NVLS_ENABLE: saved '0', live '1'",
    ]
    assert lines[-1] == "Re-run with mode=save for this configuration."


def test_a_fact_the_engine_did_not_supply_refuses_instead_of_passing(archive):
    live = live_for(0)
    del live["model"]["config_fingerprint"]
    assert refusal(archive, live)[1] == f"  model.config_fingerprint: saved 'sha256:{'ab' * 32}', live <missing>"


def test_a_live_pin_the_archive_does_not_know_is_drift(archive):
    live = live_for(0, **{"env.NCCL_NEW_KNOB": "1", "flags.new_flag": 3})
    assert refusal(archive, live)[1:3] == [
        "  env.NCCL_NEW_KNOB: saved <missing>, live '1'",
        "  flags.new_flag: saved <missing>, live 3",
    ]


def test_live_facts_that_are_not_compared_are_ignored(archive):
    check_or_refuse(archive, live_for(0, **{"python.version": "3.13.0", "region.final_offset": 5}), 0)


def test_a_rank_the_archive_lacks_is_refused(archive):
    mismatches = check(archive, live_for(2, **{"parallel.rank": 2}), 2)
    assert mismatches == [Mismatch("parallel.rank", [0, 1], 2)]


def test_types_matter_a_string_is_not_a_number():
    assert compare({"parallel": {"tp_size": 2}}, {"parallel.tp_size": "2"}) == [Mismatch("parallel.tp_size", 2, "2")]
    assert compare({"a": True}, {"a": 1}) == [Mismatch("a", True, 1)]
    assert compare({"sizes": (1, 2)}, {"sizes": [1, 2]}) == []


def test_compare_flattens_and_reports_missing_on_either_side():
    saved = {"engine": {"name": "vllm", "commit": "a"}, "only_saved": 1}
    live = {"engine.name": "vllm", "engine": {"commit": "b"}, "only_live": 2}
    assert compare(saved, live) == [
        Mismatch("engine.commit", "a", "b"),
        Mismatch("only_saved", 1, MISSING),
        Mismatch("only_live", MISSING, 2),
    ]
    assert compare(saved, live, fields=["engine.name"]) == []
    assert compare(saved, live, fields=["nowhere"]) == [Mismatch("nowhere", MISSING, MISSING)]


def test_flatten_uses_dotted_names():
    assert flatten({"a": {"b": {"c": 1}, "d": None}, "e": [1]}) == {"a.b.c": 1, "a.d": None, "e": [1]}


def test_load_refused_carries_its_mismatches(tmp_path: Path):
    error = LoadRefused(tmp_path, [Mismatch("x", 1, 2)])
    assert error.mismatches == [Mismatch("x", 1, 2)] and error.archive_dir == tmp_path
    assert isinstance(error, RuntimeError)


# --- the live side


def test_collect_live_without_torch_or_gpu_knows_the_host_side_and_merges_engine_facts(monkeypatch):
    for name in PINNED_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    live = collect_live(engine={"name": "vllm"}, parallel={"tp_size": 2}, **{"parallel.rank": 1})
    assert live["format_version"] == 1
    assert live["engine"] == {"name": "vllm"}
    assert live["parallel"] == {"tp_size": 2, "rank": 1}
    assert live["env"]["NCCL_NVLS_ENABLE"] == "0"
    assert live["env"]["NCCL_ALGO"] is None
    assert set(live["env"]) == set(PINNED_ENV)
    for key in ("torch", "cuda", "nccl", "gpu"):  # absent facts are left out, never None
        assert all(v is not None for v in flatten(live.get(key, {})).values())


def test_pinned_env_reads_the_given_environment():
    assert pinned_env({"NCCL_ALGO": "Ring", "UNRELATED": "x"})["NCCL_ALGO"] == "Ring"
    assert "UNRELATED" not in pinned_env({"UNRELATED": "x"})


def test_merge_is_key_by_key():
    facts = {"engine": {"name": "vllm", "version": "1"}}
    merge(facts, {"engine": {"version": "2"}, "model.dtype": "bf16"})
    assert facts == {"engine": {"name": "vllm", "version": "2"}, "model": {"dtype": "bf16"}}


def test_world_facts_keeps_what_the_manifest_records_and_drops_the_rest():
    live = live_for(0, **{"python.version": "3.12.0"})
    projected = world_facts(live)
    assert "python" not in projected and "format_version" not in projected and "region" not in projected
    assert "rank" not in projected["parallel"]
    assert World.from_dict(projected) == World.from_dict(world())


def test_evaluate_can_skip_what_the_live_side_cannot_know(archive):
    """`graphpersist check` mode: unknown facts are listed as not checked; LOAD mode refuses them."""
    live = {"format_version": 1, "env": {"NCCL_NVLS_ENABLE": "0", "NCCL_CUMEM_ENABLE": "1"}}
    skipped = evaluate(archive, live, 0, skip_unknown=True)
    assert skipped.ok
    assert "engine.name" in skipped.not_checked and "engine.name" not in skipped.checked
    assert {"format_version", "env.NCCL_NVLS_ENABLE", "parallel.rank"} <= set(skipped.checked)
    strict = evaluate(archive, live, 0)
    assert not strict.ok and strict.not_checked == []
    assert Mismatch("engine.name", "vllm", MISSING) in strict.mismatches
