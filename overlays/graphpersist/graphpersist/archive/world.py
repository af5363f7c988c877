"""Who this process is in a multi-GPU job: its rank, the world size, its local rank and CUDA device, and which
physical GPU that device is.

A rank's saved graphs are only valid for that rank on that GPU, so SAVE records the GPU's identity per rank
(rank.json `device`) and LOAD compares it. These helpers read the launcher's environment (torchrun and most
launchers set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) or an initialised torch.distributed, and refuse
inconsistent answers instead of guessing a rank or a device. Like the rest of the package, importing this module
needs neither torch nor CUDA; torch is consulted only when the process has already imported it.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from graphpersist.archive import liveenv


class WorldError(ValueError):
    """The rank/world/device settings contradict each other, or a fact SAVE must record cannot be learned."""


@dataclass(frozen=True)
class RankInfo:
    """This process's place in the job. `source` says where the answer came from (for messages)."""

    rank: int
    world_size: int
    local_rank: int
    device: int
    source: str


def rank_from_env(environ: Mapping[str, str] | None = None, *, visible_devices: int | None = None) -> RankInfo:
    """Rank, world size, local rank and device from RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE.

    None of them set means a single process (rank 0 of 1, device 0). The device is the local rank (the
    convention of torchrun, vLLM and SGLang). `visible_devices` is how many CUDA devices the process sees
    (default: `visible_device_count`); a local rank at or past it is an error, as is RANK without WORLD_SIZE
    (or the reverse), a rank outside the world, or a local rank larger than the rank.
    """
    env = os.environ if environ is None else environ
    rank = _int_var(env, "RANK")
    world_size = _int_var(env, "WORLD_SIZE")
    local_rank = _int_var(env, "LOCAL_RANK")
    local_world = _int_var(env, "LOCAL_WORLD_SIZE")
    if (rank is None) != (world_size is None):
        have, lack = ("RANK", "WORLD_SIZE") if rank is not None else ("WORLD_SIZE", "RANK")
        raise WorldError(f"{have} is set ({env[have]!r}) but {lack} is not: set both or neither")
    if rank is None or world_size is None:
        if local_rank not in (None, 0):
            raise WorldError(f"LOCAL_RANK is {local_rank} but RANK and WORLD_SIZE are not set")
        rank, world_size, source = 0, 1, "single process"
    else:
        source = "RANK/WORLD_SIZE"
    if world_size < 1:
        raise WorldError(f"WORLD_SIZE must be at least 1, got {world_size}")
    if rank >= world_size:
        raise WorldError(f"RANK {rank} is outside WORLD_SIZE {world_size} (ranks are 0..{world_size - 1})")
    if local_rank is None:
        if world_size > 1:
            raise WorldError(f"LOCAL_RANK is not set: cannot tell which GPU rank {rank} of {world_size} uses")
        local_rank = 0
    if local_rank > rank:
        raise WorldError(f"LOCAL_RANK {local_rank} is larger than RANK {rank}")
    if local_world is not None:
        if not 1 <= local_world <= world_size:
            raise WorldError(f"LOCAL_WORLD_SIZE {local_world} must be between 1 and WORLD_SIZE {world_size}")
        if local_rank >= local_world:
            raise WorldError(f"LOCAL_RANK {local_rank} is outside LOCAL_WORLD_SIZE {local_world}")
    _check_device(local_rank, env, visible_devices)
    return RankInfo(rank, world_size, local_rank, local_rank, source)


def current_rank(environ: Mapping[str, str] | None = None, *, visible_devices: int | None = None) -> RankInfo:
    """This process's RankInfo: torch.distributed's rank and world size when it is initialised, else the
    environment's. Both present and different is an error (two launchers disagree about who this is).

    The device is torch's current CUDA device when torch has initialised CUDA, else the local rank; without
    LOCAL_RANK the local rank is taken to be that device (the launchers' convention, device = local rank).
    """
    env = os.environ if environ is None else environ
    dist = _initialised_dist()
    if dist is None:
        return rank_from_env(env, visible_devices=visible_devices)
    rank, world_size = int(dist.get_rank()), int(dist.get_world_size())
    env_rank, env_world = _int_var(env, "RANK"), _int_var(env, "WORLD_SIZE")
    if (env_rank, env_world) != (None, None) and (env_rank, env_world) != (rank, world_size):
        raise WorldError(
            f"torch.distributed says rank {rank} of {world_size}, the environment says RANK={env.get('RANK')} "
            f"WORLD_SIZE={env.get('WORLD_SIZE')}"
        )
    local_rank = _int_var(env, "LOCAL_RANK")
    device = liveenv._torch_current_device()
    if local_rank is None:
        if device is None and world_size > 1:
            raise WorldError(f"LOCAL_RANK is not set and CUDA is not initialised: cannot tell rank {rank}'s GPU")
        local_rank = 0 if device is None else device
    if device is None:
        device = local_rank
    _check_device(device, env, visible_devices)
    return RankInfo(rank, world_size, local_rank, device, "torch.distributed")


