"""Putting back what an engine's own code changed on its Python objects while the glue ran it for the session.

SAVE runs an engine's first requests before it packs the JIT caches (SGLang's kernel warm-up), so the kernels they
compile travel with the archive; LOAD never runs them. What those requests change on the engine's bookkeeping (its
pools' free lists and counters) and the random generators must then be as before, or SAVE would serve from another
state than a LOAD or a start without persistence. Engine-neutral: the glue names the objects, this names nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Snapshot:
    """The attributes of some objects, put back afterwards as they were: lists copied, CPU tensors cloned and copied
    back in place (others may hold them), anything else by reference (device tensors too: the pools replace, never
    mutate, their free lists); attributes added since are deleted."""

    objects: list[tuple[Any, dict[str, Any], dict[str, Any]]] = field(default_factory=list)

    @classmethod
    def of(cls, *objs: Any) -> Snapshot:
        snap = cls()
        for obj in objs:
            attrs, cpu = {}, {}
            for name, value in vars(obj).items():
                if isinstance(value, list):
                    attrs[name] = list(value)
                elif _is_cpu_tensor(value):
                    attrs[name], cpu[name] = value, value.clone()
                else:
                    attrs[name] = value
            snap.objects.append((obj, attrs, cpu))
        return snap

    def restore(self) -> None:
        for obj, attrs, cpu in self.objects:
            for name in [n for n in vars(obj) if n not in attrs]:
                delattr(obj, name)
            for name, value in attrs.items():
                setattr(obj, name, value)
            for name, saved in cpu.items():
                attrs[name].copy_(saved)


def _is_cpu_tensor(value: Any) -> bool:
    device = getattr(value, "device", None)
    return getattr(device, "type", None) == "cpu" and hasattr(value, "clone") and hasattr(value, "copy_")


@contextmanager
def put_back(*objects: Any) -> Iterator[None]:
    """The objects' attributes (`Snapshot`) and torch's CPU and CUDA random generators as they were before the block,
    once the GPU finished its work, also when the block raises."""
    import torch

    snap = Snapshot.of(*objects)
    cpu_rng, gpu_rng = torch.get_rng_state(), torch.cuda.get_rng_state()
    try:
        yield
    finally:
        torch.cuda.synchronize()
        snap.restore()
        torch.set_rng_state(cpu_rng)
        torch.cuda.set_rng_state(gpu_rng)
