"""What SGLang's glue may find again at LOAD by name: a short, explicit registry, by id.

An archive is data, never code. SAVE stores a break function or an output dataclass as an id of this registry;
LOAD looks that id up here and nowhere else, so no string from an archive ever reaches an import, a getattr on a
module or a torch.ops walk. Each entry is a function written out in this file that returns the live engine's
object (the imports and attribute names are this code's, not the archive's). SAVE refuses a break or a dataclass
that no entry returns (naming it and what to do); LOAD refuses an id this registry lacks, or whose object this
process cannot produce, naming the id.

To persist a new break or output type, add an entry here (an id of lowercase dotted words: graph.structure.ID),
declare the upstream name in patches/sglang/hooks.toml, and SAVE again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from graphpersist import engine


def _attention() -> Any:
    # What `breakable_unified_attention_with_output` wraps (eager_on_graph): the custom op, i.e.
    # torch.ops.sglang.unified_attention_with_output as register_custom_op returns it.
    from sglang.srt.layers.radix_attention import unified_attention_with_output

    return unified_attention_with_output


def _deepep_a2a() -> Any:
    # DeepEPMoE.a2a_forward_with_output breaks at this method; its first argument, the layer, goes by its name.
    from sglang.srt.layers.moe.ep_moe.layer import DeepEPMoE

    return DeepEPMoE._a2a_forward_with_output_impl


def _logits_output() -> Any:
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    return LogitsProcessorOutput


# id -> the function that returns the live object. Breakable graphs break at these (prefill: attention; decode with
# DeepEP in normal mode: each MoE layer's dispatch, experts and combine).
BREAKS: dict[str, Callable[[], Any]] = {
    "sglang.attention": _attention,
    "sglang.deepep_moe_a2a": _deepep_a2a,
}
# id -> the function that returns the dataclass: what the decode graphs return (the forward's LogitsProcessorOutput).
OUTPUT_TYPES: dict[str, Callable[[], Any]] = {
    "sglang.logits_processor_output": _logits_output,
}


breaks = engine.breakable.Registry(BREAKS)  # the break functions LOAD may call again, by id
output_types = engine.breakable.Registry(OUTPUT_TYPES)  # the dataclasses SGLang's graphs and breaks may return, by id
