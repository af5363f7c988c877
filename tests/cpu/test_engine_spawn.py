"""The spawn that runs only its target (graphpersist.engine.spawn): a user's script never runs twice.

A program started without the runtime's interposer spawns its engine processes (a fork would lack the interposer);
multiprocessing's own spawn runs the program's script again in each child, so a script without the main guard ran
its top level twice. Each test starts a real script in a fresh interpreter: the switch resolved from the
environment as an engine's glue resolves it (the interposer exported), then a real spawn of a child that stands in
for the engine core and says what it runs under.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from graphpersist.engine import spawn

REPO = Path(__file__).resolve().parents[2]
needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed (builds the interposer)")

# The engine core's stand-in, importable by the child: it notes what it ran under.
STAND_IN_CORE = """
import json, os, sys

from graphpersist import engine, switch


def engine_core(out):
    with open(out, "a") as f:
        note = {"who": "core", "interposer": engine.interposer_loaded(), "mode": switch.resolve().mode.value,
                "main": getattr(sys.modules["__main__"], "__file__", None)}
        f.write(json.dumps(note) + "\\n")
"""

# A plain script, as the README's quickstart is written: no main guard. CONTEXT picks the spawn under test.
PLAIN_SCRIPT = """
import json, logging, multiprocessing, os, sys

from graphpersist import engine
import standin_core

out = sys.argv[1]
with open(out, "a") as f:
    f.write(json.dumps({{"who": "script", "pid": os.getpid(), "name": __name__}}) + "\\n")
engine.resolve_switch(None, None, logging.getLogger("standin"))  # GRAPHPERSIST_MODE/_DIR, as the engines' switch
context = {context}
core = context.Process(target=standin_core.engine_core, args=(out,), name="EngineCore")
core.start()
core.join()
print("core exit", core.exitcode, context.get_start_method())
"""


def run_script(tmp_path: Path, source: str, mode: str, *args: str) -> tuple[subprocess.CompletedProcess[str], list]:
    """Runs `source` as the main script of a fresh interpreter with persistence `mode`; its lines and the notes."""
    (tmp_path / "standin_core.py").write_text(STAND_IN_CORE)
    script = tmp_path / "app.py"
    script.write_text(textwrap.dedent(source))
    out = tmp_path / "notes.jsonl"
    (tmp_path / "archive").mkdir(exist_ok=True)
    dropped = ("GRAPHPERSIST_", "GP_REGION", "LD_PRELOAD")
    env = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
    env |= {"GRAPHPERSIST_MODE": mode, "GRAPHPERSIST_DIR": str(tmp_path / "archive")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "overlays" / "graphpersist"), str(tmp_path)])
    proc = subprocess.run([sys.executable, str(script), str(out), *args], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    notes = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return proc, notes


@needs_gcc
@pytest.mark.parametrize("mode", ["save", "load"])
def test_a_script_without_the_main_guard_runs_once_and_its_child_runs_under_the_interposer(
    tmp_path: Path, mode: str
) -> None:
    proc, notes = run_script(tmp_path, PLAIN_SCRIPT.format(context="engine.spawn_context()"), mode)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["core exit 0 spawn"]
    scripts = [n for n in notes if n["who"] == "script"]
    assert [n["name"] for n in scripts] == ["__main__"]  # the top level ran once
    assert [n for n in notes if n["who"] == "core"] == [{"who": "core", "interposer": True, "mode": mode, "main": None}]


@needs_gcc
def test_multiprocessings_own_spawn_runs_the_script_again(tmp_path: Path) -> None:
    """What the spawn above leaves out: with the ordinary spawn the child runs the script as `__mp_main__` first (and
    here, with no guard, starts a process of its own, which multiprocessing refuses while it bootstraps)."""
    proc, notes = run_script(tmp_path, PLAIN_SCRIPT.format(context='multiprocessing.get_context("spawn")'), "load")
    assert [n["name"] for n in notes if n["who"] == "script"] == ["__main__", "__mp_main__"]
    assert "finished its bootstrapping phase" in " ".join(proc.stderr.split())


MAIN_TARGET = """
import json, os, sys

from graphpersist import engine


def core_in_script(out):
    with open(out, "a") as f:
        f.write(json.dumps({{"who": "core", "pid": os.getpid()}}) + "\\n")


{guard}
    with open(sys.argv[1], "a") as f:
        f.write(json.dumps({{"who": "script", "name": __name__}}) + "\\n")
    core = engine.spawn_context().Process(target=core_in_script, args=(sys.argv[1],), name="EngineCore")
    core.start()
    core.join()
"""


def test_an_object_of_an_unguarded_script_is_refused_naming_it_and_what_to_do(tmp_path: Path) -> None:
    proc, notes = run_script(tmp_path, MAIN_TARGET.format(guard="if True:"), "off")
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("graphpersist.errors.PersistError: graphpersist: the process 'EngineCore' needs "
                           "__main__.core_in_script, which this program defines in its main script")  # fmt: skip
    assert 'Put the start of the script under `if __name__ == "__main__":`' in last and "graphpersist exec" in last
    assert notes == [{"who": "script", "name": "__main__"}]  # refused before any child started


def test_an_object_of_a_guarded_script_reaches_the_child_by_an_ordinary_spawn(tmp_path: Path) -> None:
    """The guard keeps the script from starting again where the child imports it (as `__mp_main__`), so such a
    start spawns as multiprocessing does and the child finds the script's function."""
    proc, notes = run_script(tmp_path, MAIN_TARGET.format(guard='if __name__ == "__main__":'), "off")
    assert proc.returncode == 0, proc.stderr
    assert [n["who"] for n in notes] == ["script", "core"]


@pytest.mark.parametrize(
    ("source", "guarded"),
    [
        ('if __name__ == "__main__":\n    main()\n', True),
        ("if '__main__' == __name__:\n    main()\n", True),
        ('import sys\n\n\ndef main():\n    pass\n\n\nif __name__ == "__main__":\n    sys.exit(main())\n', True),
        ("main()\n", False),
        ('def main():\n    if __name__ == "__main__":\n        pass\n', False),  # not at the top level
        ('if __name__ != "__main__":\n    pass\n', False),
        ("if __name__ == '__mp_main__':\n    pass\n", False),
        ("this is not python\n", False),
    ],
)
def test_the_main_guard_is_read_from_the_scripts_top_level(tmp_path: Path, source: str, guarded: bool) -> None:
    script = tmp_path / "app.py"
    script.write_text(source)
    main = types.ModuleType("__main__")
    main.__file__ = str(script)
    assert spawn.main_is_guarded(main) is guarded


def test_a_program_without_a_script_file_has_no_guard() -> None:
    assert spawn.main_is_guarded(types.ModuleType("__main__")) is False  # python -c, an interactive session
