"""The first requests a SAVE runs (graphpersist.engine.warmup), the engine-neutral part: the eager batches just above
the largest graphs, which batches fit what the engine can serve, and the prompts they send. The SGLang glue's choice of
batches is tested with it (test_engine_sglang_warmup_cpu.py)."""

from __future__ import annotations

from typing import Any

from graphpersist import engine
from graphpersist.engine.warmup import Batch, Limits


def batch(key: str, lens: tuple[int, ...], steps: int = 1, prefix_of: str | None = None) -> Batch:
    return Batch(key, f"batch {key}", lens, {}, steps, prefix_of)


def test_a_batch_takes_its_prompts_and_a_slot_per_request_and_decode_step() -> None:
    assert batch("a", (7, 3), steps=2).new_tokens == 7 + 3 + 2 * 2


def test_batches_are_kept_in_order_while_the_free_kv_slots_last_and_the_rest_are_named() -> None:
    kept, left_out = engine.warmup.fit([batch("a", (5,)), batch("b", (10,)), batch("c", (2,))], max_tokens=12,
                                       context_len=100)  # fmt: skip
    assert [b.key for b in kept] == ["a", "c"]
    assert left_out == ["batch b: it does not fit (11 KV slots, 6 free; context length 100)"]


def test_a_prompt_and_its_decode_steps_must_stay_within_the_context() -> None:
    kept, left_out = engine.warmup.fit([batch("long", (8,), steps=2), batch("ok", (7,), steps=2)], max_tokens=1000,
                                       context_len=10)  # fmt: skip
    assert [b.key for b in kept] == ["ok"] and left_out[0].startswith("batch long: it does not fit")


def test_a_batch_continuing_a_prompt_left_out_is_left_out_too() -> None:
    batches = [batch("first", (50,)), batch("prefix", (52,), prefix_of="first"), batch("other", (3,))]
    kept, left_out = engine.warmup.fit(batches, max_tokens=10, context_len=100)
    assert [b.key for b in kept] == ["other"]
    assert left_out[1] == "batch prefix: its prefix batch was left out"
    kept, _ = engine.warmup.fit(batches, max_tokens=1000, context_len=100)
    assert [b.key for b in kept] == ["first", "prefix", "other"]


def test_prompts_are_fixed_inside_the_vocabulary_and_differ_per_request() -> None:
    first = engine.warmup.prompt(1, 20, 1000)
    assert first == engine.warmup.prompt(1, 20, 1000) and len(first) == 20 and all(0 <= t < 1000 for t in first)
    assert first != engine.warmup.prompt(2, 20, 1000)


def test_an_outcome_sums_up_as_its_stats_and_one_line() -> None:
    """What PersistSession.kernel_warmup records (rank stats) and logs of an engine's first requests."""
    done = engine.warmup.Outcome(batches=["a", "b"], left_out=["c: why"], graph_forwards=5, eager_forwards=2)
    assert done.summary() == (
        {"batches": ["a", "b"], "left_out": ["c: why"], "graph_forwards": 5, "eager_forwards": 2},
        "2 batches (5 graph replays, 2 eager forwards)",
    )


def limits(**changes: Any) -> Limits:
    start = {"max_decode_graph_bs": 8, "max_prefill_graph_tokens": 32, "max_extend_tokens": 64, "max_requests": 16,
             "max_tokens": 10_000, "context_len": 100}  # fmt: skip
    return Limits(**{**start, **changes})


def test_the_engines_batches_come_first_then_one_just_above_each_largest_graph_with_its_sampling() -> None:
    greedy = {"temperature": 0.0}
    kept, left_out = engine.warmup.plan([batch("a", (5,))], limits(), sampling=greedy, engine="Tiny")
    assert [(b.key, b.prompt_lens, b.sampling, b.decode_steps) for b in kept] == [
        ("a", (5,), {}, 1),
        ("eager_decode", (2,) * 9, greedy, 1),  # one request more than the largest decode graph
        ("eager_prefill", (33,), greedy, 1),  # one token more than the largest prefill graph
    ]
    assert left_out == []


def test_a_long_eager_prefill_is_split_into_prompts_that_fit_the_context() -> None:
    kept, _ = engine.warmup.plan([], limits(max_prefill_graph_tokens=250, max_extend_tokens=None), sampling={},
                                 engine="Tiny")  # fmt: skip
    assert kept[-1].prompt_lens == (98, 98, 55)  # 251 tokens; each prompt and its decode step within 100


def test_an_eager_batch_the_engine_never_runs_is_left_out_naming_why_and_no_graphs_need_none() -> None:
    kept, left_out = engine.warmup.plan([], limits(max_requests=8, max_extend_tokens=32), sampling={}, engine="Tiny")
    assert kept == [] and left_out == [
        "an eager decode of 9 requests: the request pool holds 8, so Tiny never runs one",
        "an eager prefill of 33 tokens: a prefill batch holds at most 32 tokens here, so Tiny never runs one",
    ]
    none = limits(max_decode_graph_bs=None, max_prefill_graph_tokens=None)
    assert engine.warmup.plan([], none, sampling={}, engine="Tiny") == ([], [])


def test_every_batch_is_kept_to_the_free_kv_slots() -> None:
    kept, left_out = engine.warmup.plan([batch("a", (5,))], limits(max_tokens=10), sampling={}, engine="Tiny")
    assert [b.key for b in kept] == ["a"] and left_out[0].startswith("9 requests: eager decode above the largest")
