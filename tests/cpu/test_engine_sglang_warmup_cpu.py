"""SAVE's first requests (overlays/sglang/sglang/srt/graphpersist_warmup.py) and where SAVE runs them
(`graphpersist_engine.after_graphs`), checked on CPU without SGLang or torch.

The batches SAVE runs are a pure plan, pinned here for SGLang's defaults and for the limits that leave batches out.
The driver runs against stand-ins for torch and for the SGLang classes it calls (Req, ScheduleBatch, ForwardBatch,
SamplingParams, the model runner and its pools), which record what they are asked and hand out KV slots as SGLang's
allocator does (a slice of its free list). The pinned upstream tree (tests marked network: the build cache holds it)
proves the calls follow SGLang's own one-batch benchmark, that the kernels the module names are where it says, and
the assumptions the plan rests on. What this does NOT prove: that the batches compile every kernel a first request
compiles on the GPU host (the recipe's load_fresh run does: no new JIT cache file on its first request).
"""

from __future__ import annotations

import ast
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import test_engine_sglang_persist_cpu as persist_cpu

from graphpersist import switch
from graphpersist.engine import session as engine_session
from graphpersist.errors import PersistError

srt = persist_cpu.srt  # the fixture: the overlay modules imported as sglang.srt.* from the overlay folder

H200_TP2 = {  # what SGLang 0.5.17 resolves for Qwen3-8B at TP=2 on an H200 (recipes/sglang-qwen3-8b-tp2)
    "max_decode_graph_bs": 256,
    "max_prefill_graph_tokens": 8192,
    "max_extend_tokens": 8192,
    "max_requests": 2048,
    "max_tokens": 888376,
    "context_len": 4096,
}


# -------------------------------------------------------------------------------------------------- the plan


def limits(srt: SimpleNamespace, **changes: Any) -> Any:
    return srt.warmup.Limits(**{**H200_TP2, **changes})


def test_the_default_tp2_start_runs_a_first_request_and_every_batch_shape_sglang_serves(srt: SimpleNamespace) -> None:
    batches, left_out = srt.warmup.plan(limits(srt))
    w = srt.warmup
    assert [(b.key, b.prompt_lens[:3], len(b.prompt_lens), b.decode_steps) for b in batches] == [
        ("first", (7,), 1, 2),
        ("misaligned", (5, 16, 30), 3, 2),
        ("min_p", (9, 2), 2, 2),
        ("prefix", (13,), 1, 1),
        ("one_token", (1,), 1, 1),
        ("sixteen", (16, 16, 16), 16, 1),
        ("eager_decode", (2, 2, 2), 257, 1),
    ]
    assert [b.sampling for b in batches[:4]] == [w.GREEDY, w.TOP_K_TOP_P, w.MIN_P_PENALTIES, w.GREEDY]
    assert batches[5].sampling == {} and batches[3].prefix_of == "first"
    assert left_out == [
        "an eager prefill of 8193 tokens: a prefill batch holds at most 8192 tokens here, so SGLang never runs one"
    ]


def test_the_limits_are_read_from_the_runners_pools_and_prefill_caps(srt: SimpleNamespace) -> None:
    mr = SimpleNamespace(
        server_args=SimpleNamespace(chunked_prefill_size=-1, max_prefill_tokens=16384),
        req_to_token_pool=SimpleNamespace(size=2048),
        token_to_kv_pool_allocator=SimpleNamespace(available_size=lambda: 888376),
        model_config=SimpleNamespace(context_len=4096),
    )
    assert srt.warmup.limits_of(mr, RUNNERS) == limits(srt, max_extend_tokens=16384)
    mr.server_args.chunked_prefill_size = 8192
    assert srt.warmup.limits_of(mr, RUNNERS).max_extend_tokens == 8192
    assert srt.warmup.limits_of(mr, {"decode": RUNNERS["decode"]}).max_prefill_graph_tokens is None


def test_the_first_two_prefills_take_kv_slots_at_both_alignments(srt: SimpleNamespace) -> None:
    """Triton specialises write_req_to_token_pool_triton on whether out_cache_loc (int64 slots, a slice of the
    allocator's free list) is 16-byte aligned: an even number of slots before a prefill, or an odd one."""
    first, second = srt.warmup.plan(limits(srt))[0][:2]
    slots_before = [0, first.new_tokens]  # the allocator is untouched before the first; the first takes 7 + 2
    assert {n % 2 for n in slots_before} == {0, 1} and second.prefix_of is None


