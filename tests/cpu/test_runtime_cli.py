"""The `graphpersist` command as users run it: a separate process, human output by default, JSON on request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from archive_fixtures import (
    GPU_UUIDS,
    PCI_BUS_IDS,
    device,
    fake_nvidia_smi,
    world,
    write_archive,
    write_loadable_archive,
)

from graphpersist import cli
from graphpersist.archive import open_archive
from graphpersist.archive.liveenv import PINNED_ENV, collect_live
from graphpersist.archive.manifest import FORMAT_VERSION
from graphpersist.archive.validate import LoadRefused, evaluate, flatten

REPO = Path(__file__).resolve().parents[2]
PINS = {"NCCL_NVLS_ENABLE": "0", "NCCL_CUMEM_ENABLE": "1"}
# What only the engine knows; the fixture archive holds exactly these values.
ENGINE_SETS = [
    "engine.name=vllm",
    "engine.version=0.26.0+gp.1",
    "engine.commit=0123456789abcdef0123456789abcdef01234567",
    "parallel.world_size=2",
    "parallel.tp_size=2",
    "parallel.pp_size=1",
    "parallel.ep_size=1",
    "model.dtype=bfloat16",
    "model.config_fingerprint=sha256:" + "ab" * 32,
    "capture.sizes=[1, 2, 4, 8]",
    'capture.modes=["full"]',
    "flags.enforce_eager=false",
    f"region.base={0x7E0000000000}",
    f"region.size={64 << 30}",
]


_FAKE_BIN: list[Path] = []


@pytest.fixture(scope="module", autouse=True)
def fake_gpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An nvidia-smi listing the fixture's two GPUs first on PATH, so GPU facts are the same on every host."""
    folder = tmp_path_factory.mktemp("bin")
    fake_nvidia_smi(folder)
    _FAKE_BIN[:] = [folder]
    return folder


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in PINNED_ENV}
    path = os.pathsep.join([*map(str, _FAKE_BIN), env.get("PATH", "")])
    own = {"PYTHONPATH": str(REPO / "overlays" / "graphpersist"), "PYTHONDONTWRITEBYTECODE": "1", "PATH": path}
    return env | PINS | own | extra


def host_facts(**env: str) -> dict[str, object]:
    """This host's facts as `graphpersist check` will see them in environment(**env) (GPUs from fake_gpus)."""
    os_env = environment(**env)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PATH", os_env["PATH"])
        host = flatten(collect_live(environ=os_env))
    return {k: v for k, v in host.items() if k.split(".")[0] in ("distribution", "torch", "cuda", "nccl", "gpu")}


def host_sets(**env: str) -> list[str]:
    """--set for the host facts this machine cannot report (CI: no torch, no CUDA driver), with the values the
    fixture archives hold: what a user of such a host gives `check` so that it compares instead of exiting 3."""
    measured = host_facts(**env)
    saved = flatten(world())
    return [f"--set={k}={v}" for k, v in saved.items() if k.startswith(cli.HOST_FACTS) and k not in measured]


def graphpersist(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "graphpersist", *args], env=environment(**env), capture_output=True, text=True, cwd=REPO
    )


@pytest.fixture(scope="module")
def host_archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An archive whose host facts are this machine's (whatever it has: torch, CUDA, neither)."""
    return write_loadable_archive(tmp_path_factory.mktemp("cli") / "archive", **host_facts())


# Rank 0 on the GPU at 0000:19:00.0, rank 1 on 0000:3a:00.0, with device numbers in PCI order (CUDA_DEVICE_ORDER),
# so that `check` can tell which GPU each device index is.
PCI_ORDER = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,1"}


@pytest.fixture(scope="module")
def tp2_archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pins = {f"env.{k}": v for k, v in PCI_ORDER.items()}
    return write_loadable_archive(tmp_path_factory.mktemp("cli") / "tp2", **host_facts(**PCI_ORDER), **pins)


def test_every_command_has_help_and_version():
    names = [command.name for command in cli.commands()]
    assert {"inspect", "check"} <= set(names)
    top = graphpersist("--help")
    assert top.returncode == 0 and all(name in top.stdout for name in names)
    version = graphpersist("--version")
    assert version.returncode == 0 and version.stdout.startswith("graphpersist ")
    assert f"(archive format {FORMAT_VERSION})" in version.stdout
    for name in names:
        helped = graphpersist(name, "--help")
        assert helped.returncode == 0 and f"usage: graphpersist {name}" in helped.stdout
        versioned = graphpersist(name, "--version")
        assert versioned.returncode == 0 and versioned.stdout == version.stdout


