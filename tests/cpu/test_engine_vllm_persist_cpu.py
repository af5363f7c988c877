"""The built vLLM's graph persistence on CPU: switch, refusals, KV budget, capture sites, LOAD's inventory and facts.

What a GPU run proves end to end (recipes/vllm-qwen3-8b-tp2) is pinned down here piece by piece, without a GPU,
against the installed patched wheel: real vLLM configs of a tiny model resolved by vLLM itself, vLLM's own graph
manager and piecewise wrappers, the overlay modules as shipped. Each snippet runs in a fork of one warm
interpreter in the shared CPU venv (tests/cpu/warm_python.py, prelude tests/cpu/vllm_persist_prelude.py), so the
module costs seconds once the venv exists.

Not covered on CPU (no CUDA): capturing, instantiating or replaying a graph, the runtime's region and LOAD, custom
all-reduce's IPC; recipes/vllm-qwen3-8b-tp2 covers them on GPUs.
"""

from __future__ import annotations

import ast
import difflib
import json
import os
import re
import subprocess
import tomllib
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from archive_fixtures import fake_nvidia_smi
from vllm_cpu_venv import TINY_LLAMA, built_wheels
from warm_python import WarmPython

pytestmark = [pytest.mark.network, pytest.mark.slow]

PRELUDE = Path(__file__).resolve().parent / "vllm_persist_prelude.py"
TOOLS = Path(__file__).resolve().parents[2] / "tools"  # the diagnosis tools (gpdiag) are not in the wheel
WORKER_CLS = "vllm.graphpersist_worker.PersistWorker"
MOE_RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "vllm-qwen3-30b-a3b-tp1" / "proof.toml"


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A folder with the tiny model and one fake GPU on PATH (so the GPU facts LOAD compares are the same on every
    host), and an environment with them and no persistence, region or CUDA variables inherited."""
    work = tmp_path_factory.mktemp("vllm-persist")
    model = work / "tiny-llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    smi = work / "bin"
    smi.mkdir()
    fake_nvidia_smi(smi, gpus=1)
    dropped = ("GRAPHPERSIST_", "GP_", "CUDA_", "VLLM_", "LD_PRELOAD", "PYTHONPATH")
    env = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
    env.update(PATH=f"{smi}:{os.environ['PATH']}", GP_TEST_MODEL=str(model), PYTHONWARNINGS="ignore")
    return work, env


@pytest.fixture(scope="module")
def vllm(vllm_venv: Path, vllm_env: tuple[Path, dict[str, str]]) -> Iterator[WarmPython]:
    """The warm interpreter: the patched vLLM imported, in `vllm_env`."""
    work, env = vllm_env
    server = WarmPython(vllm_venv / "bin" / "python", PRELUDE, env, work)
    yield server
    server.close()


# ---------------------------------------------------------------- the switch selects the worker and its environment


def test_save_selects_the_persisting_worker_and_prepares_every_process(vllm: WarmPython, tmp_path: Path) -> None:
    got = vllm.run(
        f"""
        from graphpersist.memory import region
        from vllm.utils.import_utils import resolve_obj_by_qualname
        from vllm.v1.worker.gpu_worker import Worker

        os.chdir({str(tmp_path)!r})
        os.environ["LD_PRELOAD"] = "/opt/site/libsite.so"  # the user's own preload stays, after ours
        before = dict(os.environ)
        args = EngineArgs(model=MODEL, graph_persist="save", graph_persist_dir="archive")
        after = dict(os.environ)
        worker = resolve_obj_by_qualname(args.worker_cls)
        result = {{
            "worker_cls": args.worker_cls,
            "changed": {{k: v for k, v in after.items() if before.get(k) != v}},
            "removed": sorted(set(before) - set(after)),
            "interposer": str(region.prebuilt_interposer()),
            "is_gpu_worker": issubclass(worker, Worker),
            "overrides": sorted(k for k in ("init_device", "determine_available_memory", "initialize_from_config",
                                            "compile_or_warm_up_model") if k in vars(worker)),
            # the platform keeps it (vLLM's CPU and CUDA platforms replace only "auto")
            "config_worker_cls": args.create_engine_config().parallel_config.worker_cls,
            # resolving again (arguments built from resolved ones) does not refuse persistence's own worker
            "again": EngineArgs(model=MODEL, worker_cls=args.worker_cls, graph_persist="save",
                                graph_persist_dir="archive").worker_cls,
        }}
        """
    ).ok()
    interposer = Path(got["interposer"])
    assert interposer.name == "libgpinterpose.so" and interposer.is_file()
    refusal_file = Path(got["changed"].pop("GRAPHPERSIST_REFUSAL_FILE"))  # where an engine process's refusal comes back
    assert refusal_file.name.startswith("graphpersist-refusal-") and not refusal_file.exists()
    assert got["changed"] == {
        "GRAPHPERSIST_MODE": "save",
        "GRAPHPERSIST_DIR": str(tmp_path / "archive"),
        "LD_PRELOAD": f"{interposer}:/opt/site/libsite.so",
        "GP_REGION_BASE": "0x500000000000",
    }
    assert got["removed"] == []
    assert got["worker_cls"] == got["config_worker_cls"] == got["again"] == WORKER_CLS
    assert got["is_gpu_worker"]
    assert got["overrides"] == [
        "compile_or_warm_up_model",
        "determine_available_memory",
        "init_device",
        "initialize_from_config",
    ]


@pytest.mark.parametrize(
    "engine_args",
    [{}, {"graph_persist": "off", "graph_persist_dir": "/ignored"}],
    ids=["default", "explicit-off"],
)
def test_off_keeps_vllms_worker_and_environment(vllm: WarmPython, engine_args: dict) -> None:
    got = vllm.run(
        f"""
        before = dict(os.environ)
        args = EngineArgs(model=MODEL, **{engine_args!r})
        result = {{"worker_cls": args.worker_cls, "environ_unchanged": dict(os.environ) == before}}
        """
    ).ok()
    assert got == {"worker_cls": "auto", "environ_unchanged": True}


def test_later_engine_args_follow_the_exported_switch_without_a_second_line(vllm: WarmPython, tmp_path: Path) -> None:
    """vLLM builds more EngineArgs in the same process (LLM's log_non_default_args builds a default instance to
    compare with): they resolve the exported environment to the same switch, and the start still logs one line."""
    outcome = vllm.run(
        f"""
        EngineArgs(model=MODEL, graph_persist="save", graph_persist_dir={str(tmp_path)!r})
        result = EngineArgs(model=MODEL).worker_cls
        """
    )
    assert outcome.ok() == WORKER_CLS
    assert [line.split("] ", 1)[1] for line in outcome.output.splitlines() if "graphpersist: mode=" in line] == [
        f"graphpersist: mode=save dir={tmp_path} (from keyword graph_persist, keyword graph_persist_dir)"
    ]


@pytest.mark.parametrize(
    ("mode", "interposer", "upstream", "expected"),
    [
        ("off", False, "fork", "fork"),  # off: vLLM's choice, untouched
        ("off", False, "spawn", "spawn"),
        ("save", False, "fork", "spawn without __main__"),  # a fork of this process would lack the runtime
        ("load", False, "fork", "spawn without __main__"),
        ("load", False, "spawn", "spawn"),  # vLLM spawns anyway: as upstream, the script's guard is the user's
        ("load", True, "fork", "fork"),  # under the interposer: children inherit it
        ("load", True, "spawn", "spawn"),  # vLLM's own reasons for spawn (CUDA initialised) still hold
    ],
)
def test_vllms_processes_fork_only_where_the_interposer_is_loaded(
    vllm: WarmPython, tmp_path: Path, mode: str, interposer: bool, upstream: str, expected: str
) -> None:
    """get_mp_context (patch 0004) returns graphpersist_switch.mp_context's context: where persistence must spawn and
    vLLM would fork, a spawn that never runs the program's script again (graphpersist.engine.spawn)."""
    outcome = vllm.run(
        f"""
        from graphpersist.memory import region
        from vllm.utils.system_utils import get_mp_context
        region.loaded = lambda: {interposer!r}  # CPU: no LD_PRELOAD in this interpreter
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = {upstream!r}
        EngineArgs(model=MODEL, graph_persist={mode!r}, graph_persist_dir={str(tmp_path)!r})
        contexts = [get_mp_context(), get_mp_context()]
        result = [c.get_start_method() + (" without __main__" if type(c).__name__ == "MainlessSpawnContext" else "")
                  for c in contexts]
        """
    )
    assert outcome.ok() == [expected, expected]
    told = [line for line in outcome.output.splitlines() if "starts with spawn" in line]
    assert len(told) == expected.endswith("without __main__"), outcome.output  # said once per process, when it acts
    if told:
        assert "this script does not run again" in told[0] and "graphpersist exec" in told[0]


# `vllm serve`: the CLI's own cli_env_setup sets spawn for a user who chose none (patch 0005 tells the glue); what
# each case adds before it runs, and what vLLM's processes then use.
CLI_START = {
    "cli-default": "pass",
    "user-chose-spawn": 'os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"',
    "cuda-initialised": "torch.cuda._is_compiled = torch.cuda.is_initialized = lambda: True",
    "numa-bind": 'sys.argv.append("--numa-bind")',
}