def test_the_batches_cover_what_triton_specialises_integers_on(srt: SimpleNamespace) -> None:
    batches, _ = srt.warmup.plan(limits(srt))
    requests = {len(b.prompt_lens) for b in batches}
    prefill_tokens = {sum(b.prompt_lens) for b in batches}
    assert 1 in requests and any(n % 16 == 0 for n in requests) and any(n > 1 and n % 16 for n in requests)
    assert 1 in prefill_tokens and any(n % 16 == 0 for n in prefill_tokens) and any(n % 16 for n in prefill_tokens)


def test_chunked_prefill_above_the_largest_prefill_graph_adds_an_eager_prefill(srt: SimpleNamespace) -> None:
    batches, left_out = srt.warmup.plan(limits(srt, max_extend_tokens=16384, context_len=32768))
    assert [(b.key, b.prompt_lens) for b in batches[-1:]] == [("eager_prefill", (8193,))] and left_out == []
    batches, left_out = srt.warmup.plan(limits(srt, max_extend_tokens=None))  # prompts shorter than the context
    assert (batches[-1].key, batches[-1].prompt_lens, sum(batches[-1].prompt_lens)) == (
        "eager_prefill", (4094, 4094, 5), 8193)  # fmt: skip


def test_without_prefill_graphs_there_is_no_eager_prefill_to_add(srt: SimpleNamespace) -> None:
    batches, left_out = srt.warmup.plan(limits(srt, max_prefill_graph_tokens=None))
    assert "eager_prefill" not in {b.key for b in batches} and left_out == []


def test_a_pool_no_larger_than_the_largest_decode_graph_leaves_the_eager_decode_out(srt: SimpleNamespace) -> None:
    batches, left_out = srt.warmup.plan(limits(srt, max_requests=256))
    assert "eager_decode" not in {b.key for b in batches}
    assert left_out[0] == "an eager decode of 257 requests: the request pool holds 256, so SGLang never runs one"


def test_batches_that_do_not_fit_are_left_out_and_named_and_a_prefix_needs_its_first(srt: SimpleNamespace) -> None:
    batches, left_out = srt.warmup.plan(limits(srt, max_tokens=8))
    assert [b.key for b in batches] == ["one_token"]
    assert "the first request: 7 tokens, greedy (prefill graph, decode graph at 1): it does not fit (9 KV slots, 8 " \
           "free; context length 4096)" in left_out  # fmt: skip
    assert "a radix-cache hit: the first prompt and 6 tokens more: its prefix batch was left out" in left_out
    batches, left_out = srt.warmup.plan(limits(srt, context_len=20))
    assert "misaligned" not in {b.key for b in batches} and "sixteen" in {b.key for b in batches}


# --------------------------------------------------------------------------- stand-ins for torch and SGLang


class T:
    """A 1-D tensor stand-in: values, a dtype name and a device type."""

    def __init__(self, values: Any, dtype: str = "int64", device: str = "cuda") -> None:
        self.values, self.dtype, self.device = list(values), dtype, SimpleNamespace(type=device)

    def tolist(self) -> list[Any]:
        return list(self.values)

    def to(self, *args: Any, copy: bool = False, non_blocking: bool = False) -> T:
        target = args[0] if args else self.dtype
        if target in ("cuda", "cpu"):
            return T(self.values, self.dtype, target)
        return self if target == self.dtype and not copy else T(self.values, target, self.device.type)

    def clone(self) -> T:
        return T(self.values, self.dtype, self.device.type)

    def copy_(self, other: T) -> None:
        self.values[:] = other.values

    def __getitem__(self, s: slice) -> T:
        return T(self.values[s], self.dtype, self.device.type)

    def __len__(self) -> int:
        return len(self.values)


class Table:
    """req_to_token: one row of KV slots per request slot."""

    def __init__(self) -> None:
        self.rows: dict[int, list[int]] = {}

    def __getitem__(self, key: tuple[int, slice]) -> T:
        row, cols = key
        return T(self.rows[row][cols], "int32")


