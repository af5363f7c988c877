"""The TP proof's model: column/row-parallel MLP layers with one all-reduce per layer, in three variants.

- `nccl`: torch.distributed all_reduce (NCCL kernels; comm buffers and peer mappings made by NCCL at init).
- `symm`: torch symmetric memory, two_shot_all_reduce_ (no multicast), one rendezvoused buffer per batch size.
- `ipc`: the custom all-reduce pattern: each rank copies its partial sum into a buffer it exported with
  cuIpcGetMemHandle, a one-block Triton kernel signals the peer and waits for the peer's signal (system-scope
  atomics on flags in the exported buffers), then a Triton kernel adds the peer's partial, read through the
  cuIpcOpenMemHandle mapping; a second signal keeps a rank from overwriting its buffer while the peer still reads.
  Like custom all-reduce kernels, the kernels take the peer's address as a raw integer: no torch tensor is made
  over peer memory.

Everything allocated here happens in setup, in a fixed order, identically in every process of a group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import triton
import triton.language as tl

SIZES = (1, 4, 16, 64)
LAYERS, HIDDEN, FFN = 4, 1024, 4096
FLAGS_OFFSET = 1 << 20  # flags live 1 MiB into each exchange buffer, after the data


@triton.jit
def _signal_and_wait(epoch_ptr, mine_ptr, peer_addr):
    """Barrier between two ranks: bump my epoch, publish it in the peer's flag, wait for the peer's."""
    peer_ptr = peer_addr.to(tl.pointer_type(tl.int32))
    e = tl.load(epoch_ptr) + 1
    tl.store(epoch_ptr, e)
    tl.atomic_xchg(peer_ptr, e, sem="release", scope="sys")
    seen = tl.atomic_add(mine_ptr, 0, sem="acquire", scope="sys")
    while seen < e:
        seen = tl.atomic_add(mine_ptr, 0, sem="acquire", scope="sys")


@triton.jit
def _add_peer(mine_ptr, peer_addr, out_ptr, n, BLOCK: tl.constexpr):
    """out = mine + peer, the peer's partial read over NVLink through the IPC mapping."""
    peer_ptr = peer_addr.to(tl.pointer_type(tl.bfloat16))
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(mine_ptr + offs, mask=m)
    b = tl.load(peer_ptr + offs, mask=m)
    tl.store(out_ptr + offs, a + b, mask=m)


