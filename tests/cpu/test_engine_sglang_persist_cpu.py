"""SGLang's persistence glue (overlays/sglang/sglang/srt/graphpersist_*.py), checked on CPU without SGLang or torch.

The pinned SGLang wheel is CPython 3.12 only and imports torch everywhere, so these tests (1) import the overlay
modules as `sglang.srt.*` from the overlay folder (they import nothing of SGLang or torch at module level) and run
them against stand-ins: refusals and their messages, the memory-pool budget, the archive's SGLang facts through the
runtime's validator, what each hook does with persistence off, the capture and install bookkeeping; and (2) read
the pristine pinned upstream tree (tests marked network: the build cache holds it) to prove that every attribute
the refusals read is a ServerArgs field, that the patched files are upstream's plus the hooks only, and that the
functions the overlays call exist there. What this does NOT prove: that a GPU SAVE and LOAD restore every graph
and give identical outputs (the recipe's proof on the GPU host does).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import http
import importlib
import json
import logging
import shutil
import socket
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, Optional

import pytest
from archive_fixtures import forge, live_for, redigest, write_archive, write_loadable_archive

from graphpersist import cli, engine, run, switch
from graphpersist.archive import ArchiveError, liveenv, open_archive
from graphpersist.archive.validate import LoadRefused, evaluate
from graphpersist.errors import PersistError
from graphpersist.graph import structure
from graphpersist.loadplan import read_plan

REPO = Path(__file__).resolve().parents[2]
OVERLAY_SRT = REPO / "overlays" / "sglang" / "sglang" / "srt"
MODULES = ("adapter", "facts", "capture", "customar", "warmup", "engine", "switch", "symm_multicast",
           "deepep", "registry")  # fmt: skip
GiB = 1 << 30


@pytest.fixture
def srt(monkeypatch: pytest.MonkeyPatch) -> Iterator[SimpleNamespace]:
    """The overlay modules imported as `sglang.srt.graphpersist_*` from the overlay folder (no SGLang installed)."""
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)
    sglang = ModuleType("sglang")
    sglang.__path__ = [str(OVERLAY_SRT.parent)]
    srt_pkg = ModuleType("sglang.srt")
    srt_pkg.__path__ = [str(OVERLAY_SRT)]
    monkeypatch.setitem(sys.modules, "sglang", sglang)
    monkeypatch.setitem(sys.modules, "sglang.srt", srt_pkg)
    monkeypatch.delenv(switch.MODE_ENV, raising=False)
    mods = {m: importlib.import_module(f"sglang.srt.graphpersist_{m}") for m in MODULES}
    with run.activated(run.Run()):  # what a test's sessions gather goes with it
        yield SimpleNamespace(**mods)
    for name in [m for m in sys.modules if m.startswith("sglang.")]:
        sys.modules.pop(name, None)


# ------------------------------------------------------------------------------------- stand-in server arguments


@dataclass
class Phase:
    backend: str
    bs: list[int] | None = None


@dataclass
class GraphConfig:
    decode: Phase = field(default_factory=lambda: Phase("full", [1, 2, 4, 8]))
    prefill: Phase = field(default_factory=lambda: Phase("breakable", [16, 32, 64]))


@dataclass
class StandInServerArgs:
    """The ServerArgs fields persistence reads, with the values a default TP=2 start on an H200 resolves to."""

    model_path: str = "Qwen/Qwen3-8B"
    tp_size: int = 2
    pp_size: int = 1
    dp_size: int = 1
    nnodes: int = 1
    ep_size: int = 1
    dcp_size: int = 1
    attn_cp_size: int = 1
    enable_dp_attention: bool = False
    speculative_algorithm: str | None = None
    moe_a2a_backend: str = "none"
    deepep_mode: str = "auto"
    deepep_config: str | None = None
    moe_runner_backend: str = "auto"
    enable_single_batch_overlap: bool = False
    enable_lora: bool = False
    enable_pdmux: bool = False
    enable_two_batch_overlap: bool = False
    enable_torch_compile: bool = False
    enable_memory_saver: bool = False
    forward_hooks: list[Any] | None = None
    enable_symm_mem: bool = False
    enable_torch_symm_mem: bool = False
    enable_mscclpp: bool = False
    enable_nccl_nvls: bool = False
    enable_profile_cuda_graph: bool = False
    debug_cuda_graph: bool = False
    attention_backend: str | None = "fa3"
    prefill_attention_backend: str | None = None
    decode_attention_backend: str | None = None
    cuda_graph_config: GraphConfig = field(default_factory=GraphConfig)
    disable_custom_all_reduce: bool = False
    context_length: int | None = None
    max_running_requests: int | None = None
    max_total_tokens: int | None = None
    chunked_prefill_size: int = 8192
    page_size: int = 1
    kv_cache_dtype: str = "auto"
    mem_fraction_static: float = 0.83
    disable_cuda_graph_padding: bool = False
    disable_overlap_schedule: bool = False
    quantization: str | None = None
    enable_deterministic_inference: bool = False
    load_format: str = "dummy"
    random_seed: int = 12345
    max_prefill_tokens: int = 16384
    sampling_backend: Any = "flashinfer"  # a field no table of the glue names
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    custom_sigquit_handler: Any = None
    graph_persist: str | None = "save"
    graph_persist_dir: str | None = None


def test_the_default_tp2_start_is_supported(srt: SimpleNamespace) -> None:
    srt.facts.refuse_unsupported(StandInServerArgs(), {})


def test_one_gpu_is_supported(srt: SimpleNamespace) -> None:
    srt.facts.refuse_unsupported(StandInServerArgs(tp_size=1), {})


def test_torch_symmetric_memory_all_reduce_is_supported(srt: SimpleNamespace) -> None:
    """`--enable-torch-symm-mem` (the two-shot kernel without multicast, patch 0007): its buffers and peer tables are
    VMM allocations and imports made in setup, which the runtime places and re-creates like NCCL's."""
    srt.facts.refuse_unsupported(StandInServerArgs(enable_torch_symm_mem=True), {})


def test_load_refuses_an_archive_saved_with_the_other_torch_symm_mem_choice(
    srt: SimpleNamespace, tmp_path: Path
) -> None:
    saved = srt.facts.config_flags(StandInServerArgs(enable_torch_symm_mem=True), {})
    archive = open_archive(write_archive(tmp_path / "a", flags=saved))
    live = live_for(0, flags=srt.facts.config_flags(StandInServerArgs(), {}))
    shown = {m.field: (m.saved, m.live) for m in evaluate(archive, live, 0, skip_unknown=True).mismatches}
    assert shown == {"flags.enable_torch_symm_mem": (True, False)}