class Allocator:
    """TokenToKVPoolAllocator's bookkeeping: alloc hands out a slice and replaces the free list, never mutating it."""

    def __init__(self, size: int) -> None:
        self.free_pages = T(range(1, size + 1))
        self.release_pages = T([])
        self.taken_at: list[int] = []  # how many slots were handed out before each alloc
        self.size = size

    def available_size(self) -> int:
        return len(self.free_pages)

    def alloc(self, n: int) -> T:
        self.taken_at.append(self.size - len(self.free_pages))
        out, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        return out


class ReqPool:
    def __init__(self, size: int) -> None:
        self.size = size
        self.free_slots = list(range(1, size + 1))
        self.req_generation = T([0] * (size + 1), device="cpu")
        self.req_to_token = Table()

    def alloc(self, reqs: list[Any]) -> list[int]:
        for r in reqs:
            r.req_pool_idx, self.free_slots = self.free_slots[0], self.free_slots[1:]
            self.req_generation.values[r.req_pool_idx] += 1
        return [r.req_pool_idx for r in reqs]

    def free(self, req: Any) -> None:
        self.free_slots.append(req.req_pool_idx)
        req.req_pool_idx = None


class Upstream:
    """The SGLang and torch modules the warm-up imports, as stand-ins that record every call."""

    def __init__(self) -> None:
        self.calls: list[Any] = []
        self.rng = {"cpu": "cpu state 0", "cuda": "cuda state 0"}
        self.rng_set: list[tuple[str, Any]] = []
        up = self

        class SamplingParams:
            def __init__(self, **kwargs: Any) -> None:
                self.kwargs, self.checked = kwargs, []

            def normalize(self, tokenizer: Any) -> None:  # what the tokenizer manager calls, the warm-up not
                self.checked.append(("normalize", tokenizer))

        class Req:
            def __init__(self, *, rid: str, origin_input_text: str, origin_input_ids: Any, sampling_params: Any):
                self.rid, self.origin_input_ids, self.sampling_params = rid, origin_input_ids, sampling_params
                self.prefix_indices = T([])
                self.output_ids: list[int] = []
                self.req_pool_idx = None

            def set_extend_range(self, start: int, end: int) -> None:
                self.extend_range = (start, end)

        class ScheduleBatch:
            @classmethod
            def init_new(cls, **kwargs: Any) -> ScheduleBatch:
                up.calls.append(("init_new", len(kwargs["reqs"])))
                sb = cls()
                sb.kw, sb.reqs, sb.device, sb.input_ids = kwargs, kwargs["reqs"], "cuda", None
                return sb

            def prepare_for_extend(self) -> None:
                up.calls.append(("prepare_for_extend", len(self.reqs)))
                pool, alloc = self.kw["req_to_token_pool"], self.kw["token_to_kv_pool_allocator"]
                pool.alloc(self.reqs)
                ids: list[int] = []
                for r in self.reqs:
                    start, end = r.extend_range
                    new = alloc.alloc(end - start)
                    pool.req_to_token.rows[r.req_pool_idx] = r.prefix_indices.tolist() + new.tolist()
                    ids += list(r.full_untruncated_fill_ids[start:end])
                self.prefill_input_ids_cpu, self.mode = T(ids, device="cpu"), "extend"

            def prepare_for_decode(self) -> None:
                up.calls.append(("prepare_for_decode", len(self.reqs), self.input_ids.dtype, self.input_ids.tolist()))
                pool, alloc = self.kw["req_to_token_pool"], self.kw["token_to_kv_pool_allocator"]
                for r, slot in zip(self.reqs, alloc.alloc(len(self.reqs)).tolist(), strict=True):
                    pool.req_to_token.rows[r.req_pool_idx].append(slot)
                self.mode = "decode"

        class ForwardBatch:
            @staticmethod
            def init_new(batch: Any, model_runner: Any, *, return_hidden_states_before_norm: bool) -> Any:
                up.calls.append(("ForwardBatch.init_new", return_hidden_states_before_norm))
                return SimpleNamespace(batch=batch, mode=batch.mode, bs=len(batch.reqs))

        class DynamicGradMode:
            def __enter__(self) -> None:
                up.calls.append("grad mode on")

            def __exit__(self, *exc: Any) -> None:
                up.calls.append("grad mode off")

        @contextmanager
        def stream(s: Any) -> Iterator[None]:
            up.calls.append(("stream", s))
            yield

        torch = ModuleType("torch")
        torch.int64 = "int64"  # type: ignore[attr-defined]
        torch.get_rng_state = lambda: up.rng["cpu"]  # type: ignore[attr-defined]
        torch.set_rng_state = lambda s: up.rng_set.append(("cpu", s))  # type: ignore[attr-defined]
        torch.cuda = SimpleNamespace(  # type: ignore[attr-defined]
            get_rng_state=lambda: up.rng["cuda"],
            set_rng_state=lambda s: up.rng_set.append(("cuda", s)),
            synchronize=lambda: None,
            stream=stream,
        )

        def extend(reqs: list[Any], model_runner: Any) -> tuple[Any, Any, Any]:
            """sglang.benchmark.one_batch.extend, as upstream's: its own tree cache, the scheduler's input staging."""
            allocator = model_runner.token_to_kv_pool_allocator
            tree_cache = SimpleNamespace(
                page_size=model_runner.server_args.page_size, token_to_kv_pool_allocator=allocator
            )
            batch = ScheduleBatch.init_new(
                reqs=reqs, req_to_token_pool=model_runner.req_to_token_pool,
                token_to_kv_pool_allocator=model_runner.token_to_kv_pool_allocator, tree_cache=tree_cache,
                model_config=model_runner.model_config, enable_overlap=False, spec_algorithm="NONE",
            )  # fmt: skip
            batch.prepare_for_extend()
            batch.input_ids, batch.prefill_input_ids_cpu = batch.prefill_input_ids_cpu.to(batch.device), None
            fb = ForwardBatch.init_new(batch, model_runner, return_hidden_states_before_norm=False)
            logits_output = model_runner.forward(fb).logits_output
            return model_runner.sample(logits_output, fb), "next token logits", batch

        def decode(input_token_ids: Any, batch: Any, model_runner: Any) -> tuple[Any, Any]:
            batch.input_ids = input_token_ids.to(torch.int64)
            batch.prepare_for_decode()
            fb = ForwardBatch.init_new(batch, model_runner, return_hidden_states_before_norm=False)
            logits_output = model_runner.forward(fb).logits_output
            return model_runner.sample(logits_output, fb), "next token logits"

        self.modules = {
            "sglang.benchmark.one_batch": SimpleNamespace(extend=extend, decode=decode),
            "torch": torch,
            "sglang.srt.utils.common": SimpleNamespace(DynamicGradMode=DynamicGradMode),
            "sglang.srt.sampling.sampling_params": SimpleNamespace(SamplingParams=SamplingParams),
            "sglang.srt.managers.schedule_batch": SimpleNamespace(Req=Req, ScheduleBatch=ScheduleBatch),
            "sglang.srt.model_executor.forward_batch_info": SimpleNamespace(ForwardBatch=ForwardBatch),
        }


