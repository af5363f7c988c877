"""The `graphpersist` command as users run it: a separate process, human output by default, JSON on request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from archive_fixtures import write_archive

from graphpersist import cli
from graphpersist.archive import open_archive
from graphpersist.liveenv import PINNED_ENV, collect_live
from graphpersist.validate import flatten

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


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in PINNED_ENV}
    return env | PINS | {"PYTHONPATH": str(REPO / "overlays" / "graphpersist"), "PYTHONDONTWRITEBYTECODE": "1"} | extra


def graphpersist(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "graphpersist", *args], env=environment(**env), capture_output=True, text=True, cwd=REPO
    )


@pytest.fixture(scope="module")
def host_archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An archive whose host facts are this machine's (whatever it has: torch, a GPU, neither)."""
    os_env = environment()
    host = flatten(collect_live(environ=os_env))
    changes = {k: v for k, v in host.items() if k.split(".")[0] in ("distribution", "torch", "cuda", "nccl", "gpu")}
    return write_archive(tmp_path_factory.mktemp("cli") / "archive", **changes)


def test_every_command_has_help_and_version():
    names = [command.name for command in cli.commands()]
    assert {"inspect", "check"} <= set(names)
    top = graphpersist("--help")
    assert top.returncode == 0 and all(name in top.stdout for name in names)
    version = graphpersist("--version")
    assert version.returncode == 0 and version.stdout.startswith("graphpersist ")
    assert "(archive format 1)" in version.stdout
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
    assert "rank 1 (device 1)" in out
    assert "region    base 0x7e0000000000, size 64.0 GiB" in out
    assert "full-bs8      13        3       2" in out


def test_inspect_json_parses(host_archive: Path):
    result = graphpersist("inspect", "--json", str(host_archive))
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["manifest"]["format_version"] == 1
    assert data["manifest"]["world"]["parallel"]["tp_size"] == 2
    assert sorted(data["ranks"]) == ["0", "1"]
    assert [g["node_count"] for g in data["ranks"]["0"]["graphs"]] == [6, 7, 9, 13]
    only = json.loads(graphpersist("inspect", "--json", "--rank", "1", str(host_archive)).stdout)
    assert list(only["ranks"]) == ["1"]


def test_check_passes_on_a_matching_host_and_names_what_it_could_not_check(host_archive: Path):
    result = graphpersist("check", str(host_archive), *(f"--set={s}" for s in ENGINE_SETS))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"graphpersist: archive {host_archive} fits this host for rank 0: ")
    unknown = [f for f in ("torch.version", "cuda.driver", "gpu.model") if f not in flatten(collect_live())]
    if unknown:  # e.g. CI: no torch and no GPU; those facts must be listed, never counted as passed
        assert lines[1].startswith("not checked (") and all(f in lines[1] for f in unknown)


def test_check_without_engine_facts_lists_them_as_not_checked(host_archive: Path):
    result = graphpersist("check", str(host_archive))
    assert result.returncode == 0, result.stdout + result.stderr
    not_checked = result.stdout.splitlines()[-1]
    assert not_checked.startswith("not checked (")
    for field in ("engine.name", "parallel.tp_size", "model.config_fingerprint", "capture.sizes", "region.base"):
        assert field in not_checked


def test_check_reports_every_mismatch_and_exits_1(host_archive: Path):
    sets = [s for s in ENGINE_SETS if not s.startswith("parallel.tp_size")] + ["parallel.tp_size=4"]
    result = graphpersist("check", str(host_archive), *(f"--set={s}" for s in sets), NCCL_ALGO="Ring")
    assert result.returncode == 1
    assert result.stdout.splitlines()[:4] == [
        f"graphpersist: cannot LOAD {host_archive}: 2 mismatches",
        "  parallel.tp_size: saved 2, live 4",
        "  env.NCCL_ALGO: saved <unset>, live 'Ring'",
        "Re-run with mode=save for this configuration.",
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
        f"graphpersist: cannot LOAD {host_archive}: 1 mismatch",
        "  env.NCCL_NVLS_ENABLE: saved '0', live <unset>",
        "Re-run with mode=save for this configuration.",
    ]


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
