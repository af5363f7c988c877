"""The first requests a SAVE runs (graphpersist.engine.warmup), the engine-neutral part: which batches fit what the
engine can serve, and the prompts they send. The SGLang glue's choice of batches is tested with it
(test_engine_sglang_warmup_cpu.py)."""

from __future__ import annotations

from graphpersist import engine
from graphpersist.engine.warmup import Batch


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
