"""SAVE's first requests: dummy batches through SGLang's own request path, so the archive's JIT caches hold what a fresh
host's first requests would otherwise compile (patches/sglang/README.md, "The first requests a SAVE runs")."""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Any

from graphpersist import engine

Batch, Limits, Outcome = engine.warmup.Batch, engine.warmup.Limits, engine.warmup.Outcome  # the runtime's

GREEDY: dict[str, Any] = {"temperature": 0.0}
TOP_K_TOP_P: dict[str, Any] = {"temperature": 0.7, "top_p": 0.9, "top_k": 20}
# The repetition penalty is torch.compile'd; the frequency and presence penalties are plain torch (nothing to compile).
MIN_P_PENALTIES: dict[str, Any] = {"temperature": 0.8, "min_p": 0.05, "repetition_penalty": 1.1}
PLAIN_SAMPLING: dict[str, Any] = {}  # SGLang's defaults: temperature 1, whole vocabulary (torch.multinomial)

# SGLang 0.5.17 replays a prefill graph only when padding at most doubles the tokens
# (prefill_cuda_graph_runner._MAX_PREFILL_CUDA_GRAPH_PADDING_FACTOR), so a 1-token prefill runs eagerly.
ONE_TOKEN = 1


def plan(limits: Limits) -> tuple[list[Batch], list[str]]:
    """The batches SAVE runs, in order, and one line per batch left out (why): SGLang's, then the runtime's eager ones
    above the largest graphs (engine.warmup.plan). Pure: the CPU tests pin it down.

    Starting from an untouched KV allocator, the first prefill's slots begin at its free list's start (aligned) and
    the second's after 9 slots (7 prompt + 2 decode): both alignments of `out_cache_loc`. Token and request counts
    cover what Triton specialises integers on (1, multiples of 16, others)."""
    batches = [
        Batch("first", "the first request: 7 tokens, greedy (prefill graph, decode graph at 1)", (7,), GREEDY, 2),
        Batch("misaligned", "3 requests after 9 KV slots, top-k/top-p sampling", (5, 16, 30), TOP_K_TOP_P, 2),
        Batch("min_p", "2 requests, min-p sampling with penalties", (9, 2), MIN_P_PENALTIES, 2),
        Batch("prefix", "a radix-cache hit: the first prompt and 6 tokens more", (13,), GREEDY, 1, prefix_of="first"),
        Batch("one_token", "a 1-token prefill (eager: no prefill graph pads it)", (ONE_TOKEN,), GREEDY, 1),
        Batch("sixteen", "16 requests of 16 tokens, SGLang's default sampling", (16,) * 16, PLAIN_SAMPLING, 1),
    ]
    return engine.warmup.plan(batches, limits, sampling=GREEDY, engine="SGLang")


def limits_of(model_runner: Any, runners: dict[str, Any]) -> Limits:
    """The limits of this start: its graph runners, how many tokens one prefill batch takes (the chunked-prefill size
    and --max-prefill-tokens), the pools."""
    decode, prefill = runners.get("decode"), runners.get("prefill")
    sa = model_runner.server_args
    caps = [v for v in (sa.chunked_prefill_size, sa.max_prefill_tokens) if isinstance(v, int) and v > 0]
    return Limits(
        max_decode_graph_bs=max(decode.capture_bs) if decode is not None else None,
        max_prefill_graph_tokens=max(prefill.capture_num_tokens) if prefill is not None else None,
        max_extend_tokens=min(caps) if caps else None,
        max_requests=int(model_runner.req_to_token_pool.size),
        max_tokens=int(model_runner.token_to_kv_pool_allocator.available_size()),
        context_len=int(model_runner.model_config.context_len),
    )