def test_no_command_and_unknown_options_are_misuse():
    assert graphpersist().returncode == 2
    bad = graphpersist("inspect", "somewhere", "--bogus")
    assert bad.returncode == 2 and "unrecognized arguments" in bad.stderr


def test_inspect_human(host_archive: Path):
    result = graphpersist("inspect", str(host_archive))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"archive     {host_archive}" in out
    assert "engine      vllm 0.26.0+gp.1" in out
    assert "parallel    world 2: tp 2, pp 1, ep 1" in out
    assert "capture     modes full; 4 sizes: 1 2 4 8" in out
    assert "NCCL_NVLS_ENABLE='0'" in out
    assert f"rank 0\n  gpu       device 0, PCI 0000:19:00.0, {GPU_UUIDS[0]}\n" in out
    assert f"rank 1\n  gpu       device 1, PCI 0000:3a:00.0, {GPU_UUIDS[1]}\n" in out
    assert "region    base 0x7e0000000000, size 64.0 GiB" in out
    assert "full-bs8      13        9       2" in out


def test_inspect_json_parses(host_archive: Path):
    result = graphpersist("inspect", "--json", str(host_archive))
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["manifest"]["format_version"] == FORMAT_VERSION
    assert data["ranks"]["1"]["device"] == device(1)
    assert data["manifest"]["world"]["parallel"]["tp_size"] == 2
    assert sorted(data["ranks"]) == ["0", "1"]
    assert [g["node_count"] for g in data["ranks"]["0"]["graphs"]] == [6, 7, 9, 13]
    only = json.loads(graphpersist("inspect", "--json", "--rank", "1", str(host_archive)).stdout)
    assert list(only["ranks"]) == ["1"]


def test_check_passes_on_a_matching_host_and_names_what_it_could_not_check(host_archive: Path):
    result = graphpersist("check", str(host_archive), *(f"--set={s}" for s in ENGINE_SETS), *host_sets())
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"graphpersist: archive {host_archive} fits this host for rank 0: ")
    assert lines[1].startswith("payloads verified: 8 graphs, 3 kernel images, ")


def test_check_without_engine_facts_lists_them_as_not_checked(host_archive: Path):
    result = graphpersist("check", str(host_archive), *host_sets())
    assert result.returncode == 0, result.stdout + result.stderr
    not_checked = result.stdout.splitlines()[-1]
    assert not_checked.startswith("not checked (")
    for field in ("engine.name", "parallel.tp_size", "model.config_fingerprint", "capture.sizes", "region.base"):
        assert field in not_checked
    # two GPUs numbered in CUDA's default order: which one device 0 is cannot be told, so it is not claimed
    for field in ("device.index", "device.pci_bus_id"):
        assert field in not_checked
    assert "device.uuid" not in result.stdout, "the UUID is recorded, never compared"


def test_check_reports_every_mismatch_and_exits_1(host_archive: Path):
    sets = [s for s in ENGINE_SETS if not s.startswith("parallel.tp_size")] + ["parallel.tp_size=4"]
    result = graphpersist("check", str(host_archive), *(f"--set={s}" for s in sets), NCCL_ALGO="Ring")
    assert result.returncode == 1
    assert result.stdout.splitlines()[:4] == [
        f"graphpersist: cannot LOAD {host_archive} (rank 0): 2 mismatches",
        "  parallel.tp_size: saved 2, live 4",
        "  env.NCCL_ALGO: saved <unset>, live 'Ring'",
        cli.CHECK_ADVICE,
    ]


def test_check_json(host_archive: Path):
    result = graphpersist("check", "--json", str(host_archive), "--set", "model.dtype=float16")
    assert result.returncode == 1
    data = json.loads(result.stdout)
    assert data["ok"] is False
    assert data["mismatches"] == [
        {
            "field": "model.dtype",
            "saved": "bfloat16",
            "live": "float16",
            "saved_missing": False,
            "live_missing": False,
            "line": "model.dtype: saved 'bfloat16', live 'float16'",
        }
    ]
    assert "engine.name" in data["not_checked"] and "env.NCCL_ALGO" in data["checked"]