@pytest.mark.parametrize(
    ("mode", "interposer", "case", "expected"),
    [
        ("off", True, "cli-default", "spawn"),  # off: the CLI's spawn, untouched
        ("load", True, "cli-default", "fork"),  # the cut: no reason to spawn, so vLLM's library default
        ("save", True, "cli-default", "fork"),
        ("load", False, "cli-default", "spawn"),  # a fork of this process would lack the runtime
        ("load", True, "user-chose-spawn", "spawn"),  # the user's choice stands
        ("load", True, "cuda-initialised", "spawn"),  # vLLM's own reasons for spawn still hold
        ("load", True, "numa-bind", "spawn"),
    ],
)
def test_vllm_serve_forks_under_persistence_where_vllm_itself_would(
    vllm: WarmPython, tmp_path: Path, mode: str, interposer: bool, case: str, expected: str
) -> None:
    """The real cli_env_setup, then the switch, then get_mp_context twice (decided once, then kept)."""
    outcome = vllm.run(
        f"""
        from graphpersist.memory import region
        from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
        from vllm.utils.system_utils import get_mp_context
        region.loaded = lambda: {interposer!r}  # CPU: no LD_PRELOAD in this interpreter
        os.environ.pop("VLLM_WORKER_MULTIPROC_METHOD", None)
        {CLI_START[case]}
        cli_env_setup()
        EngineArgs(model=MODEL, graph_persist={mode!r}, graph_persist_dir={str(tmp_path)!r})
        result = {{"methods": [get_mp_context().get_start_method(), get_mp_context().get_start_method()],
                   "environ": os.environ["VLLM_WORKER_MULTIPROC_METHOD"]}}
        """
    )
    got = outcome.ok()
    assert got["methods"] == [expected, expected]
    forked = expected == "fork"
    assert got["environ"] == expected  # what every later call and every forked child reads
    told = [line for line in outcome.output.splitlines() if "instead of the CLI's default spawn" in line]
    assert len(told) == forked, outcome.output  # said once, and only when it acts
    vllm_must_spawn = [line for line in outcome.output.splitlines() if "We must use the `spawn`" in line]
    if case == "cuda-initialised":
        assert len(vllm_must_spawn) == 1 and "CUDA is initialized" in vllm_must_spawn[0], outcome.output
    elif case == "numa-bind":
        assert len(vllm_must_spawn) == 1 and "NUMA binding requires spawn" in vllm_must_spawn[0], outcome.output
    else:
        assert vllm_must_spawn == [], outcome.output


# A user's script as the README's quickstart writes it (no main guard), with vLLM's own get_mp_context starting a
# stand-in of the engine core (importable, as vLLM's EngineCoreProc.run_engine_core is) that says what it runs under.
STAND_IN_CORE = """
import json, sys

from graphpersist import engine, switch


def run_engine_core(out):
    with open(out, "a") as f:
        note = {"who": "core", "interposer": engine.interposer_loaded(), "mode": switch.resolve().mode.value,
                "imported_main": getattr(sys.modules["__main__"], "__file__", None)}
        f.write(json.dumps(note) + "\\n")
"""
PLAIN_SCRIPT = """
import json, os, sys

from vllm.engine.arg_utils import EngineArgs
from vllm.utils.system_utils import get_mp_context
import standin_core

with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"who": "script", "name": __name__}) + "\\n")
EngineArgs(model=os.environ["GP_TEST_MODEL"])  # the switch from GRAPHPERSIST_MODE and _DIR, as LLM() resolves it
core = get_mp_context().Process(target=standin_core.run_engine_core, args=(sys.argv[1],), name="EngineCore")
core.start()
core.join()
print("engine core exit", core.exitcode)
"""


