"""Every kind of drift between SAVE and LOAD refuses the LOAD, naming the field, the saved and the live value."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from archive_fixtures import (
    GPU_UUIDS,
    PCI_BUS_IDS,
    REGION_BASE,
    device,
    fake_nvidia_smi,
    live_for,
    world,
    write_archive,
)

from graphpersist.archive import Archive, codec, liveenv, open_archive
from graphpersist.archive.liveenv import (
    NCCL_ENV_PINS,
    PINNED_ENV,
    collect_live,
    device_facts,
    merge,
    normal_pci_bus_id,
    normal_uuid,
    pinned_env,
    uuid_from_bytes,
    world_facts,
)
from graphpersist.archive.manifest import FORMAT_VERSION, World
from graphpersist.archive.validate import (
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
from graphpersist.archive.world import (
    RankInfo,
    WorldError,
    current_rank,
    parallel_facts,
    rank_device_facts,
    rank_from_env,
    visible_device_count,
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
    ("format_version", FORMAT_VERSION + 1, f"format_version: saved {FORMAT_VERSION}, live {FORMAT_VERSION + 1}"),
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
    ("device.index", 1, "device.index: saved 0, live 1"),
    ("device.pci_bus_id", "0000:3a:00.0", "device.pci_bus_id: saved '0000:19:00.0', live '0000:3a:00.0'"),
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
    assert lines == [f"graphpersist: cannot LOAD {archive.root} (rank 0): 1 mismatch", f"  {line}", ADVICE]


def test_drift_classes_cover_every_saved_fact(archive):
    """A new manifest field without a drift case here would be compared but never proven to be."""
    from graphpersist.archive.validate import saved_facts

    covered = {field for field, _, _ in DRIFT}
    uncovered = {f for f in saved_facts(archive, 0) if f not in covered and not f.startswith(("env.", "flags."))}
    assert uncovered == set()


def test_all_mismatches_are_listed_not_just_the_first(archive):
    live = live_for(0, **{"parallel.tp_size": 4, "model.dtype": "float16", "env.NCCL_NVLS_ENABLE": "1"})
    lines = refusal(archive, live)
    assert lines[0] == f"graphpersist: cannot LOAD {archive.root} (rank 0): 3 mismatches"
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


def test_a_changed_setting_is_named_before_the_digests_it_changed(archive):
    """A setting that is a flag and part of the model configuration's fingerprint (vLLM's --max-model-len): the
    refusal names the flag first (what the user changed), then the fingerprint; the mismatches keep the facts' order."""
    live = live_for(0, **{"model.config_fingerprint": "sha256:" + "cd" * 32, "flags.enforce_eager": True})
    with pytest.raises(LoadRefused) as refused:
        check_or_refuse(archive, live, 0)
    lines = str(refused.value).splitlines()
    assert lines[1:3] == [
        "  flags.enforce_eager: saved false, live true",
        f"  model.config_fingerprint: saved 'sha256:{'ab' * 32}', live 'sha256:{'cd' * 32}'",
    ]
    assert [m.field for m in refused.value.mismatches] == ["model.config_fingerprint", "flags.enforce_eager"]


def test_many_fields_known_on_one_side_are_named_together_one_line_per_side(archive):
    """An archive of an earlier build misses what this build records (SGLang records every server argument): each
    field is still named, the live-only ones on one line, not one line each; the count stays the mismatches'."""
    from graphpersist.archive.validate import ONE_SIDED_LISTED

    added = {f"flags.arg_{i}": i for i in range(ONE_SIDED_LISTED)}
    lines = refusal(archive, live_for(0, **{"parallel.tp_size": 4, **added}))
    assert lines[0] == f"graphpersist: cannot LOAD {archive.root} (rank 0): {ONE_SIDED_LISTED + 1} mismatches"
    assert lines[1] == "  parallel.tp_size: saved 2, live 4"
    names = ", ".join(added)
    assert (
        lines[2] == f"  {ONE_SIDED_LISTED} fields live, not in the archive (saved <missing>); an archive of "
        f"another build? {names}"
    )
    assert len(lines) == 4


def test_a_few_fields_known_on_one_side_keep_their_own_lines(archive):
    from graphpersist.archive.validate import ONE_SIDED_LISTED

    added = {f"flags.arg_{i}": i for i in range(ONE_SIDED_LISTED - 1)}
    lines = refusal(archive, live_for(0, **added))
    assert lines[1:-1] == [f"  {name}: saved <missing>, live {value}" for name, value in added.items()]


