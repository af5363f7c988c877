"""graphpersist.api, the one module recipes and tools import: importing it costs no torch (a script re-executes itself
under the interposer before torch loads), and every name it lists resolves, the torch-bound ones on first use."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNTIME = str(REPO / "overlays" / "graphpersist")
# A stand-in torch: the class save.py subclasses, nothing the facade would run.
STANDIN = (
    "import sys, types; torch = types.ModuleType('torch'); "
    "torch.cuda = types.SimpleNamespace(CUDAGraph=type('CUDAGraph', (), {})); sys.modules['torch'] = torch; "
)


def python(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": RUNTIME}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_importing_the_facade_imports_neither_torch_nor_the_modules_that_need_it() -> None:
    code = (
        "import sys; from graphpersist import api; api.preload_env; api.open_archive; "
        "print(sorted(m for m in ('torch', 'graphpersist.save', 'graphpersist.load', 'graphpersist.memory.setup', "
        "'graphpersist.memory.tensors') if m in sys.modules))"
    )
    assert python(code) == "[]"


def test_every_name_the_facade_lists_resolves_and_its_torch_names_bind_on_first_use() -> None:
    code = STANDIN + (
        "from graphpersist import api; "
        "missing = [n for n in api.__all__ if not hasattr(api, n)]; "
        "from graphpersist import save; "
        "print(missing, api.Saver is save.Saver, 'graphpersist.load' in sys.modules)"
    )
    assert python(code) == "[] True True"


def test_a_name_the_facade_does_not_list_is_an_attribute_error_without_importing_torch() -> None:
    code = "import sys; from graphpersist import api; print(hasattr(api, 'region'), 'torch' in sys.modules)"
    assert python(code) == "False False"