@pytest.mark.parametrize("mode", ["save", "load"])
def test_a_script_without_the_main_guard_runs_once_and_its_engine_core_runs_under_the_interposer(
    vllm_venv: Path, vllm_env: tuple[Path, dict[str, str]], tmp_path: Path, mode: str
) -> None:
    """`python app.py` (no `graphpersist exec`, so no interposer here): vLLM's engine core is spawned with the
    interposer, and the script's top level runs once, as upstream's fork runs it."""
    (tmp_path / "standin_core.py").write_text(STAND_IN_CORE)
    (tmp_path / "app.py").write_text(PLAIN_SCRIPT)
    (tmp_path / "archive").mkdir()
    notes = tmp_path / "notes.jsonl"
    env = {**vllm_env[1], "GRAPHPERSIST_MODE": mode, "GRAPHPERSIST_DIR": str(tmp_path / "archive")}
    proc = subprocess.run([str(vllm_venv / "bin" / "python"), "app.py", str(notes)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0 and "engine core exit 0" in proc.stdout, proc.stdout + proc.stderr
    assert [json.loads(line) for line in notes.read_text().splitlines()] == [
        {"who": "script", "name": "__main__"},
        {"who": "core", "interposer": True, "mode": mode, "imported_main": None},
    ]
    assert len(re.findall(rf"graphpersist: mode={mode} ", proc.stdout + proc.stderr)) == 1


# An engine core that died, as vLLM's launching process meets it in wait_for_engine_startup (patch 0006): a forked
# child standing in for the engine core raises in a seam of the glue (recorded when it is the runtime's refusal);
# the real function, with a real handshake socket that hears nothing and the child's sentinel, raises.
ENGINE_CORE_DIES = """
import multiprocessing, tempfile, types, zmq
from graphpersist.archive.validate import LoadRefused, Mismatch
from vllm.v1.engine.utils import wait_for_engine_startup

tempfile.tempdir = {folder!r}  # where the launcher names the start's refusal file
EngineArgs(model=MODEL, **{persist!r})


def engine_core():
    with engine.recording_refusals():
        if {refuse!r}:
            raise LoadRefused({folder!r}, [Mismatch("flags.max_model_len", 4096, 2048)], 0)
        raise ValueError("an engine error of vLLM's own")


core = multiprocessing.get_context("fork").Process(target=engine_core, name="EngineCore")
core.start()
core.join()
cfg = engine_config()
manager = types.SimpleNamespace(sentinels=lambda: [core.sentinel], finished_procs=lambda: {{core.name: core.exitcode}})
with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as handshake:
    handshake.bind("ipc://" + {folder!r} + "/handshake")
    try:
        wait_for_engine_startup(handshake, None, [types.SimpleNamespace(identity=b"\\0\\0", local=True)],
                                cfg.parallel_config, False, cfg.cache_config, manager, None)
    except Exception as exc:
        cause = exc.__cause__
        result = {{"raised": type(exc).__name__, "lines": str(exc).splitlines(),
                   "cause": None if cause is None else f"{{type(cause).__name__}}: {{cause}}",
                   "left": sorted(os.listdir({folder!r}))}}
"""
ENGINE_CORE_FAILED = "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): "


def test_a_refused_load_raises_load_refused_in_the_launching_process(vllm: WarmPython, tmp_path: Path) -> None:
    persist = {"graph_persist": "load", "graph_persist_dir": str(tmp_path)}
    got = vllm.run(ENGINE_CORE_DIES.format(folder=str(tmp_path), persist=persist, refuse=True)).ok()
    assert got["raised"] == "LoadRefused"
    assert got["lines"] == [f"graphpersist: cannot LOAD {tmp_path} (rank 0): 1 mismatch",
                            "  flags.max_model_len: saved 4096, live 2048",
                            "Re-run with mode=save for this configuration."]  # fmt: skip
    assert got["cause"] == ENGINE_CORE_FAILED + "{'EngineCore': 1}"  # chained to vLLM's own error
    assert got["left"] == ["handshake"]  # the refusal, read, is gone


@pytest.mark.parametrize(
    ("persist", "refuse"),
    [({"graph_persist": "load"}, False), ({}, True)],
    ids=["no-refusal-recorded", "persistence-off"],
)
def test_without_a_recorded_refusal_vllms_error_stands(
    vllm: WarmPython, tmp_path: Path, persist: dict, refuse: bool
) -> None:
    """An engine core that died of anything but a refusal; and with persistence off, no refusal file at all (the
    stand-in's refusal is not written: nothing named one)."""
    persist = {**persist, "graph_persist_dir": str(tmp_path)} if persist else {}
    got = vllm.run(ENGINE_CORE_DIES.format(folder=str(tmp_path), persist=persist, refuse=refuse)).ok()
    assert (got["raised"], got["cause"]) == ("RuntimeError", None)
    assert got["lines"] == [ENGINE_CORE_FAILED.removeprefix("RuntimeError: ") + "{'EngineCore': 1}"]
    assert got["left"] == ["handshake"]


def test_a_load_switch_restores_the_model_inspection_cache_before_the_engine_starts(
    vllm: WarmPython, tmp_path: Path
) -> None:
    """vLLM inspects the model class (in a subprocess, 13.7 s of a fresh TP=2 start on the reference host) while it
    builds the configuration, before any worker exists; a LOAD's switch puts the archive's `modelinfos` back first."""
    inspected = "vllm-model_executor-models-qwen3-Qwen3ForCausalLM.json"
    outcome = vllm.run(
        f"""
        import io, tarfile
        from graphpersist.archive import jitcache
        root = Path({str(tmp_path)!r})
        os.environ["VLLM_CACHE_ROOT"] = str(root / "fresh-host")  # vLLM reads it when asked
        saved = root / "save-host" / "modelinfos"
        saved.mkdir(parents=True)
        (saved / {inspected!r}).write_text('{{"architectures": ["Qwen3ForCausalLM"]}}')
        blob, _ = jitcache.collect({{"vllm_modelinfos": saved}})
        cfg = engine_config(tensor_parallel_size=2)
        write_vllm_archive(root / "archive", cfg, adapter(cfg).config_flags(), {{jitcache.SHARED_NAME: blob}})
        EngineArgs(model=MODEL, graph_persist="load", graph_persist_dir=str(root / "archive"))
        EngineArgs(model=MODEL)  # vLLM builds more; the first restored already
        result = {{"restored": sorted(str(p) for p in (root / "fresh-host").rglob("*qwen3*") if p.is_file()),
                   "content": (root / "fresh-host" / "modelinfos" / {inspected!r}).read_text()}}
        """
    )
    got = outcome.ok()
    assert got["restored"] == [str(tmp_path / "fresh-host" / "modelinfos" / inspected)]
    assert got["content"] == '{"architectures": ["Qwen3ForCausalLM"]}'
    assert "graphpersist: 1 cache file(s) restored before the engine starts (vllm_modelinfos)" in outcome.output


def test_another_worker_cls_is_refused_and_nothing_is_exported(vllm: WarmPython, tmp_path: Path) -> None:
    outcome = vllm.run(
        f"""
        before = dict(os.environ)
        try:
            EngineArgs(model=MODEL, worker_cls="my.Worker", graph_persist="save", graph_persist_dir={str(tmp_path)!r})
        finally:
            assert dict(os.environ) == before, "a refused switch exported its environment"
        """
    )
    assert outcome.raised("SwitchError") == (
        "graphpersist: --graph-persist save needs vLLM's own GPU worker, but worker_cls is 'my.Worker': drop "
        "--worker-cls or turn persistence off"
    )


# ---------------------------------------------------------------- configurations persistence cannot restore

# (vLLM's EngineArgs, the change made to the resolved config, the refusal's "what", its advice). Changes are made
# after resolving where vLLM on CPU cannot resolve the setting itself: expert parallelism needs a model with
# experts, and the fused all-reduce pass at TP 2 needs CUDA ops the CPU build lacks; the refusal reads only the flag.
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
REFUSED = {
    "enforce_eager": (
        {"enforce_eager": True, "tensor_parallel_size": 2},
        "",
        "enforce_eager (no CUDA graphs)",
        "turn persistence off, or drop enforce_eager",
    ),
    "pipeline": (
        {"pipeline_parallel_size": 2, "tensor_parallel_size": 2},
        "",
        "pipeline_parallel_size=2",
        "use tensor parallelism only",
    ),
    "data": (
        {"data_parallel_size": 2, "tensor_parallel_size": 2},
        "",
        "data_parallel_size=2",
        "start one engine per data-parallel rank",
    ),
    "expert": (
        {"tensor_parallel_size": 2},
        "cfg.parallel_config.enable_expert_parallel = True",
        "expert parallelism",
        "turn expert parallelism off",
    ),
    "deepep-low-latency": (
        {"data_parallel_size": 2},
        'cfg.parallel_config.enable_expert_parallel = True; cfg.parallel_config.all2all_backend = "deepep_low_latency"',
        "DeepEP's low-latency all2all (--all2all-backend deepep_low_latency)",
        "it is captured in the decode graphs and needs NVSHMEM with an InfiniBand NIC (IBGDA), even within one "
        "node, while persistence keeps only DeepEP's NVLink buffers. Instead serve with tensor parallelism "
        "(expert parallelism off), or use SGLang's DeepEP normal mode (--moe-a2a-backend deepep --deepep-mode "
        "normal), which persistence supports",
    ),
    "deepep-high-throughput": (
        {"data_parallel_size": 2},
        "cfg.parallel_config.enable_expert_parallel = True; "
        'cfg.parallel_config.all2all_backend = "deepep_high_throughput"',
        "DeepEP expert parallelism (--all2all-backend deepep_high_throughput)",
        "vLLM uses DeepEP only with data parallelism > 1, which persistence does not take, and turns CUDA graphs off "
        "for its high-throughput kernels (nothing to persist). Instead serve with tensor parallelism (expert "
        "parallelism off), or use SGLang's DeepEP normal mode (--moe-a2a-backend deepep --deepep-mode normal)",
    ),
    "prefill-context": (  # vLLM's world is PP x TP x PCP ranks; this CPU host cannot build a PCP engine config
        {"tensor_parallel_size": 2},
        "cfg.parallel_config.world_size = 4",
        "prefill context parallelism (a world of 4 ranks for tensor_parallel_size 2)",
        "serve without prefill_context_parallel_size",
    ),
    "decode-context": (
        {"tensor_parallel_size": 2},
        "cfg.parallel_config.decode_context_parallel_size = 2",
        "decode_context_parallel_size=2",
        "serve without decode context parallelism",
    ),
    "nodes": ({"tensor_parallel_size": 2, "nnodes": 2}, "", "2 nodes", "run on a single node"),
    "lora": ({"enable_lora": True, "tensor_parallel_size": 2}, "", "LoRA", "serve without LoRA adapters"),
    "speculative": (
        {"speculative_config": NGRAM, "tensor_parallel_size": 2},
        "",
        "speculative decoding",
        "serve without a speculative config",
    ),
    "no-graphs": (
        {"tensor_parallel_size": 2},
        "cfg.compilation_config.cudagraph_mode = CUDAGraphMode.NONE",
        "cudagraph_mode NONE (no CUDA graphs)",
        "turn persistence off",
    ),
    "fused-allreduce-rms": (
        {"tensor_parallel_size": 2},
        "cfg.compilation_config.pass_config.fuse_allreduce_rms = True",
        "the fused all-reduce + RMSNorm pass (flashinfer) at tensor parallelism > 1",
        'turn it off with compilation_config={"pass_config": {"fuse_allreduce_rms": false}} (vllm serve: '
        "-cc.pass_config.fuse_allreduce_rms=false). Its automatic backend needs NVLink multicast, which hosts like "
        "ours do not have, and its IPC workspace is not persisted yet",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_unsupported_configuration_is_refused_naming_it(vllm: WarmPython, case: str) -> None:
    engine_args, change, what, advice = REFUSED[case]
    outcome = vllm.run(
        f"""
        cfg = engine_config(**{engine_args!r})
        {change}
        facts.refuse_unsupported(cfg)
        """
    )
    supported = (
        "supported with persistence: the V2 model runner (dense decoder models), cudagraph_mode FULL_AND_PIECEWISE "
        "(default), FULL_DECODE_ONLY or PIECEWISE, tensor parallelism on one node (custom all-reduce on "
        "or off), no pipeline/data/expert/context parallelism, no LoRA, no speculative decoding"
    )
    assert outcome.raised("Refused") == f"graphpersist: {what} cannot be persisted: {advice}. ({supported})"


def test_breakable_cuda_graphs_are_refused_as_vllm_reads_their_switch(vllm: WarmPython) -> None:
    """VLLM_USE_BREAKABLE_CUDAGRAPH=1 (vLLM also sets it itself for some models) makes the V2 runner capture its
    piecewise graphs outside the capture sites persistence sees: refused; any other value is vLLM's "off"."""
    for value in ("0", "true", ""):
        vllm.run(
            f"""
            env = {{"VLLM_USE_BREAKABLE_CUDAGRAPH": {value!r}}}
            facts.refuse_unsupported(engine_config(tensor_parallel_size=1), env)
            """
        ).ok()
    outcome = vllm.run(
        """
        facts.refuse_unsupported(engine_config(tensor_parallel_size=1), {"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"})
        """
    )
    refused = outcome.raised("Refused")
    assert refused.startswith("graphpersist: VLLM_USE_BREAKABLE_CUDAGRAPH=1 (breakable CUDA graphs"), refused
    assert "cannot be persisted: unset it, or set VLLM_USE_BREAKABLE_CUDAGRAPH=0." in refused, refused


@pytest.mark.parametrize(
    "engine_args, change",
    [
        ({}, ""),
        ({"tensor_parallel_size": 2}, ""),
        ({"tensor_parallel_size": 4}, ""),
        ({"tensor_parallel_size": 2}, "cfg.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY"),
        ({"tensor_parallel_size": 2}, "cfg.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE"),
    ],
    ids=["tp1", "tp2", "tp4", "full-decode-only", "piecewise"],
)
def test_supported_configuration_passes(vllm: WarmPython, engine_args: dict, change: str) -> None:
    got = vllm.run(
        f"""
        cfg = engine_config(**{engine_args!r})
        {change}
        facts.refuse_unsupported(cfg)
        result = "passed"
        """
    ).ok()
    assert got == "passed"


def test_v1_model_runner_is_refused(vllm: WarmPython) -> None:
    """Only a worker whose runner is the V2 runner's class (the one whose capture sites the series hooks) passes."""
    got = vllm.run(
        """
        import inspect
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2
        from vllm.v1.worker.gpu_worker import Worker

        out = {"builds_v2": "from vllm.v1.worker.gpu.model_runner import (" in inspect.getsource(Worker)}
        facts.refuse_unsupported_runner(types.SimpleNamespace(model_runner=V2.__new__(V2)))
        for label, runner in (("v1", V1.__new__(V1)), ("unknown", object())):
            try:
                facts.refuse_unsupported_runner(types.SimpleNamespace(model_runner=runner))
            except Exception as exc:
                out[label] = str(exc).split(". (")[0]
        result = out
        """
    ).ok()
    assert got["builds_v2"], "vLLM's Worker no longer builds its V2 runner from the class the runner check names"
    refusal = (
        "graphpersist: this model (it runs on vLLM's V1 model runner) cannot be persisted: serve a dense decoder "
        "model on the V2 runner, or set VLLM_USE_V2_MODEL_RUNNER=1 (vLLM 0.26.0 runs MoE models outside its V2 list, "
        "Qwen3-MoE among them, on V1 unless told)"
    )
    assert got["v1"] == got["unknown"] == refusal
    # the MoE recipe's refused SAVE (Qwen3-MoE on vLLM's default runner) looks for this refusal in the engine's log
    [moe_refused] = [r for r in tomllib.loads(MOE_RECIPE.read_text())["run"] if r.get("expect_refusal")]
    assert re.search(moe_refused["args"][moe_refused["args"].index("--expect-refusal") + 1], got["v1"])


# ---------------------------------------------------------------- SAVE's KV-cache budget

GIB, MIB = 1 << 30, 1 << 20


def test_a_budget_too_small_names_vllms_settings(vllm: WarmPython) -> None:
    """The session sizes the budget (tests/cpu/test_engine_session.py); vLLM's adapter says what to change."""
    message = vllm.run(
        """
        sess = open_session("save")
        sess.memory_budget(lambda: 300 * 2**20)
        """
    ).raised("PersistError")
    assert message == (
        "graphpersist: the memory profile leaves 300 MiB for the KV cache, less than the 1 GiB SAVE needs: raise "
        "gpu_memory_utilization or lower max_model_len/max_num_seqs"
    )


def test_every_rank_records_the_agreed_budget(vllm: WarmPython) -> None:
    """TP=1 uses its own profile; TP>1 gathers every rank's over vLLM's CPU group (a stand-in here: no process
    group on CPU), so every rank records (for LOAD) the same budget, among the flags it saves."""
    got = vllm.run(
        """
        one = open_session("save").memory_budget(lambda: 9 * 2**30 + 5)
        run.fresh()  # another process
        gathered = []
        VllmAdapter.cpu_gather = lambda self: (lambda mine: gathered.append(mine) or [mine, 8 * 2**30 + 7 * 2**20])
        two = open_session("save", world_size=2)
        result = [one, two.memory_budget(lambda: 9 * 2**30 + 5), gathered, two.budget_bytes]
        """
    ).ok()
    assert got == [9 * GIB, 8 * GIB, [9 * GIB + 5], 8 * GIB]


def test_ranks_agree_over_the_tp_groups_cpu_group_the_whole_world_here(vllm: WarmPython) -> None:
    """A world larger than tensor parallelism is refused at start-up, so the TP group's gloo group is every rank."""
    got = vllm.run(
        """
        from vllm.distributed import parallel_state
        parallel_state.get_tp_group = lambda: types.SimpleNamespace(cpu_group="tp gloo")
        engine.torch_gather = lambda group: ["gather over", group]
        result = VllmAdapter(None).cpu_gather()
        """
    ).ok()
    assert got == ["gather over", "tp gloo"]


# A stand-in for the V2 runner's profile path (CPU torch has no CUDA to run a real forward): the dummy forward takes
# its time (loading the compiled model, on a GPU), and the sampler run takes its own.
STAND_IN_RUNNER = """
import time
torch.cuda.synchronize = lambda: None
class Runner:
    def __init__(self):
        self.max_num_reqs = 256
        self.calls = []
    def _dummy_run(self, num_tokens, skip_attn=False, is_profile=False):
        self.calls.append(["forward", num_tokens, skip_attn, is_profile])
        time.sleep(0.1)
        return "hidden", "sample_hidden"
    def _dummy_sampler_run(self, hidden):
        self.calls.append(["sampler", hidden])
        time.sleep(0.05)
runner = Runner()
"""


def test_loads_compile_forward_reports_its_parts(vllm: WarmPython) -> None:
    """LOAD's profile phase: one token per request of the largest batch and the sampler on it (what the first greedy
    request needs); the parts are the forward (loading the compiled model included) and the sampler. Diagnosis's
    variants, which also split out what vLLM's compile monitor counted, live in tools/gpdiag
    (tests/cpu/test_gpdiag.py)."""
    got = vllm.run(
        STAND_IN_RUNNER
        + """
parts = facts.compile_forward(runner)
result = {"parts": parts, "calls": runner.calls}
"""
    ).ok()
    assert got["calls"] == [["forward", 256, True, True], ["sampler", "sample_hidden"]]
    assert sorted(got["parts"]) == ["forward", "sampler"]
    assert 0.1 <= got["parts"]["forward"] < 1
    assert 0.05 <= got["parts"]["sampler"] < 1


@pytest.mark.parametrize("mode", ["save", "load"])
def test_the_worker_pins_inductors_kernel_choices_and_counts_them_in_its_stats(vllm: WarmPython, mode: str) -> None:
    """SAVE's choices go into the rank's notes (the same table, filled as kernels are timed); LOAD's come from the
    notes the session read before setup; the stats the proof reads count them (graphpersist.graph.kernelchoice)."""
    got = vllm.run(
        f"""
from torch._inductor.runtime.triton_heuristics import CachingAutotuner
sess = open_session({mode!r})
sess.saved_notes = {{"kernel_choices": {{"cabc": {{"kernel": "k", "candidates": ["a"], "chosen": "a"}}}}}}
sess._pin_kernel_choices()
sess.run.kernel_choices.counts["pinned"] += 2
result = {{
    "wrapped": CachingAutotuner.autotune_to_one_config.__module__,
    "saved": dict(sess.run.kernel_choices.saved),
    "in_notes": sess.notes.get("kernel_choices") is sess.run.kernel_choices.used,
    "stats": sess.stats()["kernel_choices"],
}}
"""
    ).ok()
    assert got["wrapped"] == "graphpersist.graph.kernelchoice"
    assert got["stats"] == {"pinned": 2}
    assert got["in_notes"] is (mode == "save")
    assert got["saved"] == ({"cabc": {"kernel": "k", "candidates": ["a"], "chosen": "a"}} if mode == "load" else {})


# ---------------------------------------------------------------- persistence off: the capture sites are upstream's

# CPU torch cannot construct torch.cuda.CUDAGraph (a dummy class: "Tried to instantiate dummy base class"), so the
# snippets replace it, and the runtime's PersistentCUDAGraph, by plain stand-in classes: the class of what new_graph()
# returns shows which one a capture site would record into.
STAND_IN_GRAPHS = """
class UpstreamGraph:
    pass
class PersistentGraph:
    pass
torch.cuda.CUDAGraph = UpstreamGraph
from graphpersist import save
save.PersistentCUDAGraph = PersistentGraph
"""

# Opened before the stand-ins replace torch's graph class: a session counts captures on the real class.
SESSIONS = {
    "no-session": "",  # persistence off: no worker ever opens one
    "load": "open_session('load')",
    "save-written": "open_session('save').written = True",  # SAVE after its archive is written
}


@pytest.mark.parametrize("session", SESSIONS)
def test_capture_sites_without_an_active_save_do_what_upstream_does(vllm: WarmPython, session: str) -> None:
    got = vllm.run(
        SESSIONS[session]
        + STAND_IN_GRAPHS
        + """
capture.captured_full(Untouchable("manager"), Untouchable("desc"), Untouchable("graph"))
capture.captured_piece(Untouchable("wrapper"), Untouchable("entry"), (Untouchable("arg"),), Untouchable("output"))
ca = Recorder()
customar.register_graph_buffers(ca)
result = {"graph": type(capture.new_graph()).__name__, "custom_all_reduce": ca.calls}
"""
    ).ok()
    assert got == {
        "graph": "UpstreamGraph",
        "custom_all_reduce": ["get register_graph_buffers", "call register_graph_buffers [] {}"],
    }


def test_an_active_save_records_into_the_runtimes_graph(vllm: WarmPython) -> None:
    """The positive control of the test above: SAVE hands out the runtime's graph and does look at what a capture
    site reports (so Untouchable would catch a hook that acts while off)."""
    got = vllm.run(
        'open_session("save")'
        + STAND_IN_GRAPHS
        + """
out = {"graph": type(capture.new_graph()).__name__}
try:
    capture.captured_full(Untouchable("manager"), Untouchable("desc"), Untouchable("graph"))
except AssertionError as exc:
    out["touched"] = str(exc)
result = out
"""
    ).ok()
    assert got == {"graph": "PersistentGraph", "touched": "the hook touched desc.num_tokens"}


# The patched upstream files against the pristine ones: every difference (difflib's opcodes over lines) as (the
# upstream definition it lies in, lines removed, lines added). Anything else a patch changes in these files fails
# here; with persistence off the added calls are the hooks pinned down above.
PATCHED_LINES = {
    "vllm/compilation/cuda_graph.py": [
        ("<module>", [], ["from vllm import graphpersist_capture"]),
        (
            "CUDAGraphWrapper.__call__",
            ["            cudagraph = torch.cuda.CUDAGraph()"],
            ["            cudagraph = graphpersist_capture.new_graph()"],
        ),
        (
            "CUDAGraphWrapper.__call__",
            [],
            ["            graphpersist_capture.captured_piece(self, entry, args, output)"],
        ),
    ],
    "vllm/v1/worker/gpu/cudagraph_utils.py": [
        ("<module>", [], ["from vllm import graphpersist_capture"]),
        (
            "CudaGraphManager.capture",
            ["                        graph = torch.cuda.CUDAGraph()"],
            ["                        graph = graphpersist_capture.new_graph()"],
        ),
        (
            "CudaGraphManager.capture",
            [],
            ["                        graphpersist_capture.captured_full(self, desc, graph)"],
        ),
    ],
    "vllm/distributed/device_communicators/custom_all_reduce.py": [
        ("<module>", [], ["from vllm import graphpersist_customar"]),
        (
            "CustomAllreduce.capture",
            ["                self.register_graph_buffers()"],
            ["                graphpersist_customar.register_graph_buffers(self)"],
        ),
    ],
    "vllm/entrypoints/serve/utils/api_utils.py": [
        (
            "cli_env_setup",
            [],
            [
                "        from vllm.graphpersist_switch import note_cli_default_spawn",
                "",
                "        note_cli_default_spawn()",
            ],
        ),
    ],
    "vllm/utils/system_utils.py": [
        (
            "get_mp_context",
            ["    return multiprocessing.get_context(mp_method)"],
            [
                "    from vllm.graphpersist_switch import mp_context",
                "",
                "    return mp_context(mp_method)",
            ],
        ),
    ],
    "vllm/v1/engine/utils.py": [
        (
            "wait_for_engine_startup",
            ["            raise RuntimeError("],
            [
                "            from graphpersist.engine import refusal_or",
                "",
                "            raise refusal_or(RuntimeError(",
            ],
        ),
        ("wait_for_engine_startup", ["            )"], ["            ))"]),
    ],
    "vllm/engine/arg_utils.py": [
        (
            "EngineArgs",
            [],
            [
                "    graph_persist: str | None = None",
                '    """CUDA-graph persistence mode (off, save, load); None defers to',
                '    GRAPHPERSIST_MODE. See vllm/graphpersist_switch.py."""',
                "    graph_persist_dir: str | None = None",
                '    """Archive directory for graph_persist save/load; None defers to',
                '    GRAPHPERSIST_DIR."""',
            ],
        ),
        (
            "EngineArgs.__post_init__",
            [],
            [
                "        from vllm.graphpersist_switch import resolve_engine_args",
                "",
                "        resolve_engine_args(self)",
                "",
            ],
        ),
        (
            "EngineArgs.add_cli_args",
            [],
            [
                "",
                "        from vllm.graphpersist_switch import add_cli_args as add_graph_persist_args",
                "",
                "        add_graph_persist_args(parser)",
            ],
        ),
    ],
}


def _definition_at(source: str, line: int) -> str:
    """The qualified name of the innermost class or function of `source` holding `line` (1-based)."""
    names: list[str] = []
    body = ast.parse(source).body
    while True:
        inner = [
            node
            for node in body
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.lineno <= line <= (node.end_lineno or node.lineno)
        ]
        if not inner:
            return ".".join(names) or "<module>"
        names.append(inner[0].name)
        body = inner[0].body


def test_patched_files_differ_from_upstream_only_by_the_hooks(
    dist_dir: Path, upstream_tree: Callable[[str], Path], repo_root: Path
) -> None:
    series = (repo_root / "patches" / "vllm" / "series").read_text().split()
    touched = {
        line[len("+++ b/") :]
        for name in series
        for line in (repo_root / "patches" / "vllm" / name).read_text().splitlines()
        if line.startswith("+++ b/")
    }
    assert touched == set(PATCHED_LINES), "the series edits other files than this test pins down"
    [wheel] = [w for w in built_wheels(dist_dir) if w.name.startswith("vllm-")]
    pristine = upstream_tree("vllm")
    with zipfile.ZipFile(wheel) as zf:
        for path, expected in PATCHED_LINES.items():
            ours = zf.read(path).decode().splitlines()
            upstream = (pristine / path).read_text()
            theirs = upstream.splitlines()
            matcher = difflib.SequenceMatcher(None, theirs, ours, autojunk=False)
            edits = [
                (_definition_at(upstream, max(i1, 1)), theirs[i1:i2], ours[j1:j2])  # i1: the line before the edit
                for tag, i1, i2, j1, j2 in matcher.get_opcodes()
                if tag != "equal"
            ]
            assert edits == expected, f"{path}: the patched file differs from upstream by more than its hooks"


# ---------------------------------------------------------------- LOAD installs exactly the inventory SAVE recorded


def test_save_records_every_graph_vllm_captures(vllm: WarmPython) -> None:
    got = vllm.run(
        """
        cfg = engine_config()
        manager = graph_manager(cfg)
        notes, saver = record_save(manager, piece_wrappers(cfg, 3))
        result = {
            "notes": notes,
            "added": [
                {"name": a["name"], "mode": a["mode"], "capture_size": a["capture_size"],
                 "inputs": [tuple(t.shape) for t in a["inputs"]], "output_is_hidden_states":
                 a["outputs"] is manager.hidden_states, "instantiated": a["graph"].instantiated}
                for a in saver.added
            ],
        }
        """
    ).ok()
    sizes = [8, 4, 2, 1]  # vLLM's capture order: largest first
    full = [f"full/{n}/{n}/1" for n in sizes]
    pieces = [f"piecewise/{n}/{i:03d}" for n in sizes for i in range(3)]
    assert [a["name"] for a in got["added"]] == full + pieces
    for added in got["added"]:
        is_full = added["name"].startswith("full/")
        assert added["mode"] == ("full" if is_full else "piecewise")
        assert added["capture_size"] == int(added["name"].split("/")[1])
        assert added["inputs"] == ([] if is_full else [[added["capture_size"]]])  # tensors only, not the int
        assert added["output_is_hidden_states"] is is_full
        assert added["instantiated"] == 1
    assert got["notes"]["full"]["full/8/8/1"] == {
        "cg_mode": "FULL",
        "num_tokens": 8,
        "num_reqs": 8,
        "uniform_token_count": 1,
        "num_active_loras": 0,
    }
    assert set(got["notes"]["pieces"]) == set(pieces)
    assert got["notes"]["pieces"]["piecewise/4/002"] == {
        "num_tokens": 4,
        "num_reqs": None,
        "uniform": False,
        "has_lora": False,
        "num_active_loras": 0,
    }


# LOAD in a new process: the same configuration's manager and wrappers, the restored graphs by name.
LOAD = """
cfg = engine_config()
wrappers = piece_wrappers(cfg, 3)
notes, _ = record_save(graph_manager(cfg), wrappers)
manager = graph_manager(cfg)
restored = {name: types.SimpleNamespace(outputs=torch.zeros(1)) for kind in notes.values() for name in kind}
"""


def test_load_installs_every_graph_where_vllm_dispatches(vllm: WarmPython) -> None:
    got = vllm.run(
        LOAD
        + """
installed = capture.install(manager, restored, notes)
pieces = {}
for w in wrappers:
    for bd, entry in w.concrete_cudagraph_entries.items():
        name = capture.piece_name(bd, w.runnable.piecewise_compile_index)
        assert entry.batch_descriptor == bd and entry.cudagraph is restored[name]
        assert entry.output is restored[name].outputs
        pieces[name] = bd.num_tokens
result = {
    "installed": installed,
    "full": sorted(capture.full_name(d) for d in manager.graphs),
    "full_graphs_are_restored": all(g is restored[capture.full_name(d)] for d, g in manager.graphs.items()),
    "full_keys_are_vllms": set(manager.graphs) == set(manager._capture_descs[CUDAGraphMode.FULL]),
    "hidden_states_restored": any(manager.hidden_states is g.outputs for g in restored.values()),
    "captured": manager._graphs_captured,
    "pieces": pieces,
}
"""
    ).ok()
    sizes = [1, 2, 4, 8]
    assert got == {
        "installed": 4 + 4 * 3,
        "full": sorted(f"full/{n}/{n}/1" for n in sizes),
        "full_graphs_are_restored": True,
        "full_keys_are_vllms": True,
        "hidden_states_restored": True,
        "captured": True,
        "pieces": {f"piecewise/{n}/{i:03d}": n for n in sizes for i in range(3)},
    }


def test_under_the_v2_runner_every_cuda_graph_wrapper_is_a_piece(upstream_tree: Callable[[str], Path]) -> None:
    """LOAD keys every live CUDAGraphWrapper by its piece index: vLLM 0.26.0 makes a FULL one only in its V1 runner
    (refused) and its dual-batch wrapper (V1's); torch.compile's backends make PIECEWISE ones."""
    vllm_root = upstream_tree("vllm") / "vllm"
    made = {}
    for path in sorted(vllm_root.rglob("*.py")):
        for mode in re.findall(r"(?:CUDAGraphWrapper|static_graph_wrapper_class)\((?:[^()]|\([^()]*\))*?"
                               r"runtime_mode=(?:CUDAGraphMode\.)?(\w+)", path.read_text()):  # fmt: skip
            made.setdefault(str(path.relative_to(vllm_root)), set()).add(mode)
    full = sorted(p for p, modes in made.items() if modes - {"PIECEWISE"})
    assert full == ["v1/worker/gpu_model_runner.py", "v1/worker/gpu_ubatch_wrapper.py"], made
    assert not any(p.startswith("v1/worker/gpu/") for p in made)


def test_replay_timing_replays_the_smallest_full_graph_and_one_round_of_every_piece(vllm: WarmPython) -> None:
    """The driver's --replay-timing (tools/gpdiag/vllm_replaytime.py) times what vLLM dispatches to: the smallest FULL
    graph, and every piece, in piece order, at the smallest size every piece has (the timing itself needs a GPU)."""
    got = vllm.run(
        LOAD
        + f"import sys\nsys.path.insert(0, {str(TOOLS)!r})\n"
        + """
import functools
from gpdiag import vllm_replaytime as rt
replayed = []
for name, graph in restored.items():
    graph.replay = functools.partial(replayed.append, name)
capture.install(manager, restored, notes)
entries = wrappers[1].concrete_cudagraph_entries
del entries[next(bd for bd in entries if bd.num_tokens == 1)]  # piece 1 lacks size 1: no round at 1
timed = []
rt._time = lambda replays, rounds: (timed.append(rounds), [r() for r in replays], {"submit_us": 1.0})[2]
runner = types.SimpleNamespace(cudagraph_manager=manager)
result = {"full": rt._full(runner, 7), "pieces": rt._pieces(7), "replayed": replayed, "rounds": timed}
"""
    ).ok()
    assert got == {
        "full": {"tokens": 1, "type": "SimpleNamespace", "submit_us": 1.0},
        "pieces": {"tokens": 2, "type": "SimpleNamespace", "submit_us": 1.0},
        "replayed": ["full/1/1/1", "piecewise/2/000", "piecewise/2/001", "piecewise/2/002"],
        "rounds": [7, 7],
    }


ADVICE = "Re-run with mode=save for this configuration."
INVENTORY_REFUSALS = {
    "full-missing": (
        'del notes["full"]["full/8/8/1"]',
        "graphpersist: FULL graphs differ: not in the archive ['full/8/8/1'], saved but not replayed by this "
        f"configuration none. {ADVICE}",
    ),
    "full-extra": (
        'notes["full"]["full/16/16/1"] = {**notes["full"]["full/8/8/1"], "num_tokens": 16, "num_reqs": 16}',
        "graphpersist: FULL graphs differ: not in the archive none, saved but not replayed by this configuration "
        f"['full/16/16/1']. {ADVICE}",
    ),
    "full-descriptor": (
        'notes["full"]["full/2/2/1"]["num_active_loras"] = 1',
        "graphpersist: FULL graph full/2/2/1: saved descriptor BatchExecutionDescriptor(cg_mode=<CUDAGraphMode.FULL: "
        "2>, num_tokens=2, num_reqs=2, uniform_token_count=1, num_active_loras=1), live BatchExecutionDescriptor("
        "cg_mode=<CUDAGraphMode.FULL: 2>, num_tokens=2, num_reqs=2, uniform_token_count=1, num_active_loras=0). "
        f"{ADVICE}",
    ),
    "piece-missing": (
        'del notes["pieces"]["piecewise/4/002"]',
        "graphpersist: piecewise (3 live pieces x 4 sizes) graphs differ: not in the archive ['piecewise/4/002'], "
        f"saved but not replayed by this configuration none. {ADVICE}",
    ),
    "more-live-pieces": (
        "wrappers += piece_wrappers(cfg, 4)[3:]",
        "graphpersist: piecewise (4 live pieces x 4 sizes) graphs differ: not in the archive ['piecewise/1/003', "
        f"'piecewise/2/003', 'piecewise/4/003', 'piecewise/8/003'], saved but not replayed by this configuration none. "
        f"{ADVICE}",
    ),
    "fewer-live-pieces": (
        "import gc; del wrappers[2]; gc.collect()",  # _all_instances holds the wrappers weakly
        "graphpersist: piecewise (2 live pieces x 4 sizes) graphs differ: not in the archive none, saved but not "
        "replayed by this configuration ['piecewise/1/002', 'piecewise/2/002', 'piecewise/4/002', 'piecewise/8/002']. "
        f"{ADVICE}",
    ),
    "piece-without-index": (
        "wrappers.append(CUDAGraphWrapper(types.SimpleNamespace(), cfg, CUDAGraphMode.PIECEWISE))",
        "graphpersist: a piecewise CUDA graph wraps SimpleNamespace, which has no piecewise_compile_index: only "
        "torch.compile's piecewise backend can be persisted (refused)",
    ),
}


@pytest.mark.parametrize("case", INVENTORY_REFUSALS)
def test_load_refuses_an_inventory_that_differs(vllm: WarmPython, case: str) -> None:
    change, message = INVENTORY_REFUSALS[case]
    outcome = vllm.run(LOAD + change + "\ncapture.install(manager, restored, notes)\n")
    assert outcome.raised("PersistError") == message


# ---------------------------------------------------------------- LOAD compares the archive's vLLM facts early

# What SAVE adds to the flags after setup (VllmAdapter.flags); the early check before setup does not know them yet.
POST_SETUP_FLAGS = {
    "cudagraph_mode": "FULL_AND_PIECEWISE",
    "attention_backends": ["FLASH_ATTN"],
    "custom_all_reduce": False,
    "vllm_config_hash": "0" * 64,
}


def early_check_snippet(
    saved_args: dict, live_args: dict, archive: Path, kv_flag: str = "8 * 2**30", saved_quantization: str = ""
) -> str:
    """SAVE of `saved_args` writes `archive`; LOAD of `live_args` runs the worker's early check on it. CPU torch
    has no CUDA device: torch.cuda.current_device() (which the early check passes on) is stood in by device 0.
    `saved_quantization`: the quantization SAVE's model config holds (set on the resolved config: vLLM's CPU test
    venv lacks compressed_tensors, which resolving a quantized config imports)."""
    return f"""
saved = engine_config(**{saved_args!r})
if {saved_quantization!r}:
    saved.model_config.quantization = {saved_quantization!r}
flags = {{**adapter(saved).config_flags(), **{POST_SETUP_FLAGS!r}, "memory_budget_bytes": {kv_flag}}}
if flags["memory_budget_bytes"] is None:
    del flags["memory_budget_bytes"]
notes = {{"kernel_choices": {{"c4f2": {{"kernel": "triton_red_fused_0", "candidates": ["a", "b"], "chosen": "b"}}}}}}
write_vllm_archive(Path({str(archive)!r}), saved, flags, notes=notes)
live = engine_config(**{live_args!r})
torch.cuda.current_device = lambda: 0
sess = open_session("load", {str(archive)!r}, cfg=live)
sess._check_before_setup()
sess.start_reading_ahead()
ahead = sess.read_ahead
result = {{"kv_bytes": sess.saved_budget, "model": sess.model, "notes": sess.saved_notes,
          "ahead": [str(ahead.directory), ahead.rank, ahead.archive_for(ahead.directory, ahead.rank) is not None]}}
"""


def test_early_check_accepts_the_configuration_it_saved(vllm: WarmPython, tmp_path: Path) -> None:
    args = {"max_model_len": 4096, "tensor_parallel_size": 2, "dtype": "float16"}
    got = vllm.run(early_check_snippet(args, args, tmp_path / "archive")).ok()
    assert got["kv_bytes"] == 8 * GIB  # LOAD reuses SAVE's budget instead of profiling
    assert got["model"]["dtype"] == "torch.float16"
    # the rank's notes are read this early: the kernel choices LOAD launches before it restores any graph
    assert got["notes"] == {"kernel_choices": {"c4f2": {"kernel": "triton_red_fused_0", "candidates": ["a", "b"],
                                                        "chosen": "b"}}}  # fmt: skip
    assert got["ahead"] == [str(tmp_path / "archive"), 0, True]  # the restore's reading began beside the start


def test_early_check_refuses_another_configuration_naming_every_fact(vllm: WarmPython, tmp_path: Path) -> None:
    saved = {"max_model_len": 4096}
    live = {"max_model_len": 8192, "tensor_parallel_size": 2, "dtype": "float16"}
    message = vllm.run(early_check_snippet(saved, live, tmp_path / "archive")).raised("LoadRefused")
    lines = message.splitlines()
    assert lines[0] == f"graphpersist: cannot LOAD {tmp_path / 'archive'} (rank 0): 5 mismatches"
    assert lines[-1] == ADVICE
    [fingerprint] = [x for x in lines if x.startswith("  model.config_fingerprint: ")]
    saved_hash, live_hash = re.fullmatch(
        r"  model.config_fingerprint: saved '(\w{64})', live '(\w{64})'", fingerprint
    ).groups()
    assert saved_hash != live_hash
    assert lines[1:-1] == [
        "  parallel.world_size: saved 1, live 2",
        "  parallel.tp_size: saved 1, live 2",
        "  model.dtype: saved 'torch.bfloat16', live 'torch.float16'",
        "  flags.max_model_len: saved 4096, live 8192",
        fingerprint,  # a digest of the others: last (archive.validate.DIGESTS)
    ]


@pytest.mark.parametrize(
    "saved, live, line",
    [
        ({"kv_cache_dtype": "fp8"}, {}, "  flags.kv_cache_dtype: saved 'fp8', live 'auto'"),
        ({"max_model_len": 8192}, {"max_model_len": 4096}, "  flags.max_model_len: saved 8192, live 4096"),
        ({}, {}, "  flags.quantization: saved 'fp8', live <unset>"),  # SAVE's config quantized (saved_quantization)
    ],
    ids=["kv_cache_dtype", "max_model_len", "quantization"],
)
def test_early_check_refuses_another_model_case_naming_the_setting(
    vllm: WarmPython, tmp_path: Path, saved: dict, live: dict, line: str
) -> None:
    """Issue 34's cases (FP8 KV cache, long context, FP8 weights): a LOAD whose setting differs from its SAVE's is
    refused before setup, naming the setting with the saved and the live value (vLLM resolves both configs)."""
    quantized = "fp8" if "quantization" in line else ""
    assert vllm.run(early_check_snippet(saved, saved, tmp_path / "same")).ok()["kv_bytes"] == 8 * GIB
    snippet = early_check_snippet(saved, live, tmp_path / "archive", saved_quantization=quantized)
    message = vllm.run(snippet).raised("LoadRefused")
    lines = message.splitlines()
    assert lines[0].startswith(f"graphpersist: cannot LOAD {tmp_path / 'archive'} (rank 0): ")
    assert line in lines[1:-1]
    # only the setting and what vLLM derives from it (the model's config hash includes its quantization)
    assert {x.split(":")[0].strip() for x in lines[1:-1]} <= {line.split(":")[0].strip(), "model.config_fingerprint"}


@pytest.mark.parametrize("kv_flag, shown", [("None", "None"), ("0", "0")])
def test_early_check_refuses_an_archive_without_a_kv_budget(
    vllm: WarmPython, tmp_path: Path, kv_flag: str, shown: str
) -> None:
    archive = tmp_path / "archive"
    message = vllm.run(early_check_snippet({}, {}, archive, kv_flag=kv_flag)).raised("PersistError")
    assert message == (
        f"graphpersist: {archive} records no memory budget (flags.memory_budget_bytes = {shown}). "
        "Re-run with mode=save."
    )


def test_early_check_refuses_a_folder_that_is_no_archive(vllm: WarmPython, tmp_path: Path) -> None:
    message = vllm.run(
        f"""
        torch.cuda.current_device = lambda: 0
        open_session("load", {str(tmp_path)!r})._check_before_setup()
        """
    ).raised("PersistError")
    assert message.startswith(f"graphpersist: cannot LOAD {tmp_path}: ")
    assert "manifest.json" in message


def test_custom_all_reduce_peer_slots_past_the_world_size_are_written_as_zeros(vllm: WarmPython) -> None:
    """Two TP=2 SAVEs differed in every graph: `cross_device_reduce_1stage<bf16, 2>` gets 8 peer pointers by value,
    2 of them set, the rest whatever the heap held (bytes 32-79 of its parameters on the reference host)."""
    kernel = (
        "_ZN4vllm26cross_device_reduce_1stageI13__nv_bfloat16Li2EEEvPNS_8RankDataENS_11RankSignalsEPNS_6SignalEPT_ii"
    )
    layout = [[0, 8], [16, 64], [80, 8], [88, 8], [96, 4], [100, 4]]
    got = vllm.run(
        f"""
        from vllm import graphpersist_customar as customar
        from graphpersist.graph import walk as graphwalk
        layout = [tuple(x) for x in {layout!r}]
        eight = {kernel!r}.replace("Li2EE", "Li8EE")
        try:
            customar.unused_param_bytes({kernel!r}, [(0, 8), (8, 32)])
            wrong = None
        except Exception as exc:
            wrong = str(exc)
        sess = open_session("save", ".", world_size=2)
        unused = graphwalk.cached_unused(sess.saver.unused_param_bytes)
        params = graphwalk.zero_ranges(bytes(range(104)), unused({kernel!r}, layout))
        result = {{
            "tp2": customar.unused_param_bytes({kernel!r}, layout),
            "tp8": customar.unused_param_bytes(eight, layout),
            "other": customar.unused_param_bytes("_ZN4vllm15rms_norm_kernelIfLi8ELi1EEEvPT_PKS1_S4_fii", layout),
            "wrong": wrong,
            "params": list(params),
        }}
        """
    ).ok()
    assert got["tp2"] == [[32, 80]] or got["tp2"] == [(32, 80)]
    assert got["tp8"] == [] and got["other"] == []
    assert "has a 32-byte RankSignals parameter for 2 GPUs" in got["wrong"]
    assert got["params"] == [*range(32), *([0] * 48), *range(80, 104)]


def test_fa3_combine_padding_is_written_as_zeros(vllm: WarmPython) -> None:
    """Two TP=1 SAVEs differed in the FA3 split-KV combine's parameter bytes 36-39 (padding after its five-int32
    shape), forming the in-region word 0x500300000001 at bytes 32-39; the session's SAVE zeroes those bytes and the
    padding after `int batch_size` (4-7), and leaves the rest."""
    kernel = (
        "_ZN7cutlass13device_kernelIN5flash19FlashAttnFwdCombineIN4cute5tupleIJNS3_1CILi8EEENS5_ILi128EEEEEELi5ELi256"
        "ELi1ELb0ELb1ENS_10bfloat16_tEfNS_4arch4Sm90EEEEEvNT_6ParamsE"
    )
    got = vllm.run(
        f"""
        from graphpersist.graph import walk as graphwalk
        sess = open_session("save", ".")
        unused = graphwalk.cached_unused(sess.saver.unused_param_bytes)
        raw = bytearray(range(64))
        raw[32:40] = (0x500300000001).to_bytes(8, "little")
        result = {{
            "params": list(graphwalk.zero_ranges(bytes(raw), unused({kernel!r}, [(0, 64)]))),
            "short": unused({kernel!r}, [(0, 32)]),
            "other": unused("_ZN4vllm15rms_norm_kernelIfLi8ELi1EEEvPT_PKS1_S4_fii", [(0, 8), (8, 8)]),
        }}
        """
    ).ok()
    assert got["params"] == [0, 1, 2, 3, 0, 0, 0, 0, *range(8, 32), 1, 0, 0, 0, 0, 0, 0, 0, *range(40, 64)]
    assert got["short"] == []  # a parameter block too short to be these Params is left alone
    assert got["other"] == []


# ---------------------------------------------------------------- the session: one per process, diagnosis from outside


def test_two_sessions_in_one_process_share_nothing(vllm: WarmPython, tmp_path: Path) -> None:
    """A session holds the whole run: a SAVE's notes, timings and counts never show in another session; the
    process-wide slot names the active one, and a second open while one is active is refused."""
    got = vllm.run(
        f"""
        save = open_session("save", {str(tmp_path / "a")!r})
        save.notes["full"]["full/1/1/1"] = {{"num_tokens": 1}}
        save.timed("capture", 0.0)
        save.captured = 3
        try:
            open_session("load", {str(tmp_path)!r}, world_size=2)
            second = None
        except Exception as exc:
            second = f"{{type(exc).__name__}}: {{exc}}"
        run.fresh()  # SAVE's process ends: nothing of its run remains
        load = open_session("load", {str(tmp_path)!r})
        with run.activated(save.run):
            inside = engine.current() is save
        result = {{
            "second": second,
            "load": [load.notes, sorted(load.timings.keys() - {{"process_start"}}), load.captured, load.saver is None],
            "save": [sorted(save.notes["full"]), "capture" in save.timings, save.captured],
            "active": [inside, engine.current() is load],
        }}
        """
    ).ok()
    assert got["second"] == (
        "PersistError: graphpersist: a second vllm model runner in one process (a draft model?) cannot be persisted: "
        "serve without speculative decoding"
    )
    assert got["load"] == [{"full": {}, "pieces": {}}, [], 0, True]
    assert got["save"] == [["full/1/1/1"], True, 3]
    assert got["active"] == [True, True]


def test_gpdiag_wraps_the_workers_steps_from_outside(vllm: WarmPython, tmp_path: Path) -> None:
    """tools/gpdiag/vllm.py (what a diagnosis run's sitecustomize installs): LOAD's profile forward becomes the chosen
    variant (GP_DIAG_LOAD_PROFILE), LOAD runs SAVE's kernel warm-up too (GP_DIAG_EXTRA_WARMUP), and the session's
    steps are wrapped; the product keeps no hook for it."""
    got = vllm.run(
        f"""
        sys.path.insert(0, {str(TOOLS)!r})
        os.environ.update(GP_DIAG_EXTRA_WARMUP="1", GP_DIAG_LOAD_PROFILE="full")
        from gpdiag import vllm as diag
        from vllm import graphpersist_worker
        diag.install()
        diag.install()  # a second install wraps nothing twice
        diag._wire_worker(graphpersist_worker.PersistWorker)
        cls = engine.PersistSession
        warmed = []
        worker = graphpersist_worker.PersistWorker.__new__(graphpersist_worker.PersistWorker)
        worker._persist = open_session("load", {str(tmp_path)!r})
        worker._kernel_warmup = lambda: warmed.append("kernel warm-up")
        worker._warm_up_before_graphs()
        result = {{
            "wrapped": [getattr(getattr(cls, n), "_gpdiag", False) for n in ("begin", "_save", "_restore", "ready")],
            "forward": facts.compile_forward.func.__name__ + ":" + facts.compile_forward.args[0],
            "warmed": warmed,
        }}
        """
    ).ok()
    assert got == {"wrapped": [True] * 4, "forward": "profile_forward:full", "warmed": ["kernel warm-up"]}


def test_gpdiag_pieces_wraps_vllms_compile_steps_and_reuses_only_where_vllms_cache_has_no_entry(
    vllm: WarmPython, tmp_path: Path
) -> None:
    """tools/gpdiag/vllm_pieces.py (GP_DIAG_PIECES=reuse) on vLLM's own classes: the compile call, the split, the AOT
    load and its finalize_loading are wrapped once; a real CompilerManager that read vLLM's cache file hands a piece
    the file lists to upstream, and a piece it does not list the recorded artifact, without compiling."""
    got = vllm.run(
        f"""
        sys.path.insert(0, {str(TOOLS)!r})
        from gpdiag import vllm_pieces
        from vllm.compilation import backends, caching, decorators
        from vllm.compilation.counter import compilation_counter
        from vllm.config.utils import Range

        vllm_pieces.install("reuse")
        vllm_pieces.install("reuse")  # a second install wraps nothing twice
        folder = Path({str(tmp_path)!r}) / "rank_0_0" / "backbone"
        folder.mkdir(parents=True)
        (folder / "vllm_compile_cache.py").write_text(
            "{{((1, 16384), 0, 'inductor_standalone'): {{'graph_handle': ('k', 'p'), 'cache_key': 'a-first'}}}}")
        vllm_pieces.write_keys(folder / vllm_pieces.KEYS_FILE, {{"1-16384/0": "a-first", "1-16384/2": "a-mid"}})
        comp = engine_config().compilation_config
        comp.backend = "inductor"
        manager = backends.CompilerManager(comp)
        manager.initialize_cache(str(folder), False, "backbone")
        manager.loaded_artifacts.update({{"a-first": "first artifact", "a-mid": "middle artifact"}})

        def refuse(*args, **kwargs):
            raise AssertionError("Inductor was asked to compile")

        manager.compiler.compile = refuse
        before = compilation_counter.num_backend_compilations
        whole = Range(start=1, end=16384)
        result = {{
            "wrapped": [getattr(f, "_gpdiag", False) for f in (backends.CompilerManager.compile, backends.split_graph,
                        decorators._try_load_aot_compiled_fn, caching.VllmSerializableFunction.finalize_loading)],
            "listed": vllm_pieces.reusable(manager, whole, 0, vllm_pieces._keys_of(manager)),
            "middle": manager.compile(None, [], {{}}, comp, compile_range=whole, graph_index=2, num_graphs=3),
            "counted": compilation_counter.num_backend_compilations - before,
            "reused": len(vllm_pieces._tally.seconds["reused"]),
        }}
        """
    ).ok()
    assert got == {"wrapped": [True] * 4, "listed": None, "middle": "middle artifact", "counted": 1, "reused": 1}


COMPILED = """
import os
os.environ["VLLM_USE_MEGA_AOT_ARTIFACT"] = "0"  # torch 2.11's path (the bundle's); this venv's torch would default to 1
os.environ["VLLM_CACHE_ROOT"] = str(work / "cache")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(work / "cache" / "inductor")
from vllm import graphpersist_compiled as compiled
from vllm.compilation.backends import VllmBackend
from vllm.compilation.caching import VllmSerializableFunction as Fn
from vllm.compilation.passes.utility.fix_functionalization import FixFunctionalizationPass
from vllm.config import CompilationConfig, CompilationMode, set_current_vllm_config

# CPU stand-in: this pass names vLLM's CUDA-only _C operators, which a CPU install lacks
FixFunctionalizationPass.__call__ = lambda self, graph: None


@torch.library.custom_op("gptest::attn", mutates_args=())
def attn(x: torch.Tensor) -> torch.Tensor:  # where vLLM splits the model, as at its attention
    return x * 2


@attn.register_fake
def _(x):
    return torch.empty_like(x)


class Model(torch.nn.Module):  # four compiled pieces; the two middle ones are equal (one artifact, one not listed)
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        y = torch.ops.gptest.attn(self.a(x).relu())
        y = torch.ops.gptest.attn(self.b(y) + 1)
        y = torch.ops.gptest.attn(self.b(y) + 1)
        return y.sin()


def config():
    return VllmConfig(compilation_config=CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE, splitting_ops=["gptest::attn"], cudagraph_mode=CUDAGraphMode.NONE,
        backend="inductor", compile_sizes=[], pass_config={"fuse_rope_kvcache_cat_mla": False}))


def persisting(mode, notes=None):
    sess = engine.PersistSession(adapter(), switch.Mode(mode), Path("/nonexistent-archive"), 0, 1)
    sess.saved_notes = notes or {}
    sess.activate()
    compiled.install(sess)
    return sess
"""

COMPILED_SAVE = """
torch.manual_seed(0)
model, x, made = Model(), torch.randn(5, 8), {}
save = persisting("save")
with set_current_vllm_config(config()):  # vLLM's backend compiles the model with Inductor, as at SAVE
    backend = VllmBackend(config(), prefix="backbone")

    def compile_model(graph, example_inputs):
        made["inputs"] = [5 if isinstance(i, torch.SymInt) else i for i in example_inputs]
        made["fn"] = backend(graph, example_inputs)
        return made["fn"]

    saved_out = torch.compile(model, backend=compile_model, dynamic=True, fullgraph=True)(x)
(work / "model").write_bytes(Fn.serialize_compile_artifacts(made["fn"]))
(work / "notes.json").write_text(json.dumps(save.notes))  # as the archive stores them
torch.save({"inputs": made["inputs"], "saved": saved_out, "eager": model(x).detach(),
            "aot_autograd_config": made["fn"].aot_autograd_config}, work / "io.pt")
result = backend.compiler_manager.cache_dir
"""

COMPILED_LOAD = """
notes, io = json.loads((work / "notes.json").read_text()), torch.load(work / "io.pt", weights_only=False)
sess, cfg = persisting("load", edit(notes)), config()
# another functorch setting than vLLM compiled under (the model file keeps those): vLLM's own load names the compile
# cache folder under the saved ones, and so must the notes' path
torch._functorch.config.debug_partitioner = not io["aot_autograd_config"]["debug_partitioner"]
with set_current_vllm_config(cfg):
    fn = Fn.deserialize_compile_artifacts((work / "model").read_bytes())
fn.finalize_loading(cfg)
out = fn.optimized_call(*io["inputs"])[0]
made = sess.stats_extra.get(compiled.NOTES_KEY, {}).get("backbone", {})
result = {
    "equal": [torch.equal(out, io["saved"]), torch.allclose(out, io["eager"])],
    "graph": "GraphModule" if isinstance(fn.graph_module, torch.fx.GraphModule) else type(fn.graph_module).__name__,
    "built": made.get("built_from_notes"),
    "why_not": made.get("why_not"),
    "folder": cfg.compilation_config.local_cache_dir,
    "notes": notes[compiled.NOTES_KEY],
}
"""

LOAD_CASES = {
    "notes": "lambda notes: notes",
    "moved": "lambda notes: {**notes, compiled.NOTES_KEY: {'backbone': {**notes[compiled.NOTES_KEY]['backbone'], "
    "'folder': '0123456789/rank_0_0/backbone'}}}",
    "unkeyed": "lambda notes: {compiled.NOTES_KEY: {'backbone': {**notes[compiled.NOTES_KEY]['backbone'], "
    "'pieces': [[*piece[:3], {}] for piece in notes[compiled.NOTES_KEY]['backbone']['pieces']]}}}",
    "none": "lambda notes: {}",
}


def test_load_builds_the_compiled_model_from_saves_notes_without_its_dynamo_graph(
    vllm: WarmPython, tmp_path: Path
) -> None:
    """overlays/vllm/vllm/graphpersist_compiled.py on vLLM's own backend, Inductor and model file (CPU): SAVE notes
    each compiled piece; a LOAD in another process builds the model from the notes and vLLM's cache file without
    unpickling the Dynamo graph, and computes what vLLM's path computes; the piece vLLM's cache file does not list gets
    the artifact under the key SAVE noted for it. Notes of another compile cache folder, without that key, or none,
    take vLLM's path."""
    work = f"work = Path({str(tmp_path)!r})\n"
    folder = vllm.run(work + COMPILED + COMPILED_SAVE).ok()
    got = {
        case: vllm.run(work + f"edit = {edit}\n" + COMPILED + COMPILED_LOAD).ok() for case, edit in LOAD_CASES.items()
    }
    plan = got["notes"]["notes"]["backbone"]
    assert [name for name, *_ in plan["pieces"]] == ["submod_0", "submod_2", "submod_4", "submod_6"]
    assert all(sym == [1] and returns for _, sym, returns, _ in plan["pieces"])  # the batch size is argument 1
    keys = [list(by_range.values()) for *_, by_range in plan["pieces"]]  # one compile range, one key each
    assert [len(k) for k in keys] == [1] * 4 and keys[1] == keys[2] and len({k[0] for k in keys}) == 3  # 2, 4 equal
    assert plan["folder"] == "/".join(Path(folder).parts[-3:]) and plan["folder"].endswith("/rank_0_0/backbone")
    assert {k: v for k, v in got["notes"].items() if k != "notes"} == {
        "equal": [True, True],
        "graph": "_Unread",
        "built": True,
        "why_not": "",
        "folder": folder,  # the compile cache folder vLLM's backend would have set
    }
    for fallback in (got["moved"], got["unkeyed"], got["none"]):  # vLLM's path: the graph unpickled, nothing built
        assert fallback["equal"] == [True, True] and fallback["graph"] == "GraphModule"
    assert got["moved"]["built"] is False and got["unkeyed"]["built"] is False and got["none"]["built"] is None
    assert got["moved"]["why_not"] == f"compile cache folder {plan['folder']}, SAVE's 0123456789/rank_0_0/backbone"
    assert got["unkeyed"]["why_not"].startswith("1 artifact(s) neither listed in vLLM's cache file nor noted, e.g. ")


IMPORTED_AT_INSTALL = """
import json, sys, types
from vllm import graphpersist_compiled as compiled

before = set(list(sys.modules))
compiled.install(types.SimpleNamespace(loading=sys.argv[1] == "load", saved_notes={}))
print(json.dumps(sorted(m for m in list(sys.modules) if m.startswith("vllm") and m not in before)))
"""


def test_save_and_load_import_the_same_vllm_modules_before_the_worker_starts(
    vllm_venv: Path, vllm_env: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """graphpersist_compiled.install runs before vLLM's worker starts: SAVE and LOAD leave it with the same vLLM modules
    imported, vLLM's compile backend among them. A module one side imported only later, while vLLM builds the model
    under the GPU as default device, would make its import-time tensors device memory on that side alone."""
    script = tmp_path / "imported.py"
    script.write_text(IMPORTED_AT_INSTALL)
    got = {}
    for mode in ("save", "load"):  # a fresh interpreter each: the warm one has imported vLLM's backend already
        proc = subprocess.run([str(vllm_venv / "bin" / "python"), str(script), mode], env=vllm_env[1],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        got[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "vllm.compilation.backends" in got["load"], got["load"]
    assert got["save"] == got["load"], sorted(set(got["save"]) ^ set(got["load"]))


@pytest.mark.parametrize(
    "saved, line",
    [
        (
            "['submod_0']",
            "notes.compiled_model: saved ['submod_0'], expected an object of compiled models by name",
        ),
        (
            "{'backbone': {'folder': 'h/rank_0_0/backbone', 'pieces': [['submod_0', ['os:system'], True, {}]]}}",
            "notes.compiled_model['backbone']: saved {'folder': 'h/rank_0_0/backbone', 'pieces': [['submod_0', "
            "['os:system'], True, {}]]}, expected {'folder': a string, 'pieces': [[a name, [integers], a boolean, "
            "{range: key}], ...]}",
        ),
        (
            "{'backbone': {'folder': 'h/rank_0_0/backbone', 'pieces': [['submod_0', [1], True, "
            "{'1-8': {'fn': 'os:system'}}]]}}",
            "notes.compiled_model['backbone']: saved {'folder': 'h/rank_0_0/backbone', 'pieces': [['submod_0', [1], "
            "True, {'1-8': {'fn': 'os:system'}}]]}, expected {'folder': a string, 'pieces': [[a name, [integers], a "
            "boolean, {range: key}], ...]}",
        ),
    ],
    ids=["models-not-an-object", "model-piece-of-another-shape", "piece-key-not-a-string"],
)
def test_load_refuses_damaged_compiled_notes_at_the_workers_first_seam(vllm: WarmPython, saved: str, line: str) -> None:
    """Notes of another shape (an archive names data, never code) refuse the LOAD when the glue installs, naming the
    entry and its saved value."""
    got = vllm.run(
        f"""
from vllm import graphpersist_compiled as glue
from graphpersist.errors import PersistError
load = open_session("load")
load.saved_notes = {{glue.NOTES_KEY: {saved}}}
try:
    glue.install(load)
    result = "installed"
except PersistError as err:
    result = str(err).splitlines()
"""
    ).ok()
    assert got == [f"graphpersist: cannot LOAD: {line}", "Re-run with mode=save for this configuration."]


def test_the_archive_records_the_commit_the_wheel_was_built_from(vllm: WarmPython) -> None:
    """engine.commit is compared at LOAD: it is the pinned wheel's (vllm/_version.py), never empty."""
    from gpdist import pins

    got = vllm.run("result = adapter().engine_facts()").ok()
    pinned = pins.load().engine("vllm").commit_wheel
    assert got["name"] == "vllm" and got["version"] == "0.26.0"
    assert got["commit"].removeprefix("g") == pinned


def test_fa3_forward_padding_is_written_as_zeros(vllm: WarmPython) -> None:
    """Two TP=1 SAVEs (2026-12-03) differed in the FA3 forward kernel's parameter bytes 180-183 (the padding after an
    int32 at 176), forming the in-region word 0x503800000001 in one archive's pointer inventory: SAVE zeroes them."""
    kernel = (
        "_ZN7cutlass13device_kernelIN5flash20enable_sm90_or_laterINS1_16FlashAttnFwdSm90INS1_25CollectiveMainloopFwd"
        "Sm90ILi2EN4cute5tupleIJNS5_1CILi1EEES8_S8_EEEEEEEEEvNT_6ParamsE"
    )
    got = vllm.run(
        f"""
        from graphpersist.graph import walk as graphwalk
        sess = open_session("save", ".")
        unused = graphwalk.cached_unused(sess.saver.unused_param_bytes)
        raw = bytearray(range(192))
        raw[176:184] = (0x503800000001).to_bytes(8, "little")
        result = {{
            "params": list(graphwalk.zero_ranges(bytes(raw), unused({kernel!r}, [(0, 1024)]))),
            "short": unused({kernel!r}, [(0, 128)]),
            "real": unused({kernel!r}, [(112, 2688)]),
        }}
        """
    ).ok()
    assert got["params"][176:184] == [1, 0, 0, 0, 0, 0, 0, 0]
    assert got["params"][:176] == list(range(176)) and got["params"][184:] == list(range(184, 192))
    assert got["short"] == []  # a parameter block too short to hold those bytes is left alone
    # the pinned kernels' layout: the 128-aligned Params block at buffer byte 112; the rule's offsets are the
    # buffer's (as SAVE's diff names them), never shifted by the block's start (that zeroed bytes 292-295, read)
    assert [list(r) for r in got["real"]] == [[180, 184]]