def test_set_values_are_typed_like_the_saved_value(host_archive: Path):
    """A compute capability "9.0" stays a string; a size list is JSON; <unset> is unset."""
    capability = open_archive(host_archive).manifest.world.gpu.compute_capability
    assert isinstance(capability, str) and "." in capability
    result = graphpersist(
        "check",
        str(host_archive),
        f"--set=gpu.compute_capability={capability}",
        "--set=capture.sizes=[1,2,4,8]",
        "--set=env.NCCL_NVLS_ENABLE=<unset>",
    )
    assert result.returncode == 1
    assert result.stdout.splitlines()[:3] == [
        f"graphpersist: cannot LOAD {host_archive} (rank 0): 1 mismatch",
        "  env.NCCL_NVLS_ENABLE: saved '0', live <unset>",
        cli.CHECK_ADVICE,
    ]


def check_json(archive: Path, *args: str, **env: str) -> tuple[int, dict]:
    result = graphpersist("check", "--json", str(archive), *args, *host_sets(**env), **env)
    assert result.returncode in (0, 1), result.stderr
    return result.returncode, json.loads(result.stdout)


@pytest.mark.parametrize("rank", [0, 1])
def test_check_validates_each_ranks_gpu_where_it_can_name_it(tp2_archive: Path, rank: int):
    code, data = check_json(tp2_archive, "--rank", str(rank), **PCI_ORDER)
    assert code == 0 and data["ok"], data["mismatches"]
    assert "device.pci_bus_id" in data["checked"]
    assert "device.uuid" not in data["checked"] + data["not_checked"], "the UUID is recorded, never compared"
    assert "device.index" in data["not_checked"], "the index is assumed, not learned: never counted as passed"


def test_check_refuses_ranks_whose_gpus_were_swapped(tp2_archive: Path):
    """CUDA_VISIBLE_DEVICES reordered: device 0 is now the GPU rank 1 saved on, and the other way round."""
    for rank, other in ((0, 1), (1, 0)):
        result = graphpersist(
            "check", "--rank", str(rank), str(tp2_archive), **(PCI_ORDER | {"CUDA_VISIBLE_DEVICES": "1,0"})
        )
        assert result.returncode == 1
        assert result.stdout.splitlines()[:4] == [
            f"graphpersist: cannot LOAD {tp2_archive} (rank {rank}): 2 mismatches",
            "  env.CUDA_VISIBLE_DEVICES: saved '0,1', live '1,0'",
            f"  device.pci_bus_id: saved '{PCI_BUS_IDS[rank]}', live '{PCI_BUS_IDS[other]}'",
            cli.CHECK_ADVICE,
        ]


def test_check_can_be_told_which_device_a_rank_will_use(tp2_archive: Path):
    code, data = check_json(tp2_archive, "--rank", "0", "--set", "device.index=1", **PCI_ORDER)
    assert code == 1
    assert [m["line"] for m in data["mismatches"]] == [
        "device.index: saved 0, live 1",
        "device.pci_bus_id: saved '0000:19:00.0', live '0000:3a:00.0'",
    ]
    code, data = check_json(tp2_archive, "--rank", "1", "--set", "device.index=1", **PCI_ORDER)
    assert code == 0 and "device.index" in data["checked"]


def test_check_of_a_tp2_archive_at_another_tp_size_names_both_layout_fields(tp2_archive: Path):
    result = graphpersist("check", str(tp2_archive), "--set", "parallel.world_size=4", "--set", "parallel.tp_size=4",
                          **PCI_ORDER)  # fmt: skip
    assert result.returncode == 1
    assert result.stdout.splitlines()[1:3] == [
        "  parallel.world_size: saved 2, live 4",
        "  parallel.tp_size: saved 2, live 4",
    ]


def test_check_of_a_rank_the_archive_lacks(tp2_archive: Path):
    code, data = check_json(tp2_archive, "--rank", "2", **PCI_ORDER)
    assert code == 1 and [m["line"] for m in data["mismatches"]] == ["parallel.rank: saved [0, 1], live 2"]


