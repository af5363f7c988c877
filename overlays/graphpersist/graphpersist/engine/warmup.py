"""The first requests a SAVE runs before it packs the JIT caches (an engine's kernel warm-up), so that the kernels an
engine compiles only when it serves travel with the archive: dummy batches, kept to what the engine can serve.

Engine-neutral: the glue chooses the batches (what its kernels specialise on) and runs them through the engine's own
request path; this keeps those that fit, names each one left out and why, makes their prompts, and holds what ran.
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


def prompt(index: int, length: int, vocab_size: int) -> list[int]:
    """Fixed token ids inside the vocabulary, different per prompt (no randomness: nothing to seed)."""
    return [(1000 + 7919 * index + 131 * i) % vocab_size for i in range(length)]
