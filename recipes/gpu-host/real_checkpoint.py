"""Writes a real safetensors checkpoint for the TP=1 recipes' `*_real` runs: Qwen3-8B's layout, random weights.

The recipes' other runs load dummy weights (`load_format="dummy"`), which skips the engines' own checkpoint loaders.
Users load real checkpoints, so the dense TP=1 recipes (`vllm-qwen3-8b-tp1`, `sglang-qwen3-8b-tp1`) also start from
one (issue 32, "Real weights too"; issue 43.3): their `*_real` runs pass `--model {real_model}`, which the proof
runner takes from GP_REAL_MODEL (gptools/prove.py). The GPU host has no network, so the checkpoint is made there:
transformers builds `Qwen3ForCausalLM` from the recipes' own Qwen3-8B config (randomly initialised, on the GPU so it
takes seconds, in bfloat16) and writes it with `save_pretrained` (safetensors shards, the index file); then the serve
recipes' model folder writer adds the synthetic tokenizer and puts the recipes' `config.json` back (so the folder's
config is the dummy runs' own). Tokens are random-weight tokens: the runs compare LOAD with a baseline on the same
checkpoint (their own output group, `outputs = "real"`), never with the dummy-weight runs or a real model's text.

    python recipes/gpu-host/real_checkpoint.py /root/qwen3-8b-random    # about 16 GiB; 1-3 min on the H200

Run it with the engine bundle's Python (transformers is in both bundles: 5.17.0 for vLLM, 5.12.1 for SGLang);
`engine-proof.sh` does, before a proof with `*_real` runs, and sets GP_REAL_MODEL to the folder. It does nothing when
the folder already holds a complete checkpoint written by this script (`.gp-complete`, written last; the runner
refuses a folder without it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "vllm-qwen3-8b-tp2-serve"))

import model_folder  # noqa: E402  (Qwen3-8B config.json and the synthetic tokenizer, as the serve recipes use them)

COMPLETE = ".gp-complete"
SEED = 0


def write_checkpoint(folder: Path) -> Path:
    """The checkpoint in `folder` (written once); returns the folder."""
    if (folder / COMPLETE).is_file():
        print(f"real_checkpoint: {folder} is complete already (remove {COMPLETE} to write it again)")
        return folder
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    started = time.perf_counter()
    model_folder.write_model(folder)  # config.json and the tokenizer first: transformers reads the config from here
    config = AutoConfig.from_pretrained(folder)
    print(f"real_checkpoint: building {config.architectures[0]} with random weights (seed {SEED}) on the GPU")
    torch.manual_seed(SEED)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    print(f"real_checkpoint: writing {params / 1e9:.2f} B parameters as safetensors to {folder}")
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="5GB")
    del model
    model_folder.write_model(folder)  # the recipes' config.json again (save_pretrained rewrote it)
    (folder / "generation_config.json").unlink(missing_ok=True)  # as the dummy runs' folder: none (model_folder.py)
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    size = sum((folder / name).stat().st_size for name in shards)
    (folder / COMPLETE).write_text(json.dumps({"seed": SEED, "parameters": params, "shards": shards}) + "\n")
    print(f"real_checkpoint: {len(shards)} shard(s), {size / 2**30:.1f} GiB in {time.perf_counter() - started:.0f} s")
    return folder


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="where to write the checkpoint (e.g. /root/qwen3-8b-random)")
    write_checkpoint(ap.parse_args(argv).folder.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
