"""GPU test of phase-anchored layout, post-capture IPC registration and declared state (graphpersist.memory.layout).

Each step runs in its own process (or pair of processes) under the interposer:
- `single` (one GPU): setup in phases "weights" (exact), "profile" (variable: N scratch buffers of 12 MiB, freed),
  "autotune" (SAVE only, skip_on_load: a workspace the graph writes and reads) and "kv" (exact). SAVE captures
  a graph reading all of them plus a "bytes" state (filled by warm-up, which LOAD does not run) and a
  "recreated" state written by a post-capture phase from the address it allocated. LOAD runs fewer profile
  allocations and no autotune phase: kv stays at its anchor, the workspace is mapped from the archive, the
  state is written back / verified, and the graph's output is bit-identical. More profile allocations than the
  headroom refuse ("overran"); a post-capture phase that writes other state content refuses at the first replay.
- `ipc` (two GPUs, two processes): the custom all-reduce pattern. After capture, a post-capture phase exports
  each rank's buffer, exchanges handles (gloo) and opens the peer's (cuIpcOpenMemHandle), and writes the peer's
  address into `rank_data`, which the captured Triton kernel dereferences. LOAD re-runs that phase: each open
  lands at its saved address, `rank_data` ("recreated") hashes as at SAVE, and the replay reads the peer's
  data. A rank that allocates before its IPC open in that phase refuses, naming the event.

Run: `python3 -m pytest -m gpu tests/gpu/test_phases_gpu.py` on a GPU host (torch, triton, cuda-bindings, gcc).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
OVERLAY = REPO / "overlays" / "graphpersist"
ENGINE = {"name": "graphpersist-phases-test", "version": "1", "commit": "none"}
MODEL = {"dtype": "float32", "config_fingerprint": "phases-v1"}
PINNED_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# Tensors of 10 MiB and more get a segment of their own from torch's caching allocator (smaller ones share 20 MiB
# segments, so a later phase's tensor could land in an earlier phase's segment): 12 MiB each.
N = 3 << 20  # floats
SCRATCH = 12 << 20
PROFILE_HEADROOM = 24 << 20  # two more scratch buffers than SAVE made fit; three do not


def _ck(result: Any, what: str) -> Any:
    from graphpersist.graph.images import check

    return check(result, what)


def _digest(t: Any) -> str:
    return hashlib.sha256(t.detach().cpu().numpy().tobytes()).hexdigest()


# ------------------------------------------------------------------------------------------- one GPU


def step_single(mode: str, archive: Path, n_profile: int, bad_state: bool) -> dict[str, Any]:
    import torch
    from cuda.bindings import driver as drv

    from graphpersist import api

    api.start_region()
    if mode == "load":
        api.use_layout(archive)
    out: dict[str, Any] = {}
    try:
        with api.phase("weights"):
            w = torch.randn(N, generator=torch.Generator().manual_seed(3)).to("cuda")
        with api.phase("profile", exact=False, headroom=PROFILE_HEADROOM):
            scratch = [torch.empty(SCRATCH, dtype=torch.uint8, device="cuda") for _ in range(n_profile)]
            del scratch
            torch.cuda.empty_cache()
        ws = None
        if mode == "save":
            with api.phase("autotune", exact=False, skip_on_load=True):
                ws = torch.empty(N, device="cuda")
        with api.phase("kv"):
            kv = torch.linspace(0, 1, N, device="cuda")
            table = torch.zeros(16, device="cuda")
            post = torch.zeros(16, device="cuda")
        api.mark_setup({"w": w, "kv": kv, "table": table, "post": post})
    except api.PersistError as exc:
        return {"refused": str(exc), "where": "setup"}
    out["kv"] = kv.data_ptr()

    def post_capture() -> None:
        with api.phase("post_capture"):
            extra = int(_ck(drv.cuMemAlloc(2 << 20), "cuMemAlloc"))
            post.fill_(-1.0 if bad_state else float(extra % 4093))  # a function of where the phase allocated
        api.declare_state("table", table, how="bytes")
        api.declare_state("post", post, how="recreated")

    if mode == "save":
        assert ws is not None
        table.fill_(3.0)  # "warm-up" output the graph reads: LOAD gets it back from the archive

        def fwd() -> Any:
            torch.mul(w, 2.0, out=ws)  # the skipped phase's workspace
            return ws + kv + table[0] + post[0]

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fwd()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        g = api.PersistentCUDAGraph()
        with torch.cuda.graph(g, pool=torch.cuda.graph_pool_handle()):
            y = fwd()
        g.instantiate()
        post_capture()
        saver = api.Saver()
        saver.add("g", g, [], [y])
        out["save"] = saver.save(archive, api.Facts(ENGINE, MODEL))["phases"]
        g.replay()
    else:
        try:
            res = api.load(
                archive,
                api.Facts(ENGINE, MODEL),
                sizes=[],
                setup_tensors={"w": w, "kv": kv, "table": table, "post": post},
            )
            out["skipped"] = res.skipped_phases
            out["post_capture_phases"] = res.post_capture_phases
            out["table_before_verify"] = table[0].item()
            post_capture()
            lg = res.graphs["g"]
            lg.replay()  # verify_state() runs first
            y = lg.outputs[0]
        except api.PersistError as exc:
            return {**out, "refused": str(exc), "where": "load"}
        out["table_after_verify"] = table[0].item()
    torch.cuda.synchronize()
    out["y"] = _digest(y)
    out["post"] = post[0].item()
    return out


def _run_single(tmp: Path, mode: str, n_profile: int, bad_state: bool = False) -> dict[str, Any]:
    from graphpersist.memory import region

    env = {**region.preload_env(), **PINNED_ENV, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "0"}
    env["PYTHONPATH"] = os.pathsep.join([str(OVERLAY), env.get("PYTHONPATH", "")])
    result = tmp / f"single-{mode}-{n_profile}-{int(bad_state)}.json"
    argv = [sys.executable, __file__, "single", mode, str(tmp / "single-archive"), str(n_profile), str(int(bad_state)),
            str(result)]  # fmt: skip
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    log = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0 and result.exists(), f"{mode} failed (rc {proc.returncode}):\n{log}"
    data = json.loads(result.read_text())
    print(mode, n_profile, bad_state, json.dumps(data, indent=1))
    return data


@pytest.mark.gpu
def test_variable_phase_skipped_phase_and_state(tmp_path: Path) -> None:
    saved = _run_single(tmp_path, "save", 3)
    assert "refused" not in saved, saved
    names = [p[0] for p in saved["save"]]
    assert names[:4] == ["weights", "profile", "autotune", "kv"] and names[-1] == "post_capture", names

    loaded = _run_single(tmp_path, "load", 1)  # fewer profile allocations, no autotune phase
    assert "refused" not in loaded, loaded
    assert loaded["kv"] == saved["kv"]  # the phase after the variable one kept its anchor
    assert loaded["skipped"] == ["autotune"] and loaded["post_capture_phases"] == ["post_capture"]
    assert loaded["table_before_verify"] == 0.0 and loaded["table_after_verify"] == 3.0  # "bytes" written back
    assert loaded["post"] == saved["post"]  # the post-capture allocation landed at its saved address
    assert loaded["y"] == saved["y"]  # bit-identical output

    more = _run_single(tmp_path, "load", 3 + 2)  # exactly the headroom: still fits
    assert "refused" not in more and more["y"] == saved["y"], more
    over = _run_single(tmp_path, "load", 3 + 3)
    assert over.get("where") == "setup" and "phase 'profile' overran at LOAD" in over["refused"], over

    bad = _run_single(tmp_path, "load", 1, bad_state=True)
    assert bad.get("where") == "load", bad
    assert "state 'post' (recreated)" in bad["refused"] and "SAVE's hashed" in bad["refused"], bad


# ------------------------------------------------------------------------------------------- two GPUs, IPC


TRITON_SRC = '''
import triton
import triton.language as tl


@triton.jit
def add_peer_indirect(mine_ptr, rank_data_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out = mine + peer, the peer's address read from device memory (custom all-reduce's rank data)."""
    peer_ptr = tl.load(rank_data_ptr).to(tl.pointer_type(tl.float32))
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.load(mine_ptr + offs, mask=m) + tl.load(peer_ptr + offs, mask=m), mask=m)
'''


def step_ipc(mode: str, archive: Path, rank: int, port: int, shift_rank: int) -> dict[str, Any]:
    import importlib.util

    import torch
    import torch.distributed as dist
    from cuda.bindings import driver as drv

    from graphpersist import api
    from graphpersist.archive import read_shared
    from graphpersist.memory.tensors import tensor_at

    kernel_file = archive.parent / f"ipc_kernel_{rank}.py"  # triton.jit needs its source in a file
    kernel_file.write_text(TRITON_SRC)
    spec = importlib.util.spec_from_file_location(f"ipc_kernel_{rank}", kernel_file)
    assert spec and spec.loader
    kmod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kmod)

    torch.cuda.set_device(rank)
    api.start_region()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    par = {"world_size": 2, "tp_size": 2}
    if mode == "load":
        api.use_layout(archive, rank=rank)
    n = 1 << 18
    with api.phase("comm"):
        mine_ptr = int(_ck(drv.cuMemAlloc(2 << 20), "cuMemAlloc"))
        mine = tensor_at({"addr": mine_ptr, "dtype": "float32", "shape": [n], "stride": [1]})
        mine.fill_(float(rank + 1))
        rank_data = torch.zeros(1, dtype=torch.int64, device="cuda")
        result = torch.zeros(n, device="cuda")
    named = {"rank_data": rank_data, "result": result}
    api.mark_setup(named)
    out: dict[str, Any] = {"rank": rank}

    def launch() -> None:
        kmod.add_peer_indirect[(n // 1024,)](mine, rank_data, result, n, BLOCK=1024)

    def register() -> None:
        with api.phase("post_capture"):
            if rank == shift_rank:
                _ck(drv.cuMemAlloc(2 << 20), "cuMemAlloc")  # shifts this rank's IPC open
            handle = _ck(drv.cuIpcGetMemHandle(mine_ptr), "cuIpcGetMemHandle")
            handles: list[Any] = [None, None]
            dist.all_gather_object(handles, bytes(handle.reserved))
            peer = drv.CUipcMemHandle()
            peer.reserved = handles[1 - rank]
            flags = drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
            out["peer_ptr"] = int(_ck(drv.cuIpcOpenMemHandle(peer, flags), "cuIpcOpenMemHandle"))
            rank_data.fill_(out["peer_ptr"])
        api.declare_state("rank_data", rank_data, how="recreated")

    g, res = None, None
    try:
        if mode == "save":
            rank_data.fill_(mine_ptr)  # warm-up (compiles the kernel) against this rank's own buffer
            launch()
            torch.cuda.synchronize()
            g = api.PersistentCUDAGraph()
            with torch.cuda.graph(g):
                launch()
            g.instantiate()
            register()
            saver = api.Saver()
            saver.add("ar", g, [], [result])
            note = (lambda: {"note.txt": b"from rank 0"}) if rank == 0 else None  # shared: rank 0 only, called late
            saver.save(archive, api.Facts(ENGINE, MODEL, parallel=par), rank=rank, overwrite=True, shared=note)
        else:
            out["note"] = (read_shared(archive, "note.txt") or b"").decode()
            res = api.load(archive, api.Facts(ENGINE, MODEL, parallel=par), sizes=[], rank=rank, setup_tensors=named)
            register()
    except api.PersistError as exc:
        out["refused"] = str(exc)
    dist.barrier()  # every rank calls the same barriers, refused or not
    if "refused" not in out:
        try:
            if g is not None:
                g.replay()
            else:
                res.graphs["ar"].replay()  # verify_state() runs first
            torch.cuda.synchronize()
            out["result"] = sorted(set(result.cpu().tolist()))
        except api.PersistError as exc:
            out["refused"] = str(exc)
    dist.barrier()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_ipc(tmp: Path, mode: str, shift_rank: int = -1) -> list[dict[str, Any]]:
    from graphpersist.memory import region

    env = {**region.preload_env(), **PINNED_ENV, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "0,1"}
    env["PYTHONPATH"] = os.pathsep.join([str(OVERLAY), env.get("PYTHONPATH", "")])
    port = _free_port()
    procs, results = [], []
    for rank in (0, 1):
        res = tmp / f"ipc-{mode}-{shift_rank}-{rank}.json"
        argv = [sys.executable, __file__, "ipc", mode, str(tmp / "ipc-archive"), str(rank), str(port),
                str(shift_rank), str(res)]  # fmt: skip
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        results.append(res)
    logs = [p.communicate(timeout=300)[0][-4000:] for p in procs]
    for p, res, log in zip(procs, results, logs, strict=True):
        assert p.returncode == 0 and res.exists(), f"{mode} failed (rc {p.returncode}):\n{log}"
    data = [json.loads(r.read_text()) for r in results]
    print(mode, shift_rank, json.dumps(data, indent=1))
    return data


def _two_gpus() -> bool:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return out.count("GPU ") >= 2


@pytest.mark.gpu
def test_post_capture_ipc_registration_across_two_ranks(tmp_path: Path) -> None:
    if not _two_gpus():
        pytest.skip("needs 2 GPUs: post-capture IPC test NOT RUN")
    saved = _run_ipc(tmp_path, "save")
    assert all("refused" not in r for r in saved), saved
    assert [r["result"] for r in saved] == [[3.0], [3.0]]  # 1 + 2 read through the peer mapping
    loaded = _run_ipc(tmp_path, "load")
    assert all("refused" not in r for r in loaded), loaded
    assert [r["peer_ptr"] for r in loaded] == [r["peer_ptr"] for r in saved]  # opens at their saved addresses
    assert [r["result"] for r in loaded] == [[3.0], [3.0]]
    assert [r["note"] for r in loaded] == ["from rank 0", "from rank 0"]  # one shared file, read by every rank
    shifted = _run_ipc(tmp_path, "load", shift_rank=1)
    msg = shifted[1].get("refused", "")
    assert "phase 'post_capture' (exact, post_capture): event 0 differs: saved ipc_open" in msg, shifted
    assert "live alloc" in msg, shifted


def main() -> int:
    sys.path.insert(0, str(OVERLAY))
    from graphpersist.memory import region

    region.reexec_with_interposer()
    step, mode, archive, *rest, result = sys.argv[1:]
    if step == "single":
        data = step_single(mode, Path(archive), int(rest[0]), bool(int(rest[1])))
    else:
        data = step_ipc(mode, Path(archive), int(rest[0]), int(rest[1]), int(rest[2]))
    Path(result).write_text(json.dumps(data, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