def test_live_facts_that_are_not_compared_are_ignored(archive):
    check_or_refuse(archive, live_for(0, **{"python.version": "3.13.0", "region.final_offset": 5}), 0)


def test_a_rank_the_archive_lacks_is_refused(archive):
    mismatches = check(archive, live_for(2, **{"parallel.rank": 2, "device": device(0)}), 2)
    assert mismatches == [Mismatch("parallel.rank", [0, 1], 2)]


# --- tensor parallelism: the layout and each rank's GPU


def test_tp2_archive_at_tp4_is_refused_on_every_rank_naming_world_and_tp(archive):
    live = {"parallel.world_size": 4, "parallel.tp_size": 4}
    for rank in (0, 1):
        lines = refusal(archive, live_for(rank, **live), rank)
        assert lines[:3] == [
            f"graphpersist: cannot LOAD {archive.root} (rank {rank}): 2 mismatches",
            "  parallel.world_size: saved 2, live 4",
            "  parallel.tp_size: saved 2, live 4",
        ]
    # ranks 2 and 3 of the larger world do not exist in the archive at all
    extra = check(archive, live_for(3, **live, **{"parallel.rank": 3}), 3)
    assert Mismatch("parallel.rank", [0, 1], 3) in extra


def test_tp2_archive_loaded_by_a_single_gpu_process_is_refused(archive):
    live = live_for(0, **{"parallel.world_size": 1, "parallel.tp_size": 1})
    assert refusal(archive, live)[1:3] == [
        "  parallel.world_size: saved 2, live 1",
        "  parallel.tp_size: saved 2, live 1",
    ]


def test_same_tp_size_in_another_layout_is_refused(archive):
    """TP=2 x PP=1 saved, TP=1 x PP=2 live: same world size, different graphs."""
    live = live_for(0, **{"parallel.tp_size": 1, "parallel.pp_size": 2})
    assert refusal(archive, live)[1:3] == ["  parallel.tp_size: saved 2, live 1", "  parallel.pp_size: saved 1, live 2"]


def test_another_node_of_the_same_kind_loads(archive):
    """A fresh node of an autoscaled fleet: other GPUs (other UUIDs) of the same model in the same slots. The UUID is
    recorded, not compared, so the archive loads there; the slot (PCI bus id) still pins each rank."""
    for rank in (0, 1):
        other_card = f"GPU-{rank}9999999-aaaa-bbbb-cccc-dddddddddddd"
        check_or_refuse(archive, live_for(rank, **{"device.uuid": other_card}), rank)


def test_ranks_that_swapped_gpus_are_refused_naming_both_gpus(archive):
    """Rank 0 saved on the GPU at 0000:19:00.0 and rank 1 on 0000:3a:00.0; at LOAD they are the other way round
    (e.g. CUDA_VISIBLE_DEVICES reordered): each rank refuses, naming its saved and its live GPU."""
    for rank, other in ((0, 1), (1, 0)):
        live = live_for(rank, **{"device.uuid": GPU_UUIDS[other], "device.pci_bus_id": PCI_BUS_IDS[other]})
        assert refusal(archive, live, rank) == [
            f"graphpersist: cannot LOAD {archive.root} (rank {rank}): 1 mismatch",
            f"  device.pci_bus_id: saved '{PCI_BUS_IDS[rank]}', live '{PCI_BUS_IDS[other]}'",
            ADVICE,
        ]


def test_a_rank_on_the_same_gpu_under_another_index_is_refused(archive):
    """Same physical GPU, but the process numbers it differently (e.g. CUDA_VISIBLE_DEVICES=1 gives it index 0)."""
    assert refusal(archive, live_for(1, **{"device.index": 0}), 1)[1] == "  device.index: saved 1, live 0"


def test_a_rank_whose_gpu_could_not_be_learned_live_is_refused(archive):
    live = live_for(0)
    del live["device"]["uuid"], live["device"]["pci_bus_id"]
    assert refusal(archive, live)[1:2] == ["  device.pci_bus_id: saved '0000:19:00.0', live <missing>"]


@pytest.mark.parametrize("name", NCCL_ENV_PINS)
def test_every_nccl_setting_that_differs_at_load_is_refused(archive, name):
    saved = world()["env"][name]
    assert refusal(archive, live_for(0, **{f"env.{name}": "7"})) == [
        f"graphpersist: cannot LOAD {archive.root} (rank 0): 1 mismatch",
        f"  env.{name}: saved {'<unset>' if saved is None else repr(saved)}, live '7'",
        ADVICE,
    ]