class ModelRunner:
    """The model runner as the warm-up sees it: pools, configs, a forward that replays graphs within their sizes."""

    def __init__(self, up: Upstream, *, requests: int = 2048, slots: int = 100_000) -> None:
        self.up = up
        self.server_args = SimpleNamespace(page_size=1, chunked_prefill_size=8192, max_prefill_tokens=16384)
        self.model_config = SimpleNamespace(vocab_size=1000, context_len=4096)
        self.req_to_token_pool = ReqPool(requests)
        self.token_to_kv_pool_allocator = Allocator(slots)
        self.device, self.spec_algorithm, self.forward_stream, self.forward_pass_id = "cuda", "NONE", "fwd", 5
        self.fail_at: int | None = None

    def forward(self, fb: Any) -> Any:
        self.forward_pass_id += 1
        tokens = len(fb.batch.input_ids) if fb.mode == "extend" else fb.bs
        if self.fail_at is not None and self.forward_pass_id >= self.fail_at:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        graph = 1 < tokens <= 8192 if fb.mode == "extend" else fb.bs <= 256
        self.up.calls.append(("forward", fb.mode, "graph" if graph else "eager"))
        return SimpleNamespace(can_run_graph=graph, logits_output=f"logits {self.forward_pass_id}")

    def sample(self, logits_output: Any, fb: Any) -> T:
        self.up.calls.append(("sample", logits_output))
        return T([(3 * i + 11) % 1000 for i in range(fb.bs)], "int32")


RUNNERS = {
    "decode": SimpleNamespace(capture_bs=[1, 2, 4, 256]),
    "prefill": SimpleNamespace(capture_num_tokens=[4, 8192]),
}


