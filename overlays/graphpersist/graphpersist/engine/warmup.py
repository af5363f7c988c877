"""The first requests a SAVE runs before it packs the JIT caches (an engine's kernel warm-up), so that the kernels an
engine compiles only when it serves travel with the archive: dummy batches, kept to what the engine can serve.

Engine-neutral: the glue chooses the batches (what its kernels specialise on) and runs them through the engine's own
request path; this adds what every engine with CUDA graphs runs eagerly (a batch just above its largest graphs), keeps
the batches that fit what the start can serve, names each one left out and why, makes their prompts, and holds what
ran.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Batch:
    """One dummy batch: a prefill of these prompts (token counts), then `decode_steps` decode steps."""

    key: str
    what: str  # what it exercises, for the log
    prompt_lens: tuple[int, ...]
    sampling: dict[str, Any]
    decode_steps: int
    prefix_of: str | None = None  # the first prompt continues the first prompt of that batch (a prefix-cache hit)

    @property
    def new_tokens(self) -> int:
        """KV slots the batch takes: its prefill and one per request and decode step (an upper bound with a
        prefix, whose slots are reused)."""
        return sum(self.prompt_lens) + len(self.prompt_lens) * self.decode_steps


@dataclass(frozen=True)
class Limits:
    """What a start can serve, read from the engine once its graphs are captured."""

    max_decode_graph_bs: int | None  # the largest decode graph (None: decode graphs disabled)
    max_prefill_graph_tokens: int | None  # the largest prefill graph (None: prefill graphs disabled)
    max_extend_tokens: int | None  # the most tokens one prefill batch may hold (chunked prefill), None: no limit
    max_requests: int  # slots of the request pool
    max_tokens: int  # free KV slots
    context_len: int


@dataclass
class Outcome:
    """What the warm-up ran: its batches, those left out (why), and how many forwards replayed a graph or ran
    eagerly."""

    batches: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)
    graph_forwards: int = 0
    eager_forwards: int = 0

    def summary(self) -> tuple[dict[str, Any], str]:
        """What `PersistSession.kernel_warmup` takes from the run: its stats (every field) and a description."""
        described = (
            f"{len(self.batches)} batches ({self.graph_forwards} graph replays, {self.eager_forwards} eager forwards)"
        )
        return asdict(self), described


def fit(batches: Iterable[Batch], *, max_tokens: int, context_len: int) -> tuple[list[Batch], list[str]]:
    """The batches that fit, in order, and one line per batch left out (why): each prompt and its decode steps stay
    within the context, all batches together within the free KV slots (nothing is evicted between them), and a
    batch that continues another's prompt needs that one kept."""
    kept: list[Batch] = []
    left_out: list[str] = []
    tokens = 0
    for batch in batches:
        too_long = max(batch.prompt_lens) + batch.decode_steps >= context_len
        if batch.prefix_of is not None and all(b.key != batch.prefix_of for b in kept):
            left_out.append(f"{batch.what}: its prefix batch was left out")
        elif too_long or tokens + batch.new_tokens > max_tokens:
            left_out.append(f"{batch.what}: it does not fit ({batch.new_tokens} KV slots, {max_tokens - tokens} "
                            f"free; context length {context_len})")  # fmt: skip
        else:
            kept.append(batch)
            tokens += batch.new_tokens
    return kept, left_out


def plan(
    batches: list[Batch], limits: Limits, *, sampling: dict[str, Any], engine: str
) -> tuple[list[Batch], list[str]]:
    """The batches a warm-up runs, in order, and one line per batch left out (why): the `engine`'s own `batches`, then
    the ones it runs eagerly, just above its largest graphs (one request more than the largest decode graph, one token
    more than the largest prefill graph, with `sampling`) where it can run them at all, all kept to what fits."""
    batches, left_out = list(batches), []
    if limits.max_decode_graph_bs is not None:
        n = limits.max_decode_graph_bs + 1
        if n <= limits.max_requests:
            batches.append(Batch("eager_decode", f"{n} requests: eager decode above the largest decode graph",
                                 (2,) * n, sampling, 1))  # fmt: skip
        else:
            left_out.append(f"an eager decode of {n} requests: the request pool holds {limits.max_requests}, so "
                            f"{engine} never runs one")  # fmt: skip
    graph_tokens, cap = limits.max_prefill_graph_tokens, limits.max_extend_tokens
    if graph_tokens is not None:
        n = graph_tokens + 1
        if cap is None or cap >= n:
            longest = max(1, limits.context_len - 2)  # a prompt and its decode step within the context
            lens = (longest,) * (n // longest) + ((n % longest,) if n % longest else ())
            batches.append(Batch("eager_prefill", f"a {n}-token prefill: eager above the largest prefill graph",
                                 lens, sampling, 1))  # fmt: skip
        else:
            left_out.append(f"an eager prefill of {n} tokens: a prefill batch holds at most {cap} tokens here, so "
                            f"{engine} never runs one")  # fmt: skip
    kept, too_big = fit(batches, max_tokens=limits.max_tokens, context_len=limits.context_len)
    return kept, left_out + too_big


def prompt(index: int, length: int, vocab_size: int) -> list[int]:
    """Fixed token ids inside the vocabulary, different per prompt (no randomness: nothing to seed)."""
    return [(1000 + 7919 * index + 131 * i) % vocab_size for i in range(length)]