@pytest.mark.parametrize(
    ("name", "saved", "live"),
    [
        ("NCCL_NVLS_ENABLE", "0", "1"),
        ("NCCL_CUMEM_ENABLE", "1", None),
        ("NCCL_BUFFSIZE", "8388608", "4194304"),
        ("NCCL_PROTO", "Simple", "LL128"),
        ("NCCL_RUNTIME_CONNECT", "0", "1"),
        ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1", None),
        ("GRAPHPERSIST_SYMM_MEM_NO_MULTICAST", "1", None),
        ("TORCH_SYMMMEM", "CUDA", "NVSHMEM"),
        ("NVSHMEM_DISABLE_NVLS", "1", "0"),
        ("CUDA_VISIBLE_DEVICES", "0,1", "1,0"),
        ("CUDA_DEVICE_ORDER", "PCI_BUS_ID", None),
    ],
)
def test_tp_pins_changed_between_save_and_load_are_refused(tmp_path, name, saved, live):
    pins = {f"env.{k}": v for k, v in world()["env"].items()} | {f"env.{name}": saved}
    archive = open_archive(write_archive(tmp_path / "a", **pins))
    rendered = "<unset>" if live is None else repr(live)
    assert refusal(archive, live_for(0, **pins | {f"env.{name}": live}))[1] == (
        f"  env.{name}: saved {saved!r}, live {rendered}"
    )


def test_the_pinned_environment_covers_tp_settings_and_has_no_duplicates():
    assert len(set(PINNED_ENV)) == len(PINNED_ENV)
    for name in ("NCCL_BUFFSIZE", "NCCL_MAX_NCHANNELS", "NCCL_ALGO", "NCCL_P2P_DISABLE", "NCCL_RUNTIME_CONNECT",
                 "TORCH_SYMMMEM", "CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF"):  # fmt: skip
        assert name in PINNED_ENV
    assert "GRAPHPERSIST_MODE" not in PINNED_ENV and "NCCL_DEBUG" not in PINNED_ENV


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
    assert live["format_version"] == FORMAT_VERSION
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
    assert codec.from_dict(World, projected) == codec.from_dict(World, world())


def test_evaluate_can_skip_what_the_live_side_cannot_know(archive):
    """`graphpersist check` mode: unknown facts are listed as not checked; LOAD mode refuses them."""
    live = {"format_version": FORMAT_VERSION, "env": {"NCCL_NVLS_ENABLE": "0", "NCCL_CUMEM_ENABLE": "1"}}
    skipped = evaluate(archive, live, 0, skip_unknown=True)
    assert skipped.ok
    assert "engine.name" in skipped.not_checked and "engine.name" not in skipped.checked
    assert {"format_version", "env.NCCL_NVLS_ENABLE", "parallel.rank"} <= set(skipped.checked)
    assert {"device.index", "device.pci_bus_id"} <= set(skipped.not_checked)
    assert "device.uuid" not in skipped.checked + skipped.not_checked, "recorded, never compared"
    strict = evaluate(archive, live, 0)
    assert not strict.ok and strict.not_checked == []
    assert Mismatch("engine.name", "vllm", MISSING) in strict.mismatches


# --- which GPU a rank is on, learned live


@pytest.fixture
def smi_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake nvidia-smi listing the fixture's two GPUs, first on PATH."""
    folder = tmp_path / "bin"
    folder.mkdir()
    fake_nvidia_smi(folder)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ.get('PATH', '')}")
    return folder


@pytest.fixture
def no_smi(monkeypatch: pytest.MonkeyPatch) -> None:
    """No nvidia-smi, whatever this host has."""
    monkeypatch.setattr(liveenv, "_smi_gpus", lambda: [])


def fake_torch(current: int = 0, *, uuid: str = "11111111-2222-3333-4444-555555555555", bus: int = 0x19) -> Any:
    """What graphpersist reads of a torch that initialised CUDA: device properties with UUID and PCI ids."""
    props = SimpleNamespace(uuid=uuid, pci_domain_id=0, pci_bus_id=bus, pci_device_id=0)
    cuda = SimpleNamespace(
        is_initialized=lambda: True,
        current_device=lambda: current,
        device_count=lambda: 2,
        get_device_properties=lambda device: props,
        get_device_capability=lambda device: (9, 0),
        get_device_name=lambda device: "NVIDIA H200",
    )
    return SimpleNamespace(__version__="2.11.0+cu130", cuda=cuda)