@pytest.fixture
def upstream(monkeypatch: pytest.MonkeyPatch) -> Upstream:
    up = Upstream()
    for name, module in up.modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return up


def served(srt: SimpleNamespace, up: Upstream, mr: ModelRunner) -> tuple[Any, list[str]]:
    logged: list[str] = []
    outcome = srt.warmup.run(mr, RUNNERS, lambda msg, *a: logged.append(msg % a))
    return outcome, logged


# --------------------------------------------------------------------------------------------------- the driver


def test_each_batch_runs_as_sglangs_one_batch_benchmark_runs_it(srt: SimpleNamespace, upstream: Upstream) -> None:
    mr = ModelRunner(upstream)
    outcome, _ = served(srt, upstream, mr)
    calls = upstream.calls
    assert calls[:2] == ["grad mode on", ("stream", "fwd")] and calls[-1] == "grad mode off"
    first = calls[2:16]
    assert first == [
        ("init_new", 1), ("prepare_for_extend", 1), ("ForwardBatch.init_new", False), ("forward", "extend", "graph"),
        ("sample", "logits 6"),
        ("prepare_for_decode", 1, "int64", [11]), ("ForwardBatch.init_new", False), ("forward", "decode", "graph"),
        ("sample", "logits 7"),
        ("prepare_for_decode", 1, "int64", [11]), ("ForwardBatch.init_new", False), ("forward", "decode", "graph"),
        ("sample", "logits 8"),
        ("init_new", 3),
    ]  # fmt: skip
    assert outcome.batches == ["first", "misaligned", "min_p", "prefix", "one_token", "sixteen", "eager_decode"]
    forwards = [c for c in calls if c[0] == "forward"]
    assert ("forward", "extend", "eager") in forwards and ("forward", "decode", "eager") in forwards
    assert outcome.eager_forwards == 2 and outcome.graph_forwards == len(forwards) - 2


def test_the_dummy_requests_sample_as_the_tokenizer_manager_leaves_them(
    srt: SimpleNamespace, upstream: Upstream
) -> None:
    seen: list[Any] = []
    original = upstream.modules["sglang.srt.managers.schedule_batch"].ScheduleBatch.init_new

    def init_new(**kwargs: Any) -> Any:
        seen.append(kwargs)
        return original(**kwargs)

    upstream.modules["sglang.srt.managers.schedule_batch"].ScheduleBatch.init_new = init_new
    mr = ModelRunner(upstream)
    served(srt, upstream, mr)
    assert seen[0]["tree_cache"].token_to_kv_pool_allocator is mr.token_to_kv_pool_allocator
    reqs = [r for k in seen for r in k["reqs"]]
    assert all(r.sampling_params.checked == [] for r in reqs), "as SGLang's one-batch benchmark leaves them"
    assert all(0 <= t < 1000 for r in reqs for t in r.origin_input_ids)
    assert reqs[1].sampling_params.kwargs == srt.warmup.TOP_K_TOP_P
    assert reqs[0].output_ids == [11, 11, 11], "each forward's token goes to its request, as the scheduler does"
    assert len({r.rid for r in reqs}) == len(reqs) and reqs[0].rid == "graphpersist-warmup-1"


def test_the_radix_cache_hit_reuses_the_first_prompts_kv_slots_as_its_prefix(
    srt: SimpleNamespace, upstream: Upstream
) -> None:
    mr = ModelRunner(upstream)
    seen: list[Any] = []
    original = upstream.modules["sglang.srt.managers.schedule_batch"].ScheduleBatch.init_new
    upstream.modules["sglang.srt.managers.schedule_batch"].ScheduleBatch.init_new = lambda **k: (
        seen.append(k["reqs"]) or original(**k)
    )
    served(srt, upstream, mr)
    first, hit = seen[0][0], seen[3][0]
    assert hit.prefix_indices.tolist() == [1, 2, 3, 4, 5, 6, 7] and hit.prefix_indices.dtype == "int64"
    assert list(hit.origin_input_ids[:7]) == list(first.origin_input_ids) and hit.extend_range == (7, 13)