def test_the_live_torch_symm_mem_communicator_is_named_with_its_state(
    srt: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether the TP group's communicator came on depends on more than the flag (world size, GPU, multicast), so
    its live state is a fact of its own; a TP group of one rank has none."""
    dist = ModuleType("sglang.srt.distributed")
    monkeypatch.setitem(sys.modules, "sglang.srt.distributed", dist)
    on, off = SimpleNamespace(disabled=False, max_size=64 << 20), SimpleNamespace(disabled=True, max_size=64 << 20)
    for comm, named in ((on, ["tp:on:67108864"]), (off, ["tp:off:0"]), (None, [])):
        dist.get_tp_group = lambda comm=comm: SimpleNamespace(torch_symm_mem_comm=comm)  # type: ignore[attr-defined]
        assert srt.customar.torch_symm_mem_live() == named


@pytest.mark.parametrize(
    ("change", "names", "instead"),
    [
        ({"speculative_algorithm": "EAGLE"}, "speculative decoding (--speculative-algorithm EAGLE)", "without it"),
        ({"pp_size": 2}, "pipeline parallelism (--pp-size 2)", "tensor parallelism only"),
        ({"enable_dp_attention": True}, "DP attention", "one engine per data-parallel rank"),
        ({"moe_a2a_backend": "mooncake"}, "--moe-a2a-backend mooncake", "--deepep-mode normal"),
        ({"moe_a2a_backend": "deepep"}, "DeepEP's low-latency mode (--deepep-mode auto", "--deepep-mode normal"),
        ({"nnodes": 2}, "several nodes (--nnodes 2)", "single node"),
        ({"enable_lora": True}, "LoRA (--enable-lora)", "serve without it"),
        ({"enable_pdmux": True}, "PD multiplexing (--enable-pdmux)", "serve without it"),
        ({"enable_torch_compile": True}, "torch.compile (--enable-torch-compile)", "serve without it"),
        ({"enable_symm_mem": True}, "NCCL symmetric-memory all-reduce (--enable-symm-mem)", "--enable-torch-symm-mem"),
        ({"enable_mscclpp": True}, "MSCCL++ all-reduce (--enable-mscclpp)", "--disable-custom-all-reduce"),
        ({"forward_hooks": ["h"]}, "forward hooks (--forward-hooks ['h'])", "serve without them"),
        ({"dcp_size": 2}, "context parallelism (--dcp-size 2)", "serve without it"),
        ({"attention_backend": "trtllm_mha"}, "attention backend (--attention-backend trtllm_mha)", "backend fa3"),
        ({"decode_attention_backend": "flashmla"}, "(--decode-attention-backend flashmla)", "or triton"),
        (
            {"cuda_graph_config": GraphConfig(prefill=Phase("tc_piecewise", [16]))},
            "'tc_piecewise' backend",
            "--cuda-graph-backend-prefill disabled",
        ),
        (
            {"cuda_graph_config": GraphConfig(decode=Phase("breakable", [1]))},
            "decode CUDA graphs with the 'breakable' backend",
            "'full'",
        ),
    ],
)
def test_unsupported_configuration_is_refused_naming_it_and_what_to_use(
    srt: SimpleNamespace, change: dict[str, Any], names: str, instead: str
) -> None:
    with pytest.raises(engine.Refused) as err:
        srt.facts.refuse_unsupported(StandInServerArgs(**change), {})
    message = str(err.value)
    assert message.startswith("graphpersist: ") and "cannot be persisted" in message
    assert names in message and instead in message


def test_every_refused_field_is_refused_naming_its_flag_and_value(srt: SimpleNamespace) -> None:
    """Each row of the table: a value persistence does not take is refused, the flag and the value named."""
    for name, (needs, what, instead) in srt.facts.REFUSED.items():
        value = True if needs is None else "other" if isinstance(needs, tuple) else needs + 1
        with pytest.raises(engine.Refused) as err:
            srt.facts.refuse_unsupported(StandInServerArgs(**{name: value}), {})
        flag = f"--{name.replace('_', '-')}" + ("" if value is True else f" {value}")
        assert f"graphpersist: {what} ({flag}) cannot be persisted: {instead}." in str(err.value), name


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"SGLANG_ENABLE_CUDA_GRAPH_DEDUP": "1"}, "SGLANG_ENABLE_CUDA_GRAPH_DEDUP=1"),
        ({"SGLANG_ENABLE_POST_CAPTURE_KV_SIZING": "true"}, "post-capture KV sizing"),
        ({"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1"}, "memory saver"),
        ({"SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2": "0"}, "legacy custom all-reduce"),
    ],
)
def test_environment_that_changes_the_capture_is_refused(srt: SimpleNamespace, env: dict[str, str], names: str) -> None:
    with pytest.raises(engine.Refused, match="cannot be persisted") as err:
        srt.facts.refuse_unsupported(StandInServerArgs(), env)
    assert names in str(err.value)


def test_legacy_custom_all_reduce_is_fine_when_custom_all_reduce_is_off(srt: SimpleNamespace) -> None:
    srt.facts.refuse_unsupported(
        StandInServerArgs(disable_custom_all_reduce=True), {"SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2": "0"}
    )


@dataclass
class StandInRunner:
    is_hybrid_swa: bool = False
    use_mla_backend: bool = False
    is_multimodal: bool = False
    is_generation: bool = True


@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"is_hybrid_swa": True}, "hybrid sliding-window"),
        ({"use_mla_backend": True}, "MLA"),
        ({"is_generation": False}, "embedding or reward model"),
    ],
)
def test_models_outside_the_dense_decoder_path_are_refused(
    srt: SimpleNamespace, change: dict[str, bool], names: str
) -> None:
    with pytest.raises(engine.Refused, match=names):
        srt.facts.refuse_unsupported_model(StandInRunner(**change))


# ----------------------------------------------------------------------------------------- the memory-pool budget


# The fields archives have recorded of SGLang 0.5.17's MemoryPoolConfig (flags.memory_pool), in its order.
POOL_FIELDS = ("max_total_num_tokens", "max_running_requests", "full_max_total_num_tokens", "swa_max_total_num_tokens",
               "c4_max_total_num_tokens", "c128_max_total_num_tokens", "c4_state_pool_size", "c128_state_pool_size",
               "mem_fraction_static")  # fmt: skip


@pytest.fixture
def pool_config(upstream_tree: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch) -> type:
    """The pinned upstream MemoryPoolConfig dataclass, its class statement run alone (the module imports torch)."""
    tree = ast.parse((upstream_tree("sglang") / "sglang/srt/model_executor/pool_configurator.py").read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MemoryPoolConfig"]
    namespace: dict[str, Any] = {"dataclass": dataclasses.dataclass, "Optional": Optional}
    exec(compile(ast.Module(body=[cls], type_ignores=[]), "pool_configurator.py", "exec"), namespace)
    module = ModuleType("sglang.srt.model_executor.pool_configurator")
    module.MemoryPoolConfig = namespace["MemoryPoolConfig"]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return namespace["MemoryPoolConfig"]


@pytest.mark.network  # reads the pristine upstream tree (cached by the build)
def test_the_pool_is_recorded_field_by_field_and_malformed_records_refuse(
    srt: SimpleNamespace, tmp_path: Path, pool_config: type
) -> None:
    """SAVE records every MemoryPoolConfig field (the session records the byte budget it was sized by): the fields
    archives have always recorded; LOAD rebuilds the config from them and refuses a record that lacks or adds one."""
    config = pool_config(max_total_num_tokens=123456, mem_fraction_static=0.83)
    record = srt.facts.pool_record(config)
    assert tuple(record) == POOL_FIELDS and record["max_total_num_tokens"] == 123456
    assert saved_pool(srt, record, tmp_path) == record and pool_config(**record) == config
    for bad in (
        None,
        {},
        {**record, "budget_bytes": GiB},
        {k: v for k, v in record.items() if k != "max_running_requests"},
    ):
        with pytest.raises(PersistError, match=r"records no memory-pool size.*Re-run with mode=save"):
            saved_pool(srt, bad, tmp_path)


def saved_pool(srt: SimpleNamespace, value: Any, archive_dir: Path) -> Any:
    """LOAD's memory pool as the adapter reads it back from SAVE's flags."""
    adapter = srt.adapter.SglangAdapter(SimpleNamespace())
    adapter.read_saved(SimpleNamespace(saved_flags={"memory_pool": value}, directory=archive_dir))
    return adapter.run.pool


def test_the_adapter_names_the_pool_and_the_sglang_settings_that_size_it(srt: SimpleNamespace) -> None:
    adapter = srt.adapter.SglangAdapter(SimpleNamespace())
    assert adapter.budget_what == "memory pool" and "--mem-fraction-static" in adapter.budget_advice
    assert adapter.writes_when_ready and not adapter.pins_kernel_choices


# ------------------------------------------------------------------------- the archive's SGLang facts, validated


def test_load_refuses_an_archive_of_another_sglang_configuration_naming_every_fact(
    srt: SimpleNamespace, tmp_path: Path
) -> None:
    saved = srt.facts.config_flags(StandInServerArgs(), {})
    root = write_archive(
        tmp_path / "a", flags=saved, parallel={"world_size": 2, "tp_size": 2, "pp_size": 1, "ep_size": 1}
    )
    archive = open_archive(root)
    same = live_for(0, flags=srt.facts.config_flags(StandInServerArgs(), {}))
    assert evaluate(archive, same, 0, skip_unknown=True).mismatches == []
    other = StandInServerArgs(
        attention_backend="flashinfer",
        mem_fraction_static=0.7,
        cuda_graph_config=GraphConfig(decode=Phase("full", [1, 2])),
    )
    live = live_for(0, flags=srt.facts.config_flags(other, {"SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2": "1"}))
    shown = {m.field: (m.saved, m.live) for m in evaluate(archive, live, 0, skip_unknown=True).mismatches}
    assert shown == {
        "flags.attention_backend": ("fa3", "flashinfer"),
        "flags.mem_fraction_static": (0.83, 0.7),
        "flags.cuda_graph_config.decode.bs": ([1, 2, 4, 8], [1, 2]),
        "flags.custom_all_reduce_v2": (None, "1"),
    }


@pytest.mark.parametrize(
    ("saved", "live", "field", "line"),
    [
        ({"quantization": "fp8"}, {}, ("quantization", "fp8", None), "saved 'fp8', live <unset>"),
        ({"kv_cache_dtype": "fp8_e4m3"}, {}, ("kv_cache_dtype", "fp8_e4m3", "auto"), "saved 'fp8_e4m3', live 'auto'"),
        (
            {"context_length": 32768},
            {"context_length": 4096},
            ("context_length", 32768, 4096),
            "saved 32768, live 4096",
        ),
        (
            {"enable_deterministic_inference": True},
            {},
            ("enable_deterministic_inference", True, False),
            "saved true, live false",
        ),
    ],
    ids=["quantization", "kv_cache_dtype", "context_length", "deterministic_inference"],
)
def test_load_refuses_an_archive_of_another_model_case_naming_the_setting(
    srt: SimpleNamespace, tmp_path: Path, saved: dict[str, Any], live: dict[str, Any], field: tuple[Any, ...], line: str
) -> None:
    """Issue 34's cases (FP8 weights, FP8 KV cache, long context, seeded sampling): a LOAD started with another value
    of the case's setting than its SAVE is refused naming it, with the saved and the live value. Deterministic
    inference puts batch-invariant kernels in the graphs and is what makes SGLang honour per-request seeds."""
    archive = open_archive(write_archive(tmp_path / "a", flags=srt.facts.config_flags(StandInServerArgs(**saved), {})))
    same = live_for(0, flags=srt.facts.config_flags(StandInServerArgs(**saved), {}))
    assert evaluate(archive, same, 0, skip_unknown=True).mismatches == []
    other = live_for(0, flags=srt.facts.config_flags(StandInServerArgs(**live), {}))
    mismatches = evaluate(archive, other, 0, skip_unknown=True).mismatches
    name, saved_value, live_value = field
    assert {m.field: (m.saved, m.live) for m in mismatches} == {f"flags.{name}": (saved_value, live_value)}
    # the line the recipes' refused LOADs look for in the engine's log
    assert str(LoadRefused(tmp_path / "a", mismatches, 0)).splitlines()[1] == f"  flags.{name}: {line}"


def test_ranks_agree_over_the_tp_groups_cpu_group_the_whole_world_here(
    srt: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    dist = ModuleType("sglang.srt.distributed")
    dist.get_tp_group = lambda: SimpleNamespace(cpu_group="tp gloo")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sglang.srt.distributed", dist)
    monkeypatch.setattr(engine, "torch_gather", lambda group: ("gather over", group))
    adapter = srt.adapter.SglangAdapter(SimpleNamespace(server_args=StandInServerArgs()))
    assert adapter.cpu_gather() == ("gather over", "tp gloo")
    assert adapter.parallel()["world_size"] == StandInServerArgs().tp_size


def test_load_refuses_another_model_path_naming_it_and_the_fingerprint_leaves_it_out(
    srt: SimpleNamespace, tmp_path: Path
) -> None:
    archive = open_archive(write_archive(tmp_path / "a", flags=srt.facts.config_flags(StandInServerArgs(), {})))
    live = live_for(0, flags=srt.facts.config_flags(StandInServerArgs(model_path="/models/other"), {}))
    assert [str(m) for m in evaluate(archive, live, 0).mismatches if m.field.startswith("flags.")] == [
        "flags.model_path: saved 'Qwen/Qwen3-8B', live '/models/other'"
    ]
    config = SimpleNamespace(hf_config=None, context_len=4096, dtype="torch.bfloat16")
    other = SimpleNamespace(**vars(config), model_path="/models/other")
    facts = [srt.adapter.SglangAdapter(SimpleNamespace(model_config=c)).model_facts() for c in (config, other)]
    assert facts[0] == facts[1]


def test_the_seed_is_not_a_fact(srt: SimpleNamespace) -> None:
    """SGLang draws a random seed per start when none is given: greedy graphs do not depend on it."""
    assert srt.facts.config_flags(StandInServerArgs(random_seed=1), {}) == srt.facts.config_flags(
        StandInServerArgs(random_seed=2), {}
    )


def test_every_server_argument_is_recorded_but_those_that_may_differ_and_secrets(srt: SimpleNamespace) -> None:
    """A field no table names (one a new release adds) is recorded and compared; the reviewed may-differ fields and
    secrets are never written."""
    flags = srt.facts.config_flags(StandInServerArgs(), {})
    left_out = {"random_seed", "host", "port", "api_key", "custom_sigquit_handler", "graph_persist",
                "graph_persist_dir"}  # fmt: skip
    assert set(StandInServerArgs.__dataclass_fields__) - left_out <= set(flags) and not left_out & set(flags)
    assert "sampling_backend" in flags and "max_prefill_tokens" in flags
    assert flags["cuda_graph_config"] == {"decode": {"backend": "full", "bs": [1, 2, 4, 8]},
                                          "prefill": {"backend": "breakable", "bs": [16, 32, 64]}}  # fmt: skip


def test_load_refuses_a_server_argument_no_table_names_naming_it(srt: SimpleNamespace, tmp_path: Path) -> None:
    archive = open_archive(write_archive(tmp_path / "a", flags=srt.facts.config_flags(StandInServerArgs(), {})))
    for live_args, ok in ((StandInServerArgs(host="0.0.0.0", port=1, api_key="other", random_seed=7), True),
                          (StandInServerArgs(sampling_backend="pytorch"), False)):  # fmt: skip
        mismatches = evaluate(archive, live_for(0, flags=srt.facts.config_flags(live_args, {})), 0).mismatches
        assert [str(m) for m in mismatches if m.field.startswith("flags.")] == (
            [] if ok else ["flags.sampling_backend: saved 'flashinfer', live 'pytorch'"]
        )


def test_secrets_are_never_written_whatever_a_release_names_them(srt: SimpleNamespace) -> None:
    for name in ("api_key", "admin_api_key", "ssl_keyfile_password", "hf_token", "s3_secret", "credentials"):
        assert srt.facts.SECRET.search(name), name
    for name in ("max_total_tokens", "bucket_time_to_first_token", "kv_cache_dtype", "tokenizer_path"):
        assert not srt.facts.SECRET.search(name), name


@pytest.mark.parametrize(
    ("value", "recorded"),
    [
        ({"b", "a"}, ["a", "b"]),
        ((1, 2), [1, 2]),
        ({1: Phase("full")}, {"1": {"backend": "full", "bs": None}}),
        (http.HTTPStatus.OK, 200),
        (socket.AddressFamily.AF_INET, int(socket.AddressFamily.AF_INET)),
    ],
)
def test_a_server_argument_is_recorded_as_json(srt: SimpleNamespace, value: Any, recorded: Any) -> None:
    flag = srt.facts.config_flags(StandInServerArgs(sampling_backend=value), {})["sampling_backend"]
    assert flag == recorded and type(flag) is type(recorded)  # as the archive's JSON reads it back


def test_a_server_argument_an_archive_cannot_record_is_refused_at_start_naming_it(srt: SimpleNamespace) -> None:
    """A value with no JSON form (a function, an object) would be compared by a text that may differ per start."""
    with pytest.raises(engine.Refused, match=r"--sampling-backend \(a function\) cannot be persisted: start"):
        srt.facts.refuse_unsupported(StandInServerArgs(sampling_backend=lambda: None), {})
    srt.facts.refuse_unsupported(StandInServerArgs(custom_sigquit_handler=lambda: None), {})  # may differ: not recorded


# ---------------------------------------------------------------------------- with persistence off: upstream's


class Recorder:
    """Stands for an upstream object: records the upstream method the hook calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def _resolve_memory_pool_config(self, pre: Any) -> str:
        self.calls.append(("_resolve_memory_pool_config", (pre,)))
        return "upstream's config"

    def _register_graph_inputs(self) -> None:
        self.calls.append(("_register_graph_inputs", ()))


def test_hooks_do_what_upstream_does_with_persistence_off(srt: SimpleNamespace) -> None:
    up = Recorder()
    assert srt.engine.memory_pool_config(up, 77.5) == "upstream's config"
    srt.customar.register_graph_inputs(up)
    assert up.calls == [("_resolve_memory_pool_config", (77.5,)), ("_register_graph_inputs", ())]
    assert srt.engine.pool_budget(lambda: 12345) == 12345  # upstream's profile, unrounded
    assert srt.capture.defer("decode", object(), up._register_graph_inputs) is False and len(up.calls) == 2
    assert srt.engine.before_distributed(object()) is None  # touches nothing of the model runner
    assert srt.engine.graphs(object()) is None
    assert srt.capture.captured_full(object(), object(), object(), object()) is None
    assert srt.capture.captured_breakable(object(), object(), object(), object()) is None
    assert srt.capture.captured_break(len, (), {}, None) is None
    died = RuntimeError("Rank 0 scheduler died during initialization (exit code: 1).")
    assert srt.switch.refused() is False and srt.switch.refusal_or(died) is died  # patch 0010's seams
    assert engine.current() is None


def test_switch_exports_the_interposer_and_pins_only_what_is_unset(
    srt: SimpleNamespace, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {"NCCL_RUNTIME_CONNECT": "1"}  # the user's own value stays (a SAVE records it; LOAD must match it)
    monkeypatch.setattr("os.environ", env)
    with caplog.at_level(logging.INFO):
        srt.switch.resolve_server_args(SimpleNamespace(graph_persist="save", graph_persist_dir=str(tmp_path)))
    assert env[switch.MODE_ENV] == "save" and env[switch.DIR_ENV] == str(tmp_path)
    assert "libgpinterpose" in env["LD_PRELOAD"] and env["GP_REGION_BASE"].startswith("0x")
    assert env["NCCL_RUNTIME_CONNECT"] == "1"
    assert (env["NCCL_NVLS_ENABLE"], env["TORCH_SYMM_MEM_DISABLE_MULTICAST"], env["NVSHMEM_DISABLE_NVLS"]) == (
        "0",
        "1",
        "1",
    )
    assert [r.getMessage() for r in caplog.records] == [
        f"graphpersist: mode=save dir={tmp_path} (from keyword graph_persist, keyword graph_persist_dir)",
        "graphpersist: pinned for persistence: NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 "
        "NVSHMEM_DISABLE_NVLS=1",
    ]


def test_switch_off_exports_nothing(srt: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    env: dict[str, str] = {}
    monkeypatch.setattr("os.environ", env)
    assert not srt.switch.resolve_server_args(SimpleNamespace(graph_persist=None, graph_persist_dir=None)).enabled
    assert env == {}


# ------------------------------------------------------------------------- SAVE's bookkeeping and LOAD's install


def standin_break_target(*args: Any, **kwargs: Any) -> None:
    """A module-level break function, as SGLang's attention ops are."""


def unregistered_break(*args: Any) -> None:
    """A module-level function no registry entry returns."""


@pytest.fixture
def registered(srt: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """The test's break function in SGLang's registry, as the glue's own entries are (a function returning it)."""
    monkeypatch.setitem(srt.registry.BREAKS, "test.standin_break", lambda: standin_break_target)


class StandInOpPacket:
    """Like torch's OpOverloadPacket: what `torch.ops.sglang.unified_attention_with_output` returns, which is what
    `sglang.srt.layers.radix_attention.unified_attention_with_output` is (the break of SGLang 0.5.17's prefill graphs
    on the GPU host, 2026-11-30)."""

    _qualified_op_name = "sglang::unified_attention_with_output"


@pytest.fixture
def attention_module(monkeypatch: pytest.MonkeyPatch) -> StandInOpPacket:
    """A stand-in for SGLang's radix_attention module, holding its attention op."""
    module = ModuleType("sglang.srt.layers.radix_attention")
    module.unified_attention_with_output = StandInOpPacket()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module.unified_attention_with_output  # type: ignore[attr-defined]


def test_the_attention_op_break_is_stored_by_its_registry_id(
    srt: SimpleNamespace, tmp_path: Path, attention_module: StandInOpPacket
) -> None:
    sess = saving(srt, tmp_path)
    sess.adapter.run.capturing = "prefill"
    srt.capture.captured_break(attention_module, (None, True, 3), {}, None)
    [record] = sess.adapter.run.breaks
    assert record["kind"] == "call" and record["fn"] == "sglang.attention"
    assert srt.registry.breaks["sglang.attention"] is attention_module
    with pytest.raises(PersistError, match="not in SGLang's registry of break functions"):
        srt.capture.captured_break(StandInOpPacket(), (), {}, None)  # another op of the same name


def test_save_refuses_a_break_the_registry_lacks_naming_it_and_what_to_do(srt: SimpleNamespace, tmp_path: Path) -> None:
    sess = saving(srt, tmp_path)
    sess.adapter.run.capturing = "prefill"
    with pytest.raises(PersistError) as err:
        srt.capture.captured_break(unregistered_break, (), {}, None)
    message = str(err.value)
    assert f"breaks at {__name__}.unregistered_break, which is not in SGLang's registry" in message
    assert "(sglang.attention, sglang.deepep_moe_a2a)" in message
    assert "--cuda-graph-backend-prefill disabled" in message and "graphpersist_registry.py" in message
    assert sess.adapter.run.breaks == []


def test_an_unimportable_registry_entry_is_absent_not_an_error(srt: SimpleNamespace) -> None:
    """Without DeepEP's module (here: SGLang is not installed at all) its entry is simply not in the live registry."""
    live = srt.registry.breaks
    assert list(live) == ["sglang.attention", "sglang.deepep_moe_a2a"]
    assert "sglang.deepep_moe_a2a" not in live and live.get("sglang.deepep_moe_a2a") is None


class StandInSaver:
    def __init__(self) -> None:
        self.added: list[tuple[str, Any, int | None, str | None]] = []

    def add(self, name: str, graph: Any, inputs: list[Any], outputs: Any, *, capture_size: Any, mode: Any) -> None:
        self.added.append((name, outputs, capture_size, mode))


class StandInGraph:
    def __init__(self) -> None:
        self.instantiated = False

    def instantiate(self) -> None:
        self.instantiated = True


@dataclass(frozen=True)
class Key:
    size: int


def open_session(srt: SimpleNamespace, mode: switch.Mode, directory: Path, saver: Any = None,
                 model_runner: Any = None) -> engine.PersistSession:  # fmt: skip
    """A scheduler process's session (rank 0 of 2) over the SGLang adapter, active, as before_distributed opens it
    (without what needs torch: the capture counter and the model facts)."""
    adapter = srt.adapter.SglangAdapter(model_runner if model_runner is not None else SimpleNamespace())
    sess = engine.PersistSession(adapter, mode, directory, 0, 2, saver=saver)
    sess.activate()
    return sess


def saving(srt: SimpleNamespace, tmp_path: Path) -> Any:
    return open_session(srt, switch.Mode.SAVE, tmp_path, saver=StandInSaver())


def test_save_records_decode_graphs_and_breakable_prefill_graphs_by_stable_names(
    srt: SimpleNamespace, tmp_path: Path, registered: None
) -> None:
    sess = saving(srt, tmp_path)
    sess.adapter.run.capturing = "prefill"
    bg = SimpleNamespace(_segments=[StandInGraph(), StandInGraph(), StandInGraph()], _break_fns=[object(), object()])
    for layer in (0, 1):
        srt.capture.captured_break(standin_break_target, (None, True, layer), {"key_value_num_tokens": None}, None)
    srt.capture.captured_breakable(object(), Key(64), bg, ("rows",))
    sess.adapter.run.capturing = "decode"
    decode = StandInGraph()
    srt.capture.captured_full(object(), Key(8), decode, {"logits": None})
    assert [(n, s, m) for n, _, s, m in sess.saver.added] == [
        ("prefill/64/000", 64, "prefill"),
        ("prefill/64/001", 64, "prefill"),
        ("prefill/64/002", 64, "prefill"),
        ("decode/8", 8, "decode"),
    ]
    assert [o for _, o, _, _ in sess.saver.added] == [None, None, ("rows",), {"logits": None}]
    assert all(g.instantiated for g in (*bg._segments, decode)), "keep_graph=True graphs are instantiated at SAVE"
    breaks = sess.notes["prefill"]["prefill/64"]["breaks"]
    assert [(b["kind"], b["fn"]) for b in breaks] == [("call", "test.standin_break")] * 2
    assert breaks[1]["args"]["items"][2] == {"kind": "value", "value": 1}
    assert sess.captured == 4 and sess.adapter.run.breaks == []


def test_a_runner_hands_its_capture_to_the_graphs_step_and_a_second_runner_of_a_phase_is_refused(
    srt: SimpleNamespace, tmp_path: Path
) -> None:
    sess = saving(srt, tmp_path)
    ran: list[str] = []
    assert srt.capture.defer("decode", "decode runner", lambda: ran.append("decode")) is True
    assert sess.adapter.run.runners == {"decode": "decode runner"} and ran == []  # not captured yet
    sess.adapter.run.captures["decode"]()
    assert ran == ["decode"]
    with pytest.raises(PersistError, match=r"^graphpersist: an unexpected graph runner str: refused$"):
        srt.capture.defer("decode", "another", lambda: None)
    per_shape = SimpleNamespace(attn_metadata_buffers={})  # the backend keeps captured prefill metadata per shape
    with pytest.raises(engine.Refused, match=r"captured prefill metadata per shape.*--cuda-graph-backend-prefill"):
        srt.capture.defer("prefill", per_shape, lambda: None)
    assert srt.capture.defer("prefill", SimpleNamespace(attn_metadata_buffers=None), lambda: None) is True


def test_save_refuses_graphs_it_could_not_install_again(srt: SimpleNamespace, tmp_path: Path, registered: None) -> None:
    sess = saving(srt, tmp_path)
    sess.adapter.run.capturing = "prefill"
    with pytest.raises(PersistError, match="3 segments, 1 breaks, 0 recorded"):
        srt.capture.captured_breakable(
            object(), Key(64), SimpleNamespace(_segments=[StandInGraph()] * 3, _break_fns=[object()]), None
        )
    with pytest.raises(PersistError, match=r"break test\.standin_break args\[0\]: .*object is not a tensor"):
        srt.capture.captured_break(standin_break_target, (object(),), {}, None)


@dataclass
class StandInBackend:
    _graphs: dict[Any, Any] = field(default_factory=dict)
    _outputs: dict[Any, Any] = field(default_factory=dict)


class StandInBreakable:
    def __init__(self, deduped_cuda_graph: Any = None) -> None:
        self._segments: list[Any] = []
        self._break_fns: list[Any] = []


@pytest.fixture
def upstream_standins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stand-ins for the two SGLang modules install() imports (their real classes are pinned by hooks.toml)."""
    shape_key = ModuleType("sglang.srt.model_executor.runner.shape_key")
    shape_key.ShapeKey = Key  # type: ignore[attr-defined]
    bcg = ModuleType("sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph")
    bcg.BreakableCUDAGraph = StandInBreakable  # type: ignore[attr-defined]
    bcg._copy_output = lambda dst, src: src  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, shape_key.__name__, shape_key)
    monkeypatch.setitem(sys.modules, bcg.__name__, bcg)


def loaded(name: str) -> Any:
    return SimpleNamespace(name=name, outputs=f"outputs of {name}")


def call_record(fn: Any, *args: Any) -> dict[str, Any]:
    """A break as SAVE stores it: a call record of `fn` (an id, or whatever a forger writes) with plain arguments."""
    return {
        "kind": "call",
        "fn": fn,
        "args": {"kind": "tuple", "items": [{"kind": "value", "value": a} for a in args]},
        "kwargs": {"kind": "dict", "keys": [], "items": []},
        "output": {"kind": "value", "value": None},
    }


def prefill_notes(*breaks: dict[str, Any]) -> dict[str, Any]:
    """SGLang's notes of one rank: two decode graphs and one breakable prefill graph with these breaks."""
    return {"decode": {"decode/1": {"size": 1}, "decode/2": {"size": 2}},
            "prefill": {"prefill/16": {"size": 16, "segments": len(breaks) + 1, "breaks": list(breaks)}}}  # fmt: skip


def install_notes(srt: SimpleNamespace, notes: dict[str, Any]) -> tuple[int, SimpleNamespace]:
    """install() of `notes` into stand-in runners (decode 1 and 2, prefill 16); (installed, prefill runner)."""
    segments = notes["prefill"]["prefill/16"]["segments"]
    result = {n: loaded(n) for n in ("decode/1", "decode/2", *(f"prefill/16/{i:03d}" for i in range(segments)))}
    decode = SimpleNamespace(capture_bs=[1, 2], backend=StandInBackend())
    prefill = SimpleNamespace(capture_num_tokens=[16], backend=StandInBackend())
    return srt.capture.install({"decode": decode, "prefill": prefill}, result, notes), prefill


def test_load_installs_every_graph_where_the_runners_replay_it(
    srt: SimpleNamespace, upstream_standins: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Any] = []

    def recorded_op(*args: Any, **kwargs: Any) -> None:
        calls.append((args, kwargs))

    monkeypatch.setitem(srt.registry.BREAKS, "test.recorded_op", lambda: recorded_op)
    record = call_record("test.recorded_op", True, 3)
    record["kwargs"] = {"kind": "dict", "keys": ["key_value_num_tokens"], "items": [{"kind": "value", "value": None}]}
    installed, prefill = install_notes(srt, prefill_notes(record))
    assert installed == 4
    bg = prefill.backend._graphs[Key(16)]
    assert [s.name for s in bg._segments] == ["prefill/16/000", "prefill/16/001"]
    assert prefill.backend._outputs[Key(16)] == "outputs of prefill/16/001"
    bg._break_fns[0]()
    assert calls == [((True, 3), {"key_value_num_tokens": None})]


def test_load_refuses_a_break_id_the_live_registry_lacks_naming_it_and_the_advice(
    srt: SimpleNamespace, upstream_standins: None
) -> None:
    with pytest.raises(PersistError) as err:
        install_notes(srt, prefill_notes(call_record("sglang.no_such_break")))
    message = str(err.value)
    assert "prefill/16 break 0.fn: function saved 'sglang.no_such_break'" in message
    assert "live registry holds sglang.attention, sglang.deepep_moe_a2a" in message
    assert "Re-run with mode=save" in message


# ------------------------------------------------------------------- an archive is data, never code (issue 41)


@pytest.fixture
def sinks(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """os.system, os.popen, subprocess.Popen, eval and importlib.import_module, recording every call instead of
    running it (not exec: the import machinery runs every module's code through it)."""
    import builtins
    import importlib
    import os
    import subprocess

    called: list[Any] = []
    for owner, name in ((os, "system"), (os, "popen"), (subprocess, "Popen"), (builtins, "eval"),
                        (importlib, "import_module")):  # fmt: skip
        monkeypatch.setattr(owner, name, lambda *a, _n=name, **k: called.append((_n, a, k)))
    return called


FORGED_FNS = ["os:system", "os.system", "builtins:eval", "torch.ops:aten.empty", "__import__", "os:system.__call__"]


@pytest.mark.parametrize("fn", FORGED_FNS)
def test_load_calls_nothing_a_forged_break_names(
    srt: SimpleNamespace, upstream_standins: None, sinks: list[Any], fn: str
) -> None:
    with pytest.raises(PersistError, match=r"prefill/16 break 0\.fn: .*(not a registry id|live registry holds)"):
        install_notes(srt, prefill_notes(call_record(fn, "touch /tmp/gp-pwned")))
    old_shape = call_record(fn, "touch /tmp/gp-pwned")
    del old_shape["kind"]  # the record as format 2 wrote it
    with pytest.raises(PersistError, match=r"prefill/16 break 0: damaged call record"):
        install_notes(srt, prefill_notes(old_shape))
    assert sinks == []


def forged_sglang_archive(root: Path, change: Callable[[dict[str, Any], dict[str, Any]], None]) -> Path:
    """A two-rank archive whose rank 0 carries SGLang's notes (a breakable prefill graph whose break is the attention
    op), then `change(record, index)` applied to rank 0's record and graph index with every digest recomputed, as a
    forger would (archive_fixtures.forge / redigest)."""
    write_loadable_archive(root)
    record = json.loads((root / "rank_0/rank.json").read_text())
    record["extra"]["engine_notes"] = prefill_notes(call_record("sglang.attention", True, 3))
    forge(root, "rank_0/rank.json", json.dumps(redigest(record)).encode())
    index = json.loads((root / "rank_0/graphs/index.json").read_text())
    record = json.loads((root / "rank_0/rank.json").read_text())
    change(record, index)
    forge(root, "rank_0/graphs/index.json", json.dumps(index).encode())
    record = json.loads((root / "rank_0/rank.json").read_text())  # forge() committed the index
    change(record, {"graphs": []})
    forge(root, "rank_0/rank.json", json.dumps(redigest(record)).encode())
    return root


def _break_fn_of(record: dict[str, Any]) -> dict[str, Any]:
    return record["extra"]["engine_notes"]["prefill"]["prefill/16"]["breaks"][0]


def refusals(root: Path, capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    """(LOAD's CPU stage's refusal of rank 0, `graphpersist check`'s stderr): both must refuse."""
    with pytest.raises(ArchiveError) as err:
        read_plan(open_archive(root, keep_rank=0), 0)
    capsys.readouterr()
    assert cli.main(["check", str(root)]) == 2
    return str(err.value), capsys.readouterr().err


def test_check_and_load_refuse_the_forged_os_system_break_and_call_nothing(
    srt: SimpleNamespace, upstream_standins: None, sinks: list[Any], tmp_path: Path,
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setattr(liveenv, "_smi_gpus", lambda: [])  # check's live facts: no nvidia-smi here
    clean = forged_sglang_archive(tmp_path / "clean", lambda r, i: None)
    assert read_plan(open_archive(clean, keep_rank=0), 0).notes["prefill"]["prefill/16"]["breaks"][0]["fn"] == (
        "sglang.attention"
    )
    root = forged_sglang_archive(tmp_path / "forged", lambda r, i: _break_fn_of(r).update(fn="os:system")
                                 if "extra" in r else None)  # fmt: skip
    plan_error, check_error = refusals(root, capsys)
    field = "extra.engine_notes.prefill.prefill/16.breaks[0].fn: 'os:system' is not a registry id"
    assert field in plan_error and field in check_error
    # and were the runtime's check skipped, the glue itself refuses before anything is called
    notes = json.loads((root / "rank_0/rank.json").read_text())["extra"]["engine_notes"]
    with pytest.raises(PersistError, match="'os:system' is not a registry id"):
        install_notes(srt, notes)
    assert sinks == []


def test_check_and_load_refuse_an_output_record_naming_a_runtime_class(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`graphpersist.load:LoadedGraph` as an output class (format 2's shape, and as a type) is a refusal, never the
    TypeError calling that class would raise."""
    monkeypatch.setattr(liveenv, "_smi_gpus", lambda: [])
    forged = {"kind": "dataclass", "type": "graphpersist.load:LoadedGraph", "fields": {}}

    def change(record: dict[str, Any], index: dict[str, Any]) -> None:
        for g in index["graphs"][:1]:
            g["outputs"] = forged

    root = forged_sglang_archive(tmp_path / "forged", change)
    plan_error, check_error = refusals(root, capsys)
    field = "outputs.type: 'graphpersist.load:LoadedGraph' is not a registry id"
    assert field in plan_error and field in check_error
    with pytest.raises(structure.StructureError, match=r"output type saved 'graphpersist\.load:LoadedGraph'"):
        structure.decode(forged, lambda spec: spec, "outputs", {"sglang.logits_processor_output": Key})
    old = {"kind": "dataclass", "class": "graphpersist.load:LoadedGraph", "fields": {}}
    with pytest.raises(structure.StructureError, match="output type saved None"):
        structure.decode(old, lambda spec: spec, "outputs", {})


@dataclass
class StandInLogitsOutput:
    """Like SGLang's LogitsProcessorOutput: the dataclass the decode graphs return."""

    next_token_logits: Any
    hidden_states: Any = None


def test_decode_outputs_round_trip_through_the_registry_of_output_types(
    srt: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = ModuleType("sglang.srt.layers.logits_processor")
    module.LogitsProcessorOutput = StandInLogitsOutput  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    types = srt.adapter.SglangAdapter(SimpleNamespace()).output_types()
    tree = structure.encode(StandInLogitsOutput("logits"), lambda x: None, "outputs", types)
    assert tree["type"] == "sglang.logits_processor_output"
    back = structure.decode(json.loads(json.dumps(tree)), lambda s: s, "outputs", types)
    assert back == StandInLogitsOutput("logits") and type(back) is StandInLogitsOutput
    with pytest.raises(structure.StructureError, match="not in the engine's registry of output types"):
        structure.encode(Key(1), lambda x: None, "outputs", types)


@pytest.mark.parametrize(
    ("decode_sizes", "prefill_sizes", "message"),
    [
        ([1, 2, 4], [16], r"decode graphs differ: not in the archive \['decode/4'\], saved but not replayed .*none"),
        ([1, 2], [16, 32], r"prefill graphs differ: not in the archive \['prefill/32'\]"),
    ],
)
def test_load_refuses_an_inventory_that_differs(
    srt: SimpleNamespace, upstream_standins: None, decode_sizes: list[int], prefill_sizes: list[int], message: str
) -> None:
    notes = {"decode": {"decode/1": {"size": 1}, "decode/2": {"size": 2}},
             "prefill": {"prefill/16": {"size": 16, "segments": 1, "breaks": []}}}  # fmt: skip
    runners = {
        "decode": SimpleNamespace(capture_bs=decode_sizes, backend=StandInBackend()),
        "prefill": SimpleNamespace(capture_num_tokens=prefill_sizes, backend=StandInBackend()),
    }
    with pytest.raises(PersistError, match=message):
        srt.capture.install(runners, {}, notes)


def test_load_refuses_a_custom_all_reduce_other_than_saves(
    srt: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    sess = open_session(srt, switch.Mode.LOAD, Path("/nowhere"))
    monkeypatch.setattr(srt.customar, "live", lambda: [])
    notes = {"custom_all_reduce": {"tp": {"first_row": 0, "inputs": [[0x7E0000000000, 4096]]}}}
    with pytest.raises(PersistError, match=r"SAVE registered graph inputs for groups \['tp'\].*communicators for none"):
        srt.customar.CustomAllReduceV2().restore(sess, notes)


class StandInCustomAllReduce:
    """CustomAllReduceV2 as persistence drives it: pending graph inputs, a row counter, one row per registered input."""

    disabled = False

    def __init__(self, inputs: list[tuple[int, int]], counter: int = 0) -> None:
        self._graph_inputs, self._graph_counter = list(inputs), counter
        self.graph_params: list[Any] = [f"row{i}" for i in range(8)]
        self.registered: list[tuple[int, list[tuple[int, int]]]] = []

    def _register_graph_inputs(self) -> None:
        self.registered.append((self._graph_counter, list(self._graph_inputs)))
        self._graph_counter += len(self._graph_inputs)
        self._graph_inputs = []


def registering(srt: SimpleNamespace, mode: switch.Mode, monkeypatch: pytest.MonkeyPatch,
                comms: list[tuple[str, Any]]) -> tuple[engine.PersistSession, list[Any]]:  # fmt: skip
    """A session whose post-capture phase and declared state are recorded (`seen`), over these live communicators."""
    sess = open_session(srt, mode, Path("/nowhere"))
    seen: list[Any] = []

    @contextlib.contextmanager
    def phase(name: str, **_: Any) -> Iterator[None]:
        seen.append(("phase", name))
        yield
        seen.append(("end", name))

    monkeypatch.setattr(sess, "phase", phase)
    monkeypatch.setattr(sess, "declare_state", lambda name, what, how="bytes": seen.append((name, what, how)))
    monkeypatch.setattr(srt.customar, "live", lambda: comms)
    return sess, seen


def test_save_registers_every_pending_graph_input_once_after_the_capture_and_load_repeats_it(
    srt: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = StandInCustomAllReduce([(0x7E00, 4096), (0x7F00, 8192)], counter=2)
    sess, seen = registering(srt, switch.Mode.SAVE, monkeypatch, [("tp", saved)])
    srt.customar.CustomAllReduceV2().after_capture(sess)
    record = {"tp": {"first_row": 2, "inputs": [(0x7E00, 4096), (0x7F00, 8192)]}}
    assert sess.notes["custom_all_reduce"] == record and saved.registered == [(2, record["tp"]["inputs"])]
    rows = ("custom_all_reduce.tp.graph_params", ["row2", "row3"], "recreated")
    assert seen == [("phase", "custom_all_reduce"), ("end", "custom_all_reduce"), rows]
    loaded = StandInCustomAllReduce([])
    sess, seen = registering(srt, switch.Mode.LOAD, monkeypatch, [("tp", loaded)])
    srt.customar.CustomAllReduceV2().restore(sess, json.loads(json.dumps({"custom_all_reduce": record})))
    assert loaded.registered == saved.registered and seen == [
        ("phase", "custom_all_reduce"),
        ("end", "custom_all_reduce"),
        rows,
    ]


def test_load_refuses_a_communicator_that_already_holds_graph_inputs_or_is_not_v2(
    srt: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    notes = {"custom_all_reduce": {"tp": {"first_row": 0, "inputs": [[0x7E00, 4096]]}}}
    sess, seen = registering(srt, switch.Mode.LOAD, monkeypatch, [("tp", StandInCustomAllReduce([(0x1, 2)]))])
    with pytest.raises(PersistError, match=r"^graphpersist: the tp custom all-reduce already holds graph inputs"):
        srt.customar.CustomAllReduceV2().restore(sess, notes)
    sess, seen = registering(srt, switch.Mode.LOAD, monkeypatch, [("tp", SimpleNamespace(disabled=False))])
    with pytest.raises(PersistError, match=r"is SimpleNamespace, not CustomAllReduceV2"):
        srt.customar.CustomAllReduceV2().restore(sess, notes)
    assert seen == []  # refused before the phase: nothing registered


# ------------------------------------------------------------------------------------ against the pinned upstream


SA_READ = {"sa", "server_args"}


def _fields_read(module: Path) -> set[str]:
    """Every `sa.<name>` / `server_args.<name>` attribute the module reads."""
    tree = ast.parse(module.read_text())
    return {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in SA_READ
    }


def _pinned_server_args_fields(upstream_tree: Callable[[str], Path]) -> set[str]:
    tree = ast.parse((upstream_tree("sglang") / "sglang/srt/server_args.py").read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ServerArgs"]
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


@pytest.mark.network  # reads the pristine upstream tree (cached by the build)
def test_every_server_argument_persistence_reads_is_a_pinned_server_args_field(
    srt: SimpleNamespace, upstream_tree: Callable[[str], Path]
) -> None:
    """Read by name (`sa.<field>`) or through the refusals' table."""
    fields = _pinned_server_args_fields(upstream_tree)
    read = {f for name in ("facts", "engine", "deepep", "warmup")
            for f in _fields_read(OVERLAY_SRT / f"graphpersist_{name}.py")}  # fmt: skip
    read |= set(srt.facts.REFUSED)
    read -= {"graph_persist", "graph_persist_dir"}  # added by patch 0001
    assert read and read <= fields, f"not ServerArgs fields in 0.5.17: {sorted(read - fields)}"
    stand_in = set(StandInServerArgs.__dataclass_fields__)
    assert read <= stand_in, f"the stand-in lacks {sorted(read - stand_in)}"


@pytest.mark.network  # reads the pristine upstream tree (cached by the build)
def test_what_may_differ_and_the_secrets_are_pinned_server_args_fields(
    srt: SimpleNamespace, upstream_tree: Callable[[str], Path]
) -> None:
    """Every entry of the reviewed may-differ list is a field (a stale one would only make LOAD stricter, but says the
    review is out of date); the secret pattern matches exactly the pinned secrets (a new match is reviewed here); no
    field shares a name with a flag the glue derives (it would overwrite the field's record)."""
    fields = _pinned_server_args_fields(upstream_tree) | {"graph_persist", "graph_persist_dir"}  # + patch 0001's
    assert fields >= srt.facts.MAY_DIFFER, f"not ServerArgs fields in 0.5.17: {sorted(srt.facts.MAY_DIFFER - fields)}"
    assert {f for f in fields if srt.facts.SECRET.search(f)} == {"api_key", "admin_api_key", "ssl_keyfile_password"}
    derived = {"custom_all_reduce_v2", "decode_batch_sizes", "prefill_token_sizes", "memory_pool", "custom_all_reduce",
               "torch_symm_mem", engine.budget.FLAG}  # fmt: skip
    assert not derived & fields


# What each patch adds, and how to take it out again: the patched tree minus these is upstream's, AST for AST.
PROFILE = "self._profile_available_bytes(pre_model_load_memory)"
REVERSIONS = {
    "graphpersist_capture.new_graph()": "torch.cuda.CUDAGraph()",
    "graph_cls() if _is_xpu else graphpersist_capture.new_graph()": "graph_cls()",
    "memory_pool_config(self, pre_model_load_memory)": "self._resolve_memory_pool_config(pre_model_load_memory)",
    f"pool_budget(lambda: {PROFILE})": PROFILE,
    "graphpersist_customar.register_graph_inputs(self)": "self._register_graph_inputs()",
    "kill_process_tree(os.getpid(), include_parent=not refused())": "kill_process_tree(os.getpid())",
}


class _Revert(ast.NodeTransformer):
    """Takes the graph-persistence hooks out of a patched module: imports, calls, deferrals, substitutions."""

    def __init__(self) -> None:
        self.removed: list[str] = []
        self.imported: set[str] = set()  # names imported from the overlays (`from sglang.srt.graphpersist_x import f`)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> Any:
        if "graphpersist" in ast.unparse(node):
            self.removed.append(ast.unparse(node))
            self.imported |= {a.asname or a.name for a in node.names}
            return None
        return node

    def visit_Expr(self, node: ast.Expr) -> Any:
        text = ast.unparse(node)
        if text in REVERSIONS:
            return self.generic_visit(node)
        call = node.value
        if isinstance(call, ast.Call) and (
            "graphpersist" in ast.unparse(call.func)
            or (isinstance(call.func, ast.Name) and call.func.id in self.imported)
        ):
            self.removed.append(text)
            return None
        return self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> Any:
        """`def capture_now(): <upstream's capture>` then `if not defer(..., capture_now): capture_now()` (patch 0004)
        -> upstream's capture."""
        body: list[ast.stmt] = []
        for stmt in node.body:
            defined = body[-1].name if body and isinstance(body[-1], ast.FunctionDef) else None
            if (
                isinstance(stmt, ast.If)
                and ast.unparse(stmt.test) == f"not graphpersist_capture.defer('decode', self, {defined})"
            ):
                self.removed.append(f"if {ast.unparse(stmt.test)}")
                body[-1:] = body[-1].body
            else:
                body.append(stmt)
        node.body = body
        return self.generic_visit(node)

    def visit_If(self, node: ast.If) -> Any:
        test = ast.unparse(node.test)
        if test != "not graphpersist_capture.defer('prefill', self, self.capture)":
            return self.generic_visit(node)
        self.removed.append(f"if {test}")
        return node.body  # `if not defer(..., self.capture): self.capture()` -> `self.capture()`

    def visit_Call(self, node: ast.Call) -> Any:
        """`refusal_or(upstream_error)` (patch 0010) -> `upstream_error`."""
        if isinstance(node.func, ast.Name) and node.func.id in self.imported and node.func.id == "refusal_or":
            self.removed.append(f"{node.func.id}(...)")
            return self.generic_visit(node.args[0])
        return self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> Any:
        """`upstream_test and not keep_without_multicast(...)` (patch 0007) -> `upstream_test`."""
        kept = [v for v in node.values if not self._negated_overlay_call(v)]
        if len(kept) == len(node.values):
            return self.generic_visit(node)
        self.removed += [ast.unparse(v) for v in node.values if self._negated_overlay_call(v)]
        return self.generic_visit(kept[0] if len(kept) == 1 else ast.BoolOp(op=node.op, values=kept))

    def _negated_overlay_call(self, node: ast.AST) -> bool:
        return (
            isinstance(node, ast.UnaryOp)
            and isinstance(node.op, ast.Not)
            and isinstance(node.operand, ast.Call)
            and isinstance(node.operand.func, ast.Name)
            and node.operand.func.id in self.imported
        )

    def generic_visit(self, node: ast.AST) -> ast.AST:
        for name, value in ast.iter_fields(node):
            if isinstance(value, ast.expr) and ast.unparse(value) in REVERSIONS:
                self.removed.append(ast.unparse(value))
                setattr(node, name, ast.parse(REVERSIONS[ast.unparse(value)], mode="eval").body)
        return super().generic_visit(node)


@pytest.mark.network  # reads the pristine upstream tree (cached by the build)
def test_patched_files_are_upstream_plus_the_hooks_only(
    upstream_tree: Callable[[str], Path], repo_root: Path, tmp_path: Path
) -> None:
    from gptools import apply as gpapply
    from gptools import series as gpseries

    patches_dir = repo_root / "patches" / "sglang"
    names = gpseries.read_series(patches_dir).names
    switch, *patches = [gpseries.read_patch(patches_dir / n) for n in names]  # 0001 (fields): its own test
    pristine = upstream_tree("sglang")
    touched = sorted(gpapply.touched_paths(patches))
    base, patched = tmp_path / "base", tmp_path / "patched"
    for rel in touched:
        for root in (base, patched):
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(pristine / rel, root / rel)
    assert gpapply.touched_paths([switch]) <= set(touched)  # server_args.py: 0009 applies to 0001's result
    for root in (base, patched):  # so the base of the comparison is upstream + 0001, both sides without its hooks
        gpapply.apply_patch(root, switch)
    for patch in patches:
        gpapply.apply_patch(patched, patch)
    removed_all: list[str] = []
    for rel in touched:
        reverter = _Revert()
        reverted = ast.fix_missing_locations(reverter.visit(ast.parse((patched / rel).read_text())))
        base_reverter = _Revert()  # 0001's own hooks, taken out of both sides
        expected = ast.fix_missing_locations(base_reverter.visit(ast.parse((base / rel).read_text())))
        removed = list(reverter.removed)
        for line in base_reverter.removed:
            removed.remove(line)
        assert removed, f"{rel}: no hook found in the patched file"
        removed_all += removed
        assert ast.dump(reverted) == ast.dump(expected), (
            f"{rel}: with the hooks taken out the patched file is not upstream's"
        )
    assert len(touched) == 12
    assert sum("import" in r for r in removed_all) == 15 and sum("defer" in r for r in removed_all) == 2
    assert [r for r in removed_all if "refus" in r] == [
        "from sglang.srt.graphpersist_switch import refused",
        "kill_process_tree(os.getpid(), include_parent=not refused())",
        "from sglang.srt.graphpersist_switch import refusal_or",
        "refusal_or(...)",
    ]
    assert [r for r in removed_all if "after_graphs" in r] == [
        "from sglang.srt.graphpersist_engine import after_graphs",
        "after_graphs(self)",
    ]


PY312 = Path("/root/.pyenv/versions/3.12.1/bin/python")


@pytest.mark.skipif(not PY312.exists(), reason=f"{PY312} not found: the 3.12 compile check is NOT RUN")
def test_the_built_wheel_carries_every_overlay_and_patched_file_compiling_with_python_312(
    dist_dir: Path, repo_root: Path, tmp_path: Path
) -> None:
    import subprocess
    import zipfile

    from gptools import apply as gpapply
    from gptools import series as gpseries

    patches_dir = repo_root / "patches" / "sglang"
    patched = gpapply.touched_paths(
        [gpseries.read_patch(patches_dir / n) for n in gpseries.read_series(patches_dir).names]
    )
    overlays = {f"sglang/srt/{p.name}" for p in OVERLAY_SRT.glob("graphpersist_*.py")}
    assert len(overlays) == len(MODULES)
    [wheel] = sorted(dist_dir.glob("sglang-0.5.17+gp.*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        for name in sorted(patched | overlays):
            zf.extract(name, tmp_path)
    for name in overlays:  # the wheel carries the overlay as it is in the repository
        assert (tmp_path / name).read_bytes() == (OVERLAY_SRT / Path(name).name).read_bytes()
    files = [str(tmp_path / n) for n in sorted(patched | overlays)]
    proc = subprocess.run([str(PY312), "-m", "py_compile", *files], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_sessions_lines_go_to_sglangs_own_logger(
    srt: SimpleNamespace, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The serve proof reads `graphpersist: rank R: saved N graphs` from SGLang's log: the session logs through the
    adapter's logger, one SGLang's logging configuration prints (a logger of the runtime's own was not printed by
    `vllm serve`, 2026-12-03)."""
    sess = open_session(srt, switch.Mode.SAVE, tmp_path, saver=StandInSaver())
    with caplog.at_level(logging.INFO, logger="sglang.srt.graphpersist"):
        sess.log("saved %d graphs to %s", 3, tmp_path)
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("sglang.srt.graphpersist", f"graphpersist: rank 0: saved 3 graphs to {tmp_path}")
    ]


FA3_FWD_DECODE = (  # sgl-kernel 0.4.5's FA3 forward kernel of decode/128 (Qwen3-8B, TP=1), as the pinned wheel names it
    "_ZN7cutlass13device_kernelIN5flash20enable_sm90_or_laterINS1_16FlashAttnFwdSm90INS1_25CollectiveMainloopFwdSm90"
    "ILi2EN4cute5tupleIJNS5_1CILi1EEES8_S8_EEENS6_IJNS7_ILi64EEENS7_ILi128EEESB_EEELi128ENS_10bfloat16_tEfNS_4arch4Sm90E"
    "Lb1ELb0ELb0ELb1ELb1ELb0ELb0ELb0ELb1ELb1ELb1ELb1ELb0ESD_Lb0ELi1EEENS1_21CollectiveEpilogueFwdISC_S9_SD_SF_Li128ELb1E"
    "Lb1ELb1ELb0EEENS1_36VarlenDynamicPersistentTileSchedulerILi64ELi128ELi128ELi128ELb1ELb1ELb1ELb1ELb1ELb1EEEEEEEEEvNT_"
    "6ParamsE"
)
# the same kernel with the sixth bool (AppendKV) set: some of these take the Params block's address, so no rule
FA3_FWD_APPEND_KV = FA3_FWD_DECODE.replace("Sm90ELb1ELb0ELb0ELb1ELb1ELb0E", "Sm90ELb1ELb0ELb0ELb1ELb1ELb1E")


def test_fa3_forward_bytes_it_never_reads_are_written_as_zeros(srt: SimpleNamespace) -> None:
    """TP=1 SAVEs (2026-12-03) differed in sgl-kernel's FA3 forward parameter bytes 816-823 and 1072-1079 in one pair
    and 176-183 in another (0x501a00000001 vs 0, 1): SAVE zeroes every byte these kernels never read, only those."""
    from graphpersist.graph import walk as graphwalk

    unused = graphwalk.cached_unused(srt.adapter.SglangAdapter(SimpleNamespace()).unused_param_bytes)
    assert unused is not None
    layout = [(112, 2560)]  # the decode kernel's EIATTR_KPARAM_INFO: the 128-aligned Params block at buffer byte 112
    raw = bytearray(b"\xab" * 2672)
    for at in (176, 816, 1072):
        raw[at : at + 8] = (0x501A00000001).to_bytes(8, "little")
    ranges = unused(FA3_FWD_DECODE, layout)
    got = graphwalk.zero_ranges(bytes(raw), ranges)
    assert got[176:184] == got[816:824] == got[1072:1080] == bytes(8)
    zeroed = {i for a, b in ranges for i in range(a, b)}
    assert all(got[i] == 0xAB for i in range(2672) if i not in zeroed)  # every other byte as captured
    assert got[168:172] == b"\xab" * 4 and got[184:192] == b"\xab" * 8  # read by these kernels: kept
    assert all(112 <= a < b <= 2672 for a, b in ranges) and len(zeroed) == 1516
    # the three Params sizes of the matching instances all hold the ranges; the offsets are the buffer's
    assert unused(FA3_FWD_DECODE, [(112, 2688)]) == unused(FA3_FWD_DECODE, [(112, 2944)]) == ranges
    assert unused(FA3_FWD_APPEND_KV, layout) == []  # appends KV: not checked byte by byte, nothing zeroed
    other_head = FA3_FWD_DECODE.replace("ELi128ENS_10bfloat16_t", "ELi64ENS_10bfloat16_t")
    assert unused(other_head, layout) == []  # another instantiation's reads were not checked: nothing zeroed
    assert unused("_ZN5flash16FlashAttnFwdCombineIJEEEvv", layout) == []
    assert unused.named == {FA3_FWD_DECODE: ranges}  # what SAVE's log counts


def test_rule_offsets_are_the_parameter_buffers_and_must_lie_in_the_named_parameter() -> None:
    """engine.bytes_in_param: what both engines' FA3 rules stand on."""
    assert engine.bytes_in_param([(112, 2688)], 0, ((816, 824),)) == [(816, 824)]
    assert engine.bytes_in_param([(112, 2688)], 0, ((100, 120),)) == []  # starts before the block
    assert engine.bytes_in_param([(112, 2688)], 0, ((2796, 2804),)) == []  # ends past it
    assert engine.bytes_in_param([(0, 8), (8, 16)], 1, ((8, 24),)) == [(8, 24)]
    assert engine.bytes_in_param([(0, 8)], 1, ((0, 8),)) == []  # no such parameter


def test_an_fa3_forward_kernel_of_another_layout_is_left_alone_and_said(
    srt: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    """The rule was checked for one Params block; any other layout keeps its bytes, with a warning naming it."""
    adapter = srt.adapter.SglangAdapter(SimpleNamespace())
    with caplog.at_level(logging.WARNING, logger="sglang.srt.graphpersist"):
        assert adapter.unused_param_bytes(FA3_FWD_DECODE, [(0, 8), (8, 2792)]) == []
        assert adapter.unused_param_bytes(FA3_FWD_DECODE, [(0, 2800)]) == []  # one block, but not at byte 112
    assert "parameter layout [(0, 8), (8, 2792)], not the one checked" in caplog.text
    assert "parameter layout [(0, 2800)], not the one checked" in caplog.text


def test_the_cache_folders_are_sglangs_own_as_the_scheduler_resolves_them_then_the_shared_ones(
    srt: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TVM_FFI_CACHE_DIR", "~/tvm")
    monkeypatch.setenv("SGLANG_CACHE_DIR", "")  # empty: SGLang's default
    monkeypatch.delenv("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", raising=False)
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path / "tmp"))
    monkeypatch.setattr("getpass.getuser", lambda: "someone")
    resolvers = srt.adapter.SglangAdapter(SimpleNamespace()).cache_resolvers()
    assert list(resolvers) == ["tvm_ffi", "sglang", "flashinfer", "flashinfer_cubins", "triton", "inductor", "cute_dsl"]
    assert resolvers["tvm_ffi"]() == tmp_path / "home" / "tvm"
    assert resolvers["sglang"]() == tmp_path / "home" / ".cache" / "sglang"
    assert resolvers["cute_dsl"]() == tmp_path / "tmp" / "someone" / "flash_attention_cute_dsl_cache"
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(tmp_path / "cute"))
    assert resolvers["cute_dsl"]() == tmp_path / "cute"
    assert resolvers["triton"] is engine.cache_folders()["triton"]