def test_gpu_ids_are_normalised_to_one_spelling():
    assert normal_pci_bus_id("00000000:3A:00.0") == "0000:3a:00.0"  # nvidia-smi
    assert normal_pci_bus_id("0000:3A:00.0") == "0000:3a:00.0"  # cudaDeviceGetPCIBusId
    assert normal_pci_bus_id("0:19:0.0") == "0000:19:00.0"  # from torch's integer ids
    assert normal_pci_bus_id("not a bus id") is None
    assert normal_uuid("11111111-2222-3333-4444-55555555555A") == "GPU-11111111-2222-3333-4444-55555555555a"
    assert normal_uuid("GPU-11111111-2222-3333-4444-555555555555") == GPU_UUIDS[0]
    assert normal_uuid("<_CUuuid object>") is None


def test_nvidia_smi_is_mapped_through_cuda_visible_devices_uuids(smi_path):
    """CUDA_VISIBLE_DEVICES names GPUs by UUID in swapped order: device 0 is the GPU at 0000:3a:00.0."""
    env = {"CUDA_VISIBLE_DEVICES": f"{GPU_UUIDS[1]},{GPU_UUIDS[0]}"}
    assert device_facts(0, environ=env) == {"index": 0, "uuid": GPU_UUIDS[1], "pci_bus_id": PCI_BUS_IDS[1]}
    assert device_facts(1, environ=env) == {"index": 1, "uuid": GPU_UUIDS[0], "pci_bus_id": PCI_BUS_IDS[0]}


def test_nvidia_smi_indices_count_only_in_pci_order(smi_path):
    pci = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1"}
    assert device_facts(0, environ=pci) == {"index": 0, "uuid": GPU_UUIDS[1], "pci_bus_id": PCI_BUS_IDS[1]}
    # CUDA's default order numbers the fastest GPU first: nvidia-smi's index says nothing, so nothing is claimed
    assert device_facts(0, environ={"CUDA_VISIBLE_DEVICES": "1"}) == {"index": 0}
    assert device_facts(0, environ={}) == {"index": 0}


def test_torch_answers_for_the_rank_process_and_collect_live_uses_its_current_device(monkeypatch, no_smi):
    monkeypatch.setitem(sys.modules, "torch", fake_torch(current=1, bus=0x3A))
    live = collect_live(environ={})
    assert live["device"] == {
        "index": 1,
        "uuid": "GPU-11111111-2222-3333-4444-555555555555",
        "pci_bus_id": "0000:3a:00.0",
    }
    assert collect_live(device=0, environ={})["device"]["index"] == 0


def test_a_torch_without_pci_ids_is_completed_from_nvidia_smi_by_uuid(monkeypatch, smi_path):
    """Older torch reports only the UUID; the UUID finds the GPU in nvidia-smi's list whatever the numbering."""
    torch = fake_torch(current=0, uuid=GPU_UUIDS[1].removeprefix("GPU-"))
    del torch.cuda.get_device_properties(0).pci_bus_id
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr(liveenv, "_driver_device_ids", lambda device: {})
    assert device_facts(0, environ={}) == {"index": 0, "uuid": GPU_UUIDS[1], "pci_bus_id": PCI_BUS_IDS[1]}


def test_driver_uuid_bytes_are_spelled_like_nvidia_smi():
    assert uuid_from_bytes(bytes(range(16))) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"


def test_collect_live_without_a_device_or_cuda_collects_no_device_facts(monkeypatch, no_smi):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert "device" not in collect_live(environ={})
    assert collect_live(device=3, environ={})["device"] == {"index": 3}  # the index asked for; the GPU unknown


def test_rank_device_facts_names_the_gpu_or_refuses(monkeypatch, smi_path):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{GPU_UUIDS[1]},{GPU_UUIDS[0]}")
    assert rank_device_facts(0) == {"index": 0, "uuid": GPU_UUIDS[1], "pci_bus_id": PCI_BUS_IDS[1]}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # plain indices in CUDA's default order: ambiguous
    with pytest.raises(WorldError, match=r"cannot learn the uuid and pci_bus_id of CUDA device 0: initialise CUDA"):
        rank_device_facts(0)
    with pytest.raises(WorldError, match="non-negative CUDA device index"):
        rank_device_facts(-1)