def test_the_first_two_prefills_get_their_kv_slots_aligned_and_misaligned(
    srt: SimpleNamespace, upstream: Upstream
) -> None:
    mr = ModelRunner(upstream)
    taken_at = mr.token_to_kv_pool_allocator.taken_at  # the snapshot puts back an empty copy afterwards
    served(srt, upstream, mr)
    assert taken_at[:4] == [0, 7, 8, 9]  # prefill 1, its two decode steps, prefill 2


def test_what_the_batches_changed_is_put_back(srt: SimpleNamespace, upstream: Upstream) -> None:
    mr = ModelRunner(upstream)
    alloc, pool = mr.token_to_kv_pool_allocator, mr.req_to_token_pool
    free_pages, release_pages, generation = alloc.free_pages, alloc.release_pages, pool.req_generation
    slots = list(pool.free_slots)
    served(srt, upstream, mr)
    assert alloc.free_pages is free_pages and alloc.release_pages is release_pages and len(free_pages) == 100_000
    assert pool.free_slots == slots and pool.req_generation is generation and set(generation.values) == {0}
    assert upstream.rng_set == [("cpu", "cpu state 0"), ("cuda", "cuda state 0")] and mr.forward_pass_id == 5
    assert "forward" not in vars(mr), "the forward that counts graph replays is the warm-up's only"


def test_a_failing_forward_puts_everything_back_and_raises_what_sglang_raised(
    srt: SimpleNamespace, upstream: Upstream
) -> None:
    mr = ModelRunner(upstream)
    mr.fail_at = 9
    slots = list(mr.req_to_token_pool.free_slots)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        served(srt, upstream, mr)
    assert mr.req_to_token_pool.free_slots == slots and mr.forward_pass_id == 5 and len(upstream.rng_set) == 2
    assert "forward" not in vars(mr)


def test_a_small_pool_serves_what_fits_and_says_what_it_left_out(srt: SimpleNamespace, upstream: Upstream) -> None:
    mr = ModelRunner(upstream, requests=200)
    outcome, logged = served(srt, upstream, mr)
    assert "eager_decode" not in outcome.batches and outcome.eager_forwards == 1
    assert logged == [
        "kernel warm-up left out an eager decode of 257 requests: the request pool holds 200, so SGLang never runs one",
        "kernel warm-up left out an eager prefill of 8193 tokens: a prefill batch holds at most 8192 tokens here, so "
        "SGLang never runs one",
    ]


# ---------------------------------------------------------------------------------- where SAVE runs it (engine)


class RecordingSaver:
    """Stands in for graphpersist.api.Saver.save: calls before_write, then (rank 0) shared, as the runtime does."""

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.kwargs: dict[str, Any] = {}

    def save(self, directory: Path, facts: Any, **kwargs: Any) -> dict[str, Any]:
        self.kwargs = kwargs
        self.events.append("archive fixed")
        kwargs["before_write"]()
        if kwargs["shared"] is not None:
            kwargs["shared"]()
        self.events.append("written")
        return {
            "serialize_s": 0.5,
            "images": 3,
            "split_s": {"prepare": 0.6, "write": 0.2, "shared": 0.1, "commit": 0.0},
        }


@pytest.fixture
def saving(
    srt: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Callable[[], tuple[Any, list[str]]]:
    """A SAVE session whose graphs() ran, with the engine's collaborators stood in for."""

    def make() -> tuple[Any, list[str]]:
        events: list[str] = []
        cache = tmp_path / "triton"
        cache.mkdir()
        sess = persist_cpu.open_session(srt, switch.Mode.SAVE, tmp_path / "archive", saver=RecordingSaver(events),
                                        model_runner=SimpleNamespace(server_args=None))  # fmt: skip
        sess.adapter.run.runners, sess.caches.folders = dict(RUNNERS), {"triton": cache}
        sess.step = "graphs"  # the runners captured in the session's graphs step
        torch = ModuleType("torch")
        torch.cuda = SimpleNamespace(synchronize=lambda: None)  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "torch", torch)
        for name, value in {"engine_facts": {}, "parallel": {}, "flags": {}, "cpu_gather": None}.items():
            monkeypatch.setattr(srt.adapter.SglangAdapter, name, lambda *a, v=value: v)
        monkeypatch.setattr(type(sess.caches), "carry", lambda c, s: events.append("caches packed") or {})

        def warm_up(mr: Any, runners: dict[str, Any], log: Any) -> Any:
            events.append("first requests")
            (cache / "ABC" / "write_req_to_token_pool_triton.cubin").parent.mkdir()
            (cache / "ABC" / "write_req_to_token_pool_triton.cubin").write_bytes(b"\x7fELF")
            return srt.warmup.Outcome(batches=["first"], graph_forwards=3, eager_forwards=1)

        monkeypatch.setattr(srt.warmup, "run", warm_up)
        monkeypatch.setenv("GRAPHPERSIST_STATS_DIR", str(tmp_path / "stats"))
        return sess, events

    return make


