"""The benchmark's synthetic engine: graphs shaped like vLLM's piecewise + full CUDA graphs of one worker.

Per batch size (51 of them, 1 to 384): one FULL graph of about 1000 kernel nodes (500 layers of two elementwise
kernels) and 37 PIECEWISE graphs of 10 kernel nodes (5 layers each) chained through the shared graph pool: piece
0 reads the static input buffer, piece p reads piece p-1's output, as vLLM's pieces hand activations on. All
graphs are captured into one memory pool; weights and the static input buffer are setup tensors.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import torch

SIZES = (1, 2, 4, *range(8, 8 * 49, 8))  # 51 batch sizes, vLLM-like
FULL_LAYERS, PIECES, PIECE_LAYERS = 500, 37, 5
HIDDEN, N_WEIGHTS = 256, 16


@dataclasses.dataclass
class FullOutput:
    """What a FULL graph returns: a nested output structure the archive must rebuild at LOAD."""

    hidden: torch.Tensor
    extras: dict
    step: int


# The benchmark engine's registry of output types (an archive names a dataclass only by its id here).
OUTPUT_TYPES = {"runtime_scale.full_output": FullOutput}


class Model:
    """Weights and the static input buffer, allocated in a fixed order (setup)."""

    def __init__(self) -> None:
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.w = [torch.rand(HIDDEN, generator=gen, device="cuda") * 0.5 + 0.5 for _ in range(N_WEIGHTS)]
        self.b = [torch.rand(HIDDEN, generator=gen, device="cuda") * 0.1 for _ in range(N_WEIGHTS)]
        self.x = torch.zeros(max(SIZES), HIDDEN, device="cuda")  # the static input, sliced per batch size
        torch.cuda.synchronize()

    def named_tensors(self) -> dict[str, torch.Tensor]:
        named = {f"w.{i}": w for i, w in enumerate(self.w)} | {f"b.{i}": b for i, b in enumerate(self.b)}
        return named | {"x": self.x}

    def facts(self) -> dict[str, str]:
        shapes = {"sizes": list(SIZES), "hidden": HIDDEN, "full": FULL_LAYERS, "pieces": [PIECES, PIECE_LAYERS]}
        fp = hashlib.sha256(json.dumps(shapes, sort_keys=True).encode()).hexdigest()[:32]
        return {"dtype": "float32", "config_fingerprint": fp}

    def layers(self, h: torch.Tensor, n: int, offset: int) -> torch.Tensor:
        """n layers of two kernels each: h * w + b (one kernel), then tanh."""
        for i in range(n):
            k = (offset + i) % N_WEIGHTS
            h = torch.tanh(torch.addcmul(self.b[k], h, self.w[k]))
        return h

    def full(self, b: int) -> FullOutput:
        h = self.layers(self.x[:b], FULL_LAYERS, 0)
        return FullOutput(hidden=h, extras={"residual": (h[:1], None), "batch": b}, step=FULL_LAYERS)

    def piece(self, h: torch.Tensor, p: int) -> torch.Tensor:
        return self.layers(h, PIECE_LAYERS, p * PIECE_LAYERS)


def inputs_for(b: int) -> torch.Tensor:
    """Deterministic input of batch size b (same in every process)."""
    gen = torch.Generator(device="cuda").manual_seed(1000 + b)
    return torch.rand(b, HIDDEN, generator=gen, device="cuda") * 2 - 1