# --- rank and world bookkeeping


def test_no_launcher_variables_mean_a_single_process():
    assert rank_from_env({}, visible_devices=1) == RankInfo(0, 1, 0, 0, "single process")


def test_launcher_variables_give_rank_world_and_device():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert rank_from_env(env, visible_devices=2) == RankInfo(1, 2, 1, 1, "RANK/WORLD_SIZE")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "1"}, "RANK is set ('1') but WORLD_SIZE is not: set both or neither"),
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set ('2') but RANK is not: set both or neither"),
        ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK 2 is outside WORLD_SIZE 2 (ranks are 0..1)"),
        ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK must be an integer, got 'one'"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK must not be negative, got -1"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE must be at least 1, got 0"),
        ({"RANK": "1", "WORLD_SIZE": "2"}, "LOCAL_RANK is not set: cannot tell which GPU rank 1 of 2 uses"),
        ({"LOCAL_RANK": "1"}, "LOCAL_RANK is 1 but RANK and WORLD_SIZE are not set"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, "LOCAL_RANK 1 is larger than RANK 0"),
        (
            {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "1"},
            "LOCAL_RANK 1 is outside LOCAL_WORLD_SIZE 1",
        ),
        (
            {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "3"},
            "LOCAL_WORLD_SIZE 3 must be between 1 and WORLD_SIZE 2",
        ),
    ],
)
def test_inconsistent_launcher_variables_are_refused(env, message):
    with pytest.raises(WorldError) as info:
        rank_from_env(env, visible_devices=8)
    assert str(info.value) == message


def test_a_local_rank_past_the_visible_devices_is_refused(no_smi):
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "0"}
    with pytest.raises(WorldError, match=r"device 1 does not exist: this process sees 1 CUDA device\(s\) "):
        rank_from_env(env)
    with pytest.raises(WorldError, match=r"device 1 does not exist: this process sees 1 CUDA device\(s\)$"):
        rank_from_env({k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"}, visible_devices=1)


def test_visible_devices_are_counted_as_cuda_reads_the_list(no_smi):
    assert visible_device_count({"CUDA_VISIBLE_DEVICES": "0,1,-1,2"}) == 2  # CUDA stops at the first invalid entry
    assert visible_device_count({"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert visible_device_count({}) is None  # cannot tell without nvidia-smi or CUDA


def test_visible_devices_are_capped_by_the_gpus_nvidia_smi_lists(smi_path):
    assert visible_device_count({}) == 2
    assert visible_device_count({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == 2


def fake_dist(rank: int, world_size: int) -> Any:
    return SimpleNamespace(
        is_available=lambda: True,
        is_initialized=lambda: True,
        get_rank=lambda: rank,
        get_world_size=lambda: world_size,
    )


def test_torch_distributed_is_preferred_and_must_agree_with_the_environment(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.distributed", fake_dist(1, 2))
    monkeypatch.setitem(sys.modules, "torch", fake_torch(current=1))
    info = current_rank({"LOCAL_RANK": "1"})
    assert info == RankInfo(1, 2, 1, 1, "torch.distributed")
    with pytest.raises(
        WorldError, match=r"^torch\.distributed says rank 1 of 2, the environment says RANK=0 WORLD_SIZE=2$"
    ):
        current_rank({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})


def test_parallel_facts_must_fill_the_world():
    info = RankInfo(1, 2, 1, 1, "test")
    assert parallel_facts(info, tp_size=2) == {"world_size": 2, "tp_size": 2, "pp_size": 1, "ep_size": 1, "rank": 1}
    with pytest.raises(WorldError, match=r"tp_size 2 x pp_size 2 = 4, world size 2"):
        parallel_facts(info, tp_size=2, pp_size=2)
    with pytest.raises(WorldError, match="ep_size 4 does not divide world size 2"):
        parallel_facts(info, tp_size=2, ep_size=4)
    with pytest.raises(WorldError, match="tp_size must be a positive integer"):
        parallel_facts(info, tp_size=0)


def test_importing_the_runtime_modules_needs_no_torch():
    code = (
        "import sys; import graphpersist.archive.world, graphpersist.archive.liveenv, graphpersist.archive.validate, "
        "graphpersist.cli, graphpersist.archive; print('torch' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "overlays" / "graphpersist")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