def test_save_writes_once_the_graph_runners_are_set_running_the_first_requests_before_the_caches_are_packed(
    srt: SimpleNamespace, saving: Callable[[], tuple[Any, list[str]]], tmp_path: Path
) -> None:
    sess, events = saving()
    mr = SimpleNamespace(server_args=None)
    srt.engine.after_graphs(mr)
    assert events == ["archive fixed", "first requests", "caches packed", "written"]
    assert sess.written and not sess.saving
    assert list(sess.timings) == ["kernel_warmup_before_save", "save"]
    stats = json.loads((tmp_path / "stats" / "rank_0.json").read_text())
    assert "kernel_choices" not in stats  # SGLang pins no Inductor choices: the proof's check must not expect them
    assert stats["kernel_warmup"] == {
        "batches": ["first"],
        "left_out": [],
        "graph_forwards": 3,
        "eager_forwards": 1,
        "new_cache_files": 1,
        "files": ["triton/ABC/write_req_to_token_pool_triton.cubin"],
    }
    assert stats["phases"]["kernel_warmup_before_save"] >= 0 and "save" in stats["phases"]
    srt.engine.after_graphs(mr)  # a second call (graphs set up again after the start) writes nothing again
    assert events.count("written") == 1


def test_the_save_phase_leaves_the_warm_up_out(
    srt: SimpleNamespace, saving: Callable[[], tuple[Any, list[str]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    sess, _ = saving()
    # save starts, the warm-up starts (save's, the kernel warm-up's), the warm-up ends (both), save ends
    ticks = iter([100.0, 101.0, 101.0, 104.0, 104.0, 110.0])
    clock = SimpleNamespace(perf_counter=lambda: next(ticks))
    monkeypatch.setattr(engine_session, "time", clock)
    srt.engine.after_graphs(SimpleNamespace(server_args=None))
    assert sess.timings == {"kernel_warmup_before_save": 3.0, "save": 7.0}


def test_load_and_persistence_off_do_nothing_after_the_graphs(srt: SimpleNamespace, tmp_path: Path) -> None:
    assert srt.engine.after_graphs(object()) is None  # off: no session, the model runner is not touched
    sess = persist_cpu.open_session(srt, switch.Mode.LOAD, tmp_path)
    assert srt.engine.after_graphs(object()) is None and sess.timings == {} and sess.stats_extra == {}


def test_a_save_whose_graph_seam_never_ran_is_refused(srt: SimpleNamespace, tmp_path: Path) -> None:
    persist_cpu.open_session(srt, switch.Mode.SAVE, tmp_path, saver=RecordingSaver([]))
    with pytest.raises(PersistError, match=r"without the persistence seam in capture_cuda_graphs.*SAVE refused"):
        srt.engine.after_graphs(SimpleNamespace(server_args=None))


# ------------------------------------------------------------------------------------ against the pinned upstream


def _calls(fn: ast.FunctionDef) -> list[str]:
    """The dotted names a function calls, in source order."""
    found = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
    return [ast.unparse(n.func) for n in sorted(found, key=lambda n: (n.lineno, n.col_offset))]


def _function(path: Path, name: str, cls: str | None = None) -> ast.FunctionDef:
    """A module-level function, or a method of class `cls`."""
    body = ast.parse(path.read_text()).body
    if cls is not None:
        [owner] = [n for n in body if isinstance(n, ast.ClassDef) and n.name == cls]
        body = owner.body
    [fn] = [n for n in body if isinstance(n, ast.FunctionDef) and n.name == name]
    return fn


def _in_order(calls: list[str], wanted: list[str]) -> bool:
    it = iter(calls)
    return all(any(w in c for c in it) for w in wanted)


@pytest.mark.network  # reads the pristine upstream tree (cached by the build)
def test_the_warm_up_drives_batches_as_sglangs_own_one_batch_benchmark_does(
    upstream_tree: Callable[[str], Path],
) -> None:
    bench = upstream_tree("sglang") / "sglang/benchmark/one_batch.py"
    assert _in_order(_calls(_function(bench, "extend")), ["ScheduleBatch.init_new", "prepare_for_extend",
                     "ForwardBatch.init_new", "model_runner.forward", "model_runner.sample"])  # fmt: skip
    assert _in_order(_calls(_function(bench, "decode")), ["prepare_for_decode", "ForwardBatch.init_new",
                     "model_runner.forward", "model_runner.sample"])  # fmt: skip
    overlay = Path(__file__).resolve().parents[2] / "overlays/sglang/sglang/srt/graphpersist_warmup.py"
    assert _in_order(_calls(_function(overlay, "serve", "_Driver")), ["extend", "decode", "free"])
    cache = _function(bench, "extend").body[0]
    assert "TreeCacheNamespace" in ast.unparse(cache), "extend hands out KV slots through a tree cache of its own"
    assert "pass" in ast.unparse(_function(bench, "evict", "TreeCacheNamespace")), "which never evicts"


@pytest.mark.network  # reads the pristine upstream tree (cached by the build)
def test_the_kernels_the_module_names_are_where_it_says_they_are(upstream_tree: Callable[[str], Path]) -> None:
    root = upstream_tree("sglang") / "sglang"
    jitted = {  # file -> its @triton.jit functions
        rel: {n.name for n in ast.walk(ast.parse((root / rel).read_text())) if isinstance(n, ast.FunctionDef)
              and any("triton.jit" in ast.unparse(d) for d in n.decorator_list)}
        for rel in ("kernels/ops/memory/common.py", "kernels/ops/attention/position.py")
    }  # fmt: skip
    assert "write_req_to_token_pool_triton" in jitted["kernels/ops/memory/common.py"]
    assert "compute_position_kernel" in jitted["kernels/ops/attention/position.py"]
    write = _calls(_function(root / "srt/mem_cache/allocation.py", "write_cache_indices"))
    assert any(c.startswith("write_req_to_token_pool_triton[") for c in write)
    assert "compute_position_triton" in _calls(_function(root / "srt/model_executor/forward_batch_info.py",
                                                         "compute_position"))  # fmt: skip
    assert "load_jit" in _calls(_function(root / "kernels/ops/attention/clamp_position.py",
                                          "_jit_clamp_position_module"))  # fmt: skip
    sampler = (root / "srt/layers/sampler.py").read_text()
    assert "top_k_top_p_sampling_from_probs" in sampler and "min_p_sampling_from_probs" in sampler
    assert "def alloc(self, need_size" in (root / "srt/mem_cache/allocator/token.py").read_text()
    assert "self.free_pages = self.free_pages[need_size:]" in (root / "srt/mem_cache/allocator/token.py").read_text()


@pytest.mark.network  # reads the pristine upstream tree (cached by the build)
def test_what_the_plan_assumes_of_sglang_holds(upstream_tree: Callable[[str], Path]) -> None:
    root = upstream_tree("sglang") / "sglang/srt"
    tree = ast.parse((root / "model_executor/runner/prefill_cuda_graph_runner.py").read_text())
    [factor] = [n.value.value for n in tree.body if isinstance(n, ast.Assign)  # type: ignore[attr-defined]
                and ast.unparse(n.targets[0]) == "_MAX_PREFILL_CUDA_GRAPH_PADDING_FACTOR"]  # fmt: skip
    assert factor == 2, "a 1-token prefill pads to 4 (the smallest prefill graph): more than twice, so eager"
    runner = (root / "model_executor/model_runner.py").read_text()
    for attribute in ("forward_stream", "forward_pass_id"):
        assert f"self.{attribute} = " in runner, f"ModelRunner no longer sets {attribute}"
    init_graphs = _function(root / "model_executor/model_runner.py", "init_cuda_graphs", "ModelRunner")
    set_last = [ast.unparse(s.targets[0]) for s in init_graphs.body if isinstance(s, ast.Assign)]
    assert {"self.eager_runner", "self.prefill_cuda_graph_runner", "self.decode_cuda_graph_runner"} <= set(set_last)
    assert "self.free_slots = self.free_slots[need_size:]" in (root / "mem_cache/memory_pool.py").read_text()
