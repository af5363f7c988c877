"""One step of a GPU test in a process of its own under the interposer, its result handed back as JSON.

The region must exist before CUDA allocates anything, so each step re-executes its test file as a script under
LD_PRELOAD (`step_main` in the child, `run_step` in pytest); the child writes what it measured to a JSON file
named by its last argument.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
OVERLAY = REPO / "overlays" / "graphpersist"
TOOLS = REPO / "tools"  # gpdiag: the reference rebuild the tests compare LOAD's with
PINNED_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def step_main(run: Callable[[list[str]], Any]) -> int:
    """The child: re-exec under the interposer, run the step with its arguments, write its result as JSON."""
    sys.path[:0] = [str(OVERLAY), str(TOOLS)]
    from graphpersist.memory import region

    region.reexec_with_interposer()
    *args, result = sys.argv[1:]
    Path(result).write_text(json.dumps(run(args), indent=2, default=str))
    return 0


def run_step(script: str, args: Sequence[str], result: Path, timeout: int = 300) -> tuple[dict[str, Any], str]:
    """Runs `script args... result` under the interposer; its JSON result and the end of its output."""
    from graphpersist.memory import region

    env = region.preload_env()
    env.update(PINNED_ENV)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(OVERLAY), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, script, *args, str(result)], env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    log = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0 and result.exists(), f"{' '.join(args)} failed (rc {proc.returncode}):\n{log}"
    return json.loads(result.read_text()), log
