"""recipes/gpu-host/engine-proof.sh on CPU: which engine's bundle it installs where, and what it runs.

The script runs ON the GPU host; here a fake bundle (an install.sh that makes the packages' folders) and a fake
`python3` first on PATH (it records its arguments instead of proving) stand in for the host, so what is checked is
the script's own logic: the engine read from the recipe's name, one install folder per engine, the refusal of a
bundle of the other engine, REFRESH copying the engine's overlay tree, and the real checkpoint written before the
runs that load it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "recipes" / "gpu-host" / "engine-proof.sh"

FAKE_INSTALL = """#!/usr/bin/env bash
# install.sh --target DIR -- ...: a bundle of $BUNDLE_ENGINE
while [[ $# -gt 0 ]]; do [[ $1 == --target ]] && target=$2; shift; done
mkdir -p "$target/graphpersist" "$target/$BUNDLE_ENGINE"
echo "install.sh: installed $BUNDLE_ENGINE into $target"
"""
FAKE_PYTHON = """#!/usr/bin/env bash
printf '%s\\n' "$*" >> "$PROVE_RECORD.calls"
[[ $1 == -c ]] && { echo "$FAKE_PURELIB"; exit 0; }  # host-bytecode.sh asks for the interpreter's purelib
[[ $1 == -m && $2 == compileall ]] && exit 0
[[ $1 == *real_checkpoint.py ]] && exit "${FAKE_CHECKPOINT_RC:-0}"  # writes the real checkpoint on the host
[[ -n ${GP_REAL_MODEL:-} ]] && printf '%s\n' "$GP_REAL_MODEL" > "$PROVE_RECORD.real_model"
[[ $2 == gptools.prove ]] && printf '%s\n' "${GRAPHPERSIST_ALLOC_TRACE:-}" > "$PROVE_RECORD.alloc_trace"
[[ $2 == graphpersist ]] && { echo "allocdiff: SAVE and LOAD part at allocator action 7"; exit 1; }
[[ $2 == pytest ]] && { echo "1 passed"; exit 0; }
printf '%s\\n' "$*" > "$PROVE_RECORD"
printf '%s\\n' "$PYTHONPATH" >> "$PROVE_RECORD"
"""


def run_script(
    tmp_path: Path, recipe: str, bundle_engine: str = "sglang", script: Path = SCRIPT, **env: str
) -> subprocess.CompletedProcess:
    bundle, bin_dir = tmp_path / "bundle", tmp_path / "bin"
    for folder, name, text in ((bundle, "install.sh", FAKE_INSTALL), (bin_dir, "python3", FAKE_PYTHON)):
        folder.mkdir(exist_ok=True)
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    full = dict(os.environ, RECIPE=recipe, BUNDLE_DIR=str(bundle), SITE=str(tmp_path / "site"), OUT=str(tmp_path / "o"))
    full |= {
        "PROOF_OUT": str(tmp_path / "proof"),
        "BUNDLE_ENGINE": bundle_engine,
        "PROVE_RECORD": str(tmp_path / "rec"),
        "FAKE_PURELIB": str(tmp_path / "purelib"),
        "HOST_BYTECODE_MARK": str(tmp_path / "host-bytecode-done"),
    }
    full["PATH"] = f"{bin_dir}{os.pathsep}{full['PATH']}"
    full.update(env)
    return subprocess.run(["bash", str(script)], cwd=REPO, env=full, capture_output=True, text=True, timeout=60)


def test_an_sglang_recipe_installs_the_sglang_bundle_and_proves_the_recipe(tmp_path: Path) -> None:
    proc = run_script(tmp_path, "sglang-qwen3-8b-tp2", RUNS="save,load")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"installing the sglang bundle from {tmp_path / 'bundle'} into {tmp_path / 'site'}" in proc.stdout
    command, pythonpath = (tmp_path / "rec").read_text().splitlines()
    assert (
        command
        == f"-m gptools.prove recipes/sglang-qwen3-8b-tp2 --out {tmp_path / 'proof'} --runs save,load --keep-going"
    )
    assert pythonpath.split(os.pathsep)[:2] == [str(tmp_path / "site"), str(REPO / "tools")]


def test_a_diagnosis_record_is_proved_from_its_folder_under_diagnosis(tmp_path: Path) -> None:
    """recipes/diagnosis/<name>: the engine and the default --out come from the folder's own name."""
    proc = run_script(tmp_path, "diagnosis/vllm-qwen3-8b-tp1-startup", bundle_engine="vllm", PROOF_OUT="")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"installing the vllm bundle from {tmp_path / 'bundle'} into {tmp_path / 'site'}" in proc.stdout
    command = (tmp_path / "rec").read_text().splitlines()[0]
    assert command == (
        "-m gptools.prove recipes/diagnosis/vllm-qwen3-8b-tp1-startup --out /root/proof-vllm-qwen3-8b-tp1-startup "
        "--keep-going"
    )


def test_an_installed_site_is_not_installed_again(tmp_path: Path) -> None:
    assert run_script(tmp_path, "sglang-qwen3-8b-tp2").returncode == 0
    proc = run_script(tmp_path, "sglang-qwen3-8b-tp2-symm")
    assert proc.returncode == 0 and "installing" not in proc.stdout


def test_a_new_install_gets_its_bytecode_written_once(tmp_path: Path) -> None:
    """The host sets PYTHONDONTWRITEBYTECODE=1 and the install uses --no-compile: without compileall every start
    would compile every imported module from source."""
    first = run_script(tmp_path, "sglang-qwen3-8b-tp2")
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"engine-proof: bytecode of {tmp_path / 'site'} written in" in first.stdout
    assert run_script(tmp_path, "sglang-qwen3-8b-tp2-symm").returncode == 0
    calls = (tmp_path / "rec.calls").read_text().splitlines()
    assert [c for c in calls if "compileall" in c and "purelib" not in c] == [
        f"-m compileall -q -j 0 {tmp_path / 'site'}"
    ]
    assert len([c for c in calls if "gptools.prove" in c]) == 2


def test_each_engine_gets_its_own_bundle_and_site_by_default(tmp_path: Path) -> None:
    """Without SITE and BUNDLE_DIR the folders are named after the engine (the fake bundle is not there: it stops)."""
    env = {k: v for k, v in os.environ.items() if k not in ("SITE", "BUNDLE_DIR")}
    for recipe, engine in (("sglang-qwen3-8b-tp2", "sglang"), ("vllm-qwen3-8b-tp2", "vllm")):
        run_env = dict(env, RECIPE=recipe, OUT=str(tmp_path / "o"), PROOF_OUT=str(tmp_path / "p"))
        proc = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=run_env, capture_output=True, text=True, timeout=60)
        assert f"installing the {engine} bundle from /root/gpbundle-{engine} into /root/gpsite-{engine}" in proc.stdout
        assert proc.returncode == 1


def test_a_bundle_of_the_other_engine_is_refused(tmp_path: Path) -> None:
    proc = run_script(tmp_path, "sglang-qwen3-8b-tp2", bundle_engine="vllm")
    assert proc.returncode == 1
    assert "has no sglang after the install: is" in proc.stderr and "the sglang bundle" in proc.stderr
    assert not (tmp_path / "rec").exists()


@pytest.mark.parametrize(("recipe", "env"), [("runtime-tp2", {}), ("sglang-qwen3-8b-tp2", {"ENGINE": "deep_ep"})])
def test_a_recipe_of_no_known_engine_is_misuse(tmp_path: Path, recipe: str, env: dict[str, str]) -> None:
    proc = run_script(tmp_path, recipe, **env)
    assert proc.returncode == 2
    assert "set ENGINE=vllm or ENGINE=sglang" in proc.stderr


def test_refresh_copies_the_engines_overlay_tree_and_the_runtime(tmp_path: Path) -> None:
    proc = run_script(tmp_path, "sglang-qwen3-8b-tp2", REFRESH="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for overlay in (REPO / "overlays" / "sglang" / "sglang").rglob("*.py"):
        copied = tmp_path / "site" / "sglang" / overlay.relative_to(REPO / "overlays" / "sglang" / "sglang")
        assert copied.read_bytes() == overlay.read_bytes()
    assert (tmp_path / "site" / "graphpersist" / "memory" / "region.py").is_file()


def test_the_hosts_missing_bytecode_is_written_once_per_host(tmp_path: Path) -> None:
    """The host's torch has no .pyc and PYTHONDONTWRITEBYTECODE=1: every engine process compiled it at import."""
    first = run_script(tmp_path, "vllm-qwen3-8b-tp1", bundle_engine="vllm")
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"host-bytecode: missing bytecode of {tmp_path / 'purelib'} written in" in first.stdout
    second = run_script(tmp_path, "vllm-qwen3-8b-tp1-serve", bundle_engine="vllm")
    assert second.returncode == 0 and "host-bytecode" not in second.stdout
    calls = (tmp_path / "rec.calls").read_text().splitlines()
    assert [c for c in calls if "compileall" in c and "purelib" in c] == [
        f"-m compileall -q -j 0 {tmp_path / 'purelib'}"
    ]


def test_host_bytecode_0_leaves_the_host_as_it_is(tmp_path: Path) -> None:
    proc = run_script(tmp_path, "vllm-qwen3-8b-tp1", bundle_engine="vllm", HOST_BYTECODE="0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "HOST_BYTECODE=0: the host's packages are left without their missing bytecode" in proc.stdout
    assert "purelib" not in (tmp_path / "rec.calls").read_text() and not (tmp_path / "host-bytecode-done").exists()


REAL_RUNS = "save_real,load_real,baseline_real"


@pytest.mark.parametrize(
    "runs",
    [REAL_RUNS, "load_real", "load,load_real_2", ""],
    ids=["real-runs", "one-real-run", "a-repetition", "every-run"],
)
def test_real_weight_runs_get_the_checkpoint_written_first_and_named_to_the_proof(tmp_path: Path, runs: str) -> None:
    folder = tmp_path / "ckpt"
    proc = run_script(tmp_path, "vllm-qwen3-8b-tp1", bundle_engine="vllm", RUNS=runs, REAL_MODEL=str(folder))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"engine-proof: real-weight runs: GP_REAL_MODEL={folder}; python3 recipes/gpu-host/real_checkpoint.py" in (
        proc.stdout
    )
    calls = (tmp_path / "rec.calls").read_text().splitlines()
    writes = [i for i, c in enumerate(calls) if c == f"recipes/gpu-host/real_checkpoint.py {folder}"]
    proves = [i for i, c in enumerate(calls) if c.startswith("-m gptools.prove")]
    assert len(writes) == 1 and len(proves) == 1 and writes[0] < proves[0]
    assert (tmp_path / "rec.real_model").read_text().strip() == str(folder)


def test_the_real_checkpoint_defaults_to_the_hosts_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REAL_MODEL", raising=False)
    proc = run_script(tmp_path, "sglang-qwen3-8b-tp1", RUNS=REAL_RUNS)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "rec.real_model").read_text().strip() == "/root/qwen3-8b-random"


def test_runs_without_real_weights_write_no_checkpoint(tmp_path: Path) -> None:
    proc = run_script(tmp_path, "vllm-qwen3-8b-tp1", bundle_engine="vllm", RUNS="save,load,load_2,baseline")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "real_checkpoint.py" not in (tmp_path / "rec.calls").read_text()
    assert not (tmp_path / "rec.real_model").exists() and "real-weight" not in proc.stdout


def test_a_checkpoint_that_cannot_be_written_stops_before_the_proof(tmp_path: Path) -> None:
    proc = run_script(tmp_path, "vllm-qwen3-8b-tp1", bundle_engine="vllm", RUNS=REAL_RUNS, FAKE_CHECKPOINT_RC="1")
    assert proc.returncode == 1
    assert "gptools.prove" not in (tmp_path / "rec.calls").read_text()


def test_traced_pair_proves_save_and_load_with_the_trace_then_compares_the_traces(tmp_path: Path) -> None:
    """recipes/gpu-host/traced-pair.sh: engine-proof.sh's SAVE and LOAD with GRAPHPERSIST_ALLOC_TRACE under $OUT, then
    allocdiff of rank 0's two traces (its exit and text shown), then the GPU test of the trace."""
    traced = REPO / "recipes" / "gpu-host" / "traced-pair.sh"
    proc = run_script(tmp_path, "vllm-qwen3-8b-tp1", bundle_engine="vllm", script=traced)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "o"
    assert (tmp_path / "rec.alloc_trace").read_text().strip() == str(out / "alloctrace")
    calls = (tmp_path / "rec.calls").read_text().splitlines()
    prove = f"-m gptools.prove recipes/vllm-qwen3-8b-tp1 --out {tmp_path / 'proof'} --runs save,load --keep-going"
    diff = f"-m graphpersist allocdiff {out}/alloctrace/save-rank0.json.gz {out}/alloctrace/load-rank0.json.gz"
    gpu_test = "-m pytest -m gpu tests/gpu/test_alloctrace_gpu.py -p no:cacheprovider -rA -s"
    assert [c for c in calls if c.startswith("-m ") and "compileall" not in c] == [prove, diff, gpu_test], calls
    assert "traced-pair: allocdiff exit 1" in proc.stdout and "part at allocator action 7" in proc.stdout
    assert "tests/gpu/test_alloctrace_gpu.py exit 0" in proc.stdout and "1 passed" in proc.stdout, proc.stdout
    helped = subprocess.run(["bash", str(traced), "--help"], capture_output=True, text=True, timeout=30)
    assert helped.returncode == 0 and helped.stdout.startswith("A SAVE and a LOAD of an engine recipe"), helped.stdout