class _Raw:
    """A device pointer viewed by torch without copying (memory owned by the driver allocation, not torch)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def raw_tensor(ptr: int, nbytes: int) -> torch.Tensor:
    return torch.as_tensor(_Raw(ptr, nbytes), device="cuda")


def _ck(result: Any, what: str) -> Any:
    err, *rest = result
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err!r}")
    return rest[0] if len(rest) == 1 else tuple(rest)


class TPModel:
    """Rank `rank` of a 2-way (or any world) tensor-parallel MLP stack; the same weights in every process."""

    def __init__(self, variant: str, rank: int, world: int, dtype: torch.dtype = torch.bfloat16) -> None:
        self.variant, self.rank, self.world, self.dtype = variant, rank, world, dtype
        gen = torch.Generator().manual_seed(1234)
        shard = FFN // world
        self.w1, self.w2 = [], []
        for _ in range(LAYERS):  # full weights from one seed, then this rank's slice: identical in every run
            w1 = torch.randn(FFN, HIDDEN, generator=gen) / HIDDEN**0.5
            w2 = torch.randn(HIDDEN, FFN, generator=gen) / FFN**0.5
            self.w1.append(w1[rank * shard : (rank + 1) * shard].to("cuda", dtype))
            self.w2.append(w2[:, rank * shard : (rank + 1) * shard].contiguous().to("cuda", dtype))
        self.x = torch.zeros(max(SIZES), HIDDEN, device="cuda", dtype=dtype)  # static input
        self.out = torch.zeros(max(SIZES), HIDDEN, device="cuda", dtype=dtype)  # static output
        getattr(self, f"_setup_{variant}")()

    # ---------------------------------------------------------------------------------- variant set-up

    def _setup_nccl(self) -> None:
        t = torch.ones(8, device="cuda")
        dist.all_reduce(t)  # every peer connected before capture (NCCL_RUNTIME_CONNECT=0 does the rest)
        torch.cuda.synchronize()

    def _setup_symm(self) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = dist.group.WORLD.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.symm = {}
        for b in SIZES:
            buf = symm_mem.empty(b, HIDDEN, dtype=self.dtype, device="cuda")
            symm_mem.rendezvous(buf, self.group_name)
            self.symm[b] = buf
        torch.cuda.synchronize()

    def _setup_ipc(self) -> None:
        from cuda.bindings import driver as drv

        if self.world != 2:
            raise ValueError("the ipc variant pairs exactly two ranks")
        nbytes = 2 << 20
        self.ipc_ptr = int(_ck(drv.cuMemAlloc(nbytes), "cuMemAlloc"))
        _ck(drv.cuMemsetD8(self.ipc_ptr, 0, nbytes), "cuMemsetD8")
        handle = _ck(drv.cuIpcGetMemHandle(self.ipc_ptr), "cuIpcGetMemHandle")
        handles: list[Any] = [None] * self.world
        dist.all_gather_object(handles, bytes(handle.reserved))
        peer_handle = drv.CUipcMemHandle()
        peer_handle.reserved = handles[1 - self.rank]
        flags = drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        self.peer_ptr = int(_ck(drv.cuIpcOpenMemHandle(peer_handle, flags), "cuIpcOpenMemHandle"))
        n = max(SIZES) * HIDDEN
        self.mine = raw_tensor(self.ipc_ptr, n * 2).view(self.dtype).view(max(SIZES), HIDDEN)
        self.my_flag = raw_tensor(self.ipc_ptr + FLAGS_OFFSET, 4).view(torch.int32)
        self.peer_flag_addr = self.peer_ptr + FLAGS_OFFSET
        self.epoch = torch.zeros(1, device="cuda", dtype=torch.int32)
        torch.cuda.synchronize()
        dist.barrier()

    # ---------------------------------------------------------------------------------- forward

    def _all_reduce(self, y: torch.Tensor, b: int) -> torch.Tensor:
        if self.variant == "nccl":
            dist.all_reduce(y)
            return y
        if self.variant == "symm":
            buf = self.symm[b]
            buf.copy_(y)
            torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", self.group_name)
            return buf
        self.mine[:b].copy_(y)
        _signal_and_wait[(1,)](self.epoch, self.my_flag, self.peer_flag_addr)
        s = torch.empty_like(y)
        n = y.numel()
        _add_peer[(triton.cdiv(n, 1024),)](self.mine, self.peer_ptr, s, n, BLOCK=1024)
        _signal_and_wait[(1,)](self.epoch, self.my_flag, self.peer_flag_addr)
        return s

    def forward(self, b: int) -> torch.Tensor:
        x = self.x[:b]
        for i in range(LAYERS):
            h = torch.nn.functional.gelu(x @ self.w1[i].t())  # column-parallel
            y = h @ self.w2[i].t()  # row-parallel: partial sums
            x = x + self._all_reduce(y, b)
        self.out[:b].copy_(x)
        return self.out[:b]

    def named_tensors(self) -> dict[str, torch.Tensor]:
        named = {f"w1.{i}": w for i, w in enumerate(self.w1)} | {f"w2.{i}": w for i, w in enumerate(self.w2)}
        named |= {"x": self.x, "out": self.out}
        if self.variant == "symm":
            named |= {f"symm.{b}": t for b, t in self.symm.items()}
        if self.variant == "ipc":
            named |= {"epoch": self.epoch}
        return named

    def facts(self) -> dict[str, str]:
        return {"dtype": str(self.dtype).removeprefix("torch."),
                "config_fingerprint": f"tp-mlp-{self.variant}-L{LAYERS}-H{HIDDEN}-F{FFN}-W{self.world}"}  # fmt: skip


def inputs_for(b: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """The same replicated input on every rank (the TP layout's contract)."""
    return torch.randn(b, HIDDEN, generator=torch.Generator().manual_seed(seed + b)).to(dtype)
