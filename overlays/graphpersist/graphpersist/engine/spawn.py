"""A spawn that runs only its target: how a process without the interposer starts a persisting engine's processes.

Every process that holds a model runs under the runtime's interposer, loaded by LD_PRELOAD when the process is
executed. A program started without it (a plain `python app.py` that calls the engine) cannot fork the engine's
processes, whose fork would lack it too, so it spawns them with the interposer in their environment. But
multiprocessing's spawn also runs the program's `__main__` again in the child (`spawn.get_preparation_data` records
`init_main_from_path` or `init_main_from_name`, and the child imports the script as `__mp_main__`): a script without
`if __name__ == "__main__":` ran its top level twice, where the engine upstream forks and runs it once.

`spawn_context()`'s processes start as spawn's do with that record left out: the child imports no `__main__` and
runs only its target, as a forked child would. What it then cannot receive is an object defined in the script
(pickled by reference to `__main__`). One found while the process is pickled makes the start an ordinary spawn
where the script keeps its start behind the main guard (running it again in the child only defines names);
otherwise the start is refused, naming the object and what to do.
"""

from __future__ import annotations

import ast
import multiprocessing.context as mpcontext
import multiprocessing.popen_spawn_posix as popen_spawn_posix
import multiprocessing.reduction as reduction
import multiprocessing.spawn as mpspawn
import sys
import types
from pathlib import Path
from typing import IO, Any

from graphpersist.errors import PersistError

MAIN_KEYS = ("init_main_from_path", "init_main_from_name")  # what makes spawn's child run `__main__` again


class _InMain(Exception):
    """Raised while a process is pickled: it refers to `name`, an object of the program's `__main__`."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class _MainlessPickler(reduction.ForkingPickler):
    """multiprocessing's pickler, stopping at the first class or function of `__main__` (pickled by name, which a
    child that never imported `__main__` could not find)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type | types.FunctionType) and getattr(obj, "__module__", None) == "__main__":
            raise _InMain(f"__main__.{obj.__qualname__}")
        return NotImplemented


class _View:
    """A module as a function of multiprocessing reads it, with some of its names replaced."""

    def __init__(self, module: types.ModuleType, **replaced: Any) -> None:
        self._module = module
        self.__dict__.update(replaced)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _preparation_without_main(name: str) -> dict[str, Any]:
    data = mpspawn.get_preparation_data(name)
    for key in MAIN_KEYS:
        data.pop(key, None)
    return data


def _dump(obj: Any, file: IO[bytes], protocol: int | None = None) -> None:
    _MainlessPickler(file, protocol).dump(obj)


def _rebound(func: types.FunctionType, **names: Any) -> types.FunctionType:
    """`func` reading `names` in place of its module's globals of those names (its code unchanged)."""
    return types.FunctionType(func.__code__, {**func.__globals__, **names}, func.__name__, func.__defaults__)


# CPython's own launcher, reading the preparation data without the record of `__main__` and pickling through
# _MainlessPickler: no copy of multiprocessing's code, and nothing of multiprocessing changed for anyone else.
_launch_without_main = _rebound(
    popen_spawn_posix.Popen._launch,
    spawn=_View(mpspawn, get_preparation_data=_preparation_without_main),
    reduction=_View(reduction, dump=_dump),
)


class _MainlessPopen(popen_spawn_posix.Popen):
    def _launch(self, process_obj: Any) -> None:
        fds = list(self._fds)
        try:
            _launch_without_main(self, process_obj)
        except _InMain as found:
            if not main_is_guarded():
                raise PersistError(
                    f"graphpersist: the process {process_obj.name!r} needs {found.name}, which this program defines "
                    "in its main script; persistence starts that process without running the script again (this "
                    "process lacks the runtime's interposer, so it cannot fork it), where that name does not exist. "
                    'Put the start of the script under `if __name__ == "__main__":`, or start the program under '
                    "`graphpersist exec`"
                ) from None
            self._fds[:] = fds  # what the aborted pickling passed to the child, passed again below
            super()._launch(process_obj)  # spawn as multiprocessing does: the guard keeps the script from starting


class _MainlessProcess(mpcontext.SpawnProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> _MainlessPopen:
        return _MainlessPopen(process_obj)


class MainlessSpawnContext(mpcontext.SpawnContext):
    """multiprocessing's spawn context whose processes run only their target (the module docstring)."""

    Process = _MainlessProcess


def spawn_context() -> MainlessSpawnContext:
    """The context an engine starts its processes with where it must spawn and upstream would fork."""
    return MainlessSpawnContext()


def main_is_guarded(main: types.ModuleType | None = None) -> bool:
    """Whether the program's main script (`main`, else `__main__`) runs its start under `if __name__ ==
    "__main__":` at its top level, so that running it again only defines names. False when there is no script
    file to read (`python -c`, an interactive session)."""
    main = sys.modules["__main__"] if main is None else main
    path = getattr(main, "__file__", None)
    if not path:
        return False
    try:
        tree = ast.parse(Path(path).read_bytes())
    except (OSError, SyntaxError, ValueError):
        return False
    return any(isinstance(node, ast.If) and _is_main_test(node.test) for node in tree.body)


def _is_main_test(test: ast.expr) -> bool:
    """`__name__ == "__main__"`, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = (test.left, test.comparators[0])
    named = any(isinstance(side, ast.Name) and side.id == "__name__" for side in sides)
    return named and any(isinstance(side, ast.Constant) and side.value == "__main__" for side in sides)