def run(model_runner: Any, runners: dict[str, Any], log: Callable[..., None]) -> Outcome:
    """SAVE, every rank, collectively (the forwards all-reduce): runs `plan`'s batches through SGLang's request path
    and puts back what they changed. Raises what SGLang raises (the SAVE is then refused on every rank)."""
    import torch
    from sglang.srt.utils.common import DynamicGradMode

    batches, left_out = plan(limits_of(model_runner, runners))
    outcome = Outcome(left_out=left_out)
    forward_pass_id = model_runner.forward_pass_id  # the forward counter, put back with the pools' bookkeeping
    model_runner.forward = _counted(model_runner.forward, outcome)  # this instance, for the warm-up only
    try:
        with engine.put_back(model_runner.req_to_token_pool, model_runner.token_to_kv_pool_allocator), \
                DynamicGradMode(), torch.cuda.stream(model_runner.forward_stream):  # fmt: skip
            driver = _Driver(model_runner)
            for batch in batches:
                driver.serve(batch)
                outcome.batches.append(batch.key)
    finally:
        del model_runner.forward
        model_runner.forward_pass_id = forward_pass_id
    for line in left_out:
        log("kernel warm-up left out %s", line)
    return outcome


def _counted(forward: Callable[..., Any], outcome: Outcome) -> Callable[..., Any]:
    """`ModelRunner.forward`, counting whether SGLang replayed a graph or ran eagerly (its `can_run_graph`)."""

    def counted(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        outcome.graph_forwards += bool(out.can_run_graph)
        outcome.eager_forwards += not out.can_run_graph
        return out

    return counted


class _Driver:
    """Serves the dummy batches one after the other through SGLang's one-batch benchmark (`extend`, `decode`: no
    scheduler loop, a tree cache that hands out KV slots and never evicts, `plan` keeping within the free slots)."""

    def __init__(self, model_runner: Any) -> None:
        self.mr = model_runner
        self.first_prompts: dict[str, tuple[list[int], Any]] = {}  # batch key -> its first prompt and KV slots
        self.count = 0

    def serve(self, batch: Batch) -> None:
        """Prefill, then decode steps; the requests' pool slots go back after (their KV slots stay taken until the
        snapshot puts the allocator back, so a later batch can reuse a prompt's KV as a prefix). Each sampled token
        goes to its request, as the scheduler appends it."""
        from sglang.benchmark.one_batch import decode, extend

        made = [self._request(batch, i, n) for i, n in enumerate(batch.prompt_lens)]  # (request, its token ids)
        reqs = [req for req, _ in made]
        next_ids, _, sb = extend(reqs, self.mr)
        _append(reqs, next_ids)
        first, first_ids = made[0]
        slots = self.mr.req_to_token_pool.req_to_token[first.req_pool_idx, : len(first_ids)]
        self.first_prompts[batch.key] = (first_ids, slots.to(first.prefix_indices.dtype, copy=True))
        for _ in range(batch.decode_steps):
            next_ids, _ = decode(next_ids, sb, self.mr)
            _append(reqs, next_ids)
        for req in reqs:
            self.mr.req_to_token_pool.free(req)

    def _request(self, batch: Batch, index: int, length: int) -> tuple[Any, list[int]]:
        """A request of the batch and its token ids; the first request of a batch with `prefix_of` continues that
        batch's first prompt, whose KV slots it takes as its prefix."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        vocab = int(self.mr.model_config.vocab_size)
        self.count += 1
        prefix = None
        if index == 0 and batch.prefix_of is not None:
            tokens, prefix = self.first_prompts[batch.prefix_of]
            ids = tokens + engine.warmup.prompt(self.count, length - len(tokens), vocab)
        else:
            ids = engine.warmup.prompt(self.count, length, vocab)
        # Neither normalised (as in SGLang's one-batch benchmark) nor given max_new_tokens (the default, not 0, keeps
        # it generating): stop strings and the token limit are read only by the finish check, never run here.
        params = SamplingParams(**batch.sampling)
        req = Req(rid=f"graphpersist-warmup-{self.count}", origin_input_text="", origin_input_ids=array("q", ids),
                  sampling_params=params)  # fmt: skip
        req.full_untruncated_fill_ids = array("q", ids)
        req.logprob_start_len = -1
        if prefix is not None:
            req.prefix_indices = prefix
        req.set_extend_range(len(req.prefix_indices), len(ids))
        return req, ids


def _append(reqs: list[Any], next_ids: Any) -> None:
    for req, token in zip(reqs, next_ids.tolist(), strict=True):
        req.output_ids.append(int(token))