def test_check_missing_directory_is_misuse_without_a_traceback(tmp_path: Path):
    result = graphpersist("check", str(tmp_path / "nope"))
    assert result.returncode == 2
    assert (
        result.stderr.strip().splitlines()[0]
        == f"graphpersist: cannot open archive {tmp_path / 'nope'}: no such directory"
    )
    assert "Traceback" not in result.stderr


def test_unreadable_archive_is_exit_2(host_archive: Path, tmp_path: Path):
    broken = write_archive(tmp_path / "broken")
    (broken / "rank_0" / "allocations.log").write_bytes(b"")
    for command in ("inspect", "check"):
        result = graphpersist(command, str(broken))
        assert result.returncode == 2 and "truncated file rank_0/allocations.log" in result.stderr


def test_malformed_set_is_misuse(host_archive: Path):
    result = graphpersist("check", str(host_archive), "--set", "no-equals-sign")
    assert result.returncode == 2 and "--set wants FIELD=VALUE" in result.stderr


def test_registry_refuses_duplicate_names():
    with pytest.raises(ValueError, match="already registered"):
        cli.register(cli.commands()[0])


def test_check_advises_like_an_inspection_tool_not_like_an_engine_start(host_archive: Path):
    """`check` starts no engine: it says what the user can do; an engine's LOAD keeps its own advice."""
    result = graphpersist("check", str(host_archive), "--set", "model.dtype=float16")
    assert result.returncode == 1
    report = result.stdout.splitlines()
    assert report[:2] == [
        f"graphpersist: cannot LOAD {host_archive} (rank 0): 1 mismatch",
        "  model.dtype: saved 'bfloat16', live 'float16'",
    ]
    assert report[2] == (
        "This archive does not fit this host/configuration: start the engine on a host/configuration that matches, "
        "or re-run SAVE here (GRAPHPERSIST_MODE=save or the engine's --graph-persist save) to write an archive for it."
    )
    assert "Re-run with mode=save for this configuration." not in result.stdout
    mismatches = evaluate(open_archive(host_archive), {"model": {"dtype": "float16"}}, 0, skip_unknown=True).mismatches
    assert str(LoadRefused(host_archive, mismatches, 0)).splitlines()[-1] == (
        "Re-run with mode=save for this configuration."
    )


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        ('"world_size": 2', '"world_size": ' + "9" * 5000, "(5000 characters) does not fit in 64 bits"),
        ('"flags": {', '"flags": {"deep": ' + "[" * 100_000 + "]" * 100_000 + ", ", "nested too deeply"),
        ('"ranks": [', '"ranks": [\n    0,', "ranks [0, 0, 1] must be exactly 0 .. 1 (parallel.world_size 2)"),
    ],
)
def test_a_hostile_manifest_is_exit_2_with_its_problem(tmp_path: Path, old: str, new: str, problem: str):
    broken = write_archive(tmp_path / "broken")
    text = (broken / "manifest.json").read_text()
    assert old in text
    (broken / "manifest.json").write_text(text.replace(old, new, 1))
    for command in (["check"], ["inspect"], ["inspect", "--json"]):
        result = graphpersist(*command, str(broken))
        assert result.returncode == 2, result.stdout + result.stderr
        assert result.stderr.startswith(f"graphpersist: cannot open archive {broken}: ")
        assert problem in result.stderr and "Traceback" not in result.stderr and not result.stdout


def test_exec_runs_the_program_under_the_interposer_and_passes_its_exit_code():
    probe = (
        "import os, sys; from graphpersist.memory import region; "
        "print(region.loaded(), os.environ['GP_REGION_BASE'], os.environ['LD_PRELOAD'].split(':')[0]); sys.exit(7)"
    )
    ran = graphpersist("exec", "--", sys.executable, "-c", probe)
    assert ran.returncode == 7, ran.stderr
    loaded, base, preload = ran.stdout.split()
    assert loaded == "True" and base == "0x500000000000" and preload.endswith("libgpinterpose.so")
    assert f"running {sys.executable} -c" in ran.stderr and "under the interposer" in ran.stderr


def test_exec_without_a_program_or_with_a_missing_one_is_misuse():
    bare = graphpersist("exec")
    assert bare.returncode == 2 and "name the program to run" in bare.stderr
    missing = graphpersist("exec", "no-such-program-here")
    assert missing.returncode == 2 and "cannot run 'no-such-program-here'" in missing.stderr