def parallel_facts(info: RankInfo, *, tp_size: int, pp_size: int = 1, ep_size: int = 1) -> dict[str, int]:
    """The manifest's `parallel` facts for this rank, refusing a layout that does not fill the world.

    tp_size x pp_size must equal the world size (data parallelism runs separate engines, each with its own
    archive); ep_size (expert parallelism spans the tensor-parallel ranks) must divide it.
    """
    problems = layout_problems(info.world_size, tp_size, pp_size, ep_size)
    if problems:
        raise WorldError("; ".join(problems))
    return {
        "world_size": info.world_size,
        "tp_size": tp_size,
        "pp_size": pp_size,
        "ep_size": ep_size,
        "rank": info.rank,
    }


def layout_problems(world_size: Any, tp_size: Any, pp_size: Any, ep_size: Any) -> list[str]:
    """Why (world_size, tp_size, pp_size, ep_size) is not a layout one archive can hold; [] when it is.

    Every size is a positive integer, tp_size x pp_size is the world size (data parallelism runs separate
    engines, each with its own archive) and ep_size divides it. Any world size: nothing assumes two ranks.
    """
    sizes = {"world_size": world_size, "tp_size": tp_size, "pp_size": pp_size, "ep_size": ep_size}
    bad = [
        f"{name} must be a positive integer, got {value!r}"
        for name, value in sizes.items()
        if isinstance(value, bool) or not isinstance(value, int) or value < 1
    ]
    if bad:
        return bad
    problems = []
    if tp_size * pp_size != world_size:
        problems.append(f"tp_size {tp_size} x pp_size {pp_size} = {tp_size * pp_size}, world size {world_size}")
    if world_size % ep_size:
        problems.append(f"ep_size {ep_size} does not divide world size {world_size}")
    return problems


def rank_device_facts(device: int) -> dict[str, Any]:
    """rank.json's `device` for CUDA device `device` of this process: {"index", "uuid", "pci_bus_id"}.

    Call it in the rank's own process after torch has initialised CUDA (there the answer is exact). Raises
    WorldError when the UUID or PCI bus id cannot be learned: SAVE must not record a GPU it cannot name.
    """
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise WorldError(f"device must be a non-negative CUDA device index, got {device!r}")
    facts = liveenv.device_facts(device)
    lacking = [name for name in ("uuid", "pci_bus_id") if name not in facts]
    if lacking:
        raise WorldError(
            f"cannot learn the {' and '.join(lacking)} of CUDA device {device}: initialise CUDA in this process "
            "first (torch), or make nvidia-smi's numbering unambiguous (CUDA_VISIBLE_DEVICES with GPU UUIDs, or "
            "CUDA_DEVICE_ORDER=PCI_BUS_ID)"
        )
    return facts


def visible_device_count(environ: Mapping[str, str] | None = None) -> int | None:
    """How many CUDA devices this process sees, None when that cannot be told without initialising CUDA.

    torch answers once it initialised CUDA; else CUDA_VISIBLE_DEVICES is counted the way CUDA reads it (up to
    the first invalid entry) and capped by the GPUs nvidia-smi lists; else nvidia-smi's count.
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        with contextlib.suppress(Exception):
            if torch.cuda.is_initialized():
                return int(torch.cuda.device_count())
    env = os.environ if environ is None else environ
    gpus = liveenv._smi_gpus()
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return len(gpus) or None
    count = 0
    for item in visible.split(","):
        item = item.strip()
        if not item or item.startswith("-"):
            break
        count += 1
    return min(count, len(gpus)) if gpus else count


def _check_device(device: int, env: Mapping[str, str], visible_devices: int | None) -> None:
    count = visible_device_count(env) if visible_devices is None else visible_devices
    if count is not None and device >= count:
        visible = env.get("CUDA_VISIBLE_DEVICES")
        shown = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        raise WorldError(f"device {device} does not exist: this process sees {count} CUDA device(s){shown}")


def _int_var(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name)
    if text is None:
        return None
    try:
        value = int(text.strip())
    except ValueError:
        raise WorldError(f"{name} must be an integer, got {text!r}") from None
    if value < 0:
        raise WorldError(f"{name} must not be negative, got {value}")
    return value


def _initialised_dist() -> Any:
    """torch.distributed when the process imported it and initialised a process group, else None."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    with contextlib.suppress(Exception):
        if dist.is_available() and dist.is_initialized():
            return dist
    return None
