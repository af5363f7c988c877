"""Which allocation put a setup tensor elsewhere at LOAD than at SAVE: torch's allocation history, on request.

LOAD proves each named setup tensor sits where SAVE had it (memory.setup.check_setup_tensors). When one does not,
something before it allocated or freed otherwise, and the two addresses do not say what. With
GRAPHPERSIST_ALLOC_TRACE=DIR set for SAVE and for LOAD, each process records torch's allocation history with the
Python stack of each allocation and free from start_region() on and writes its allocator actions up to mark_setup() to
DIR/<save|load>-rank<r>.json.gz; a refusal then names the allocation holding the saved address, and `graphpersist
allocdiff` names the first action where the two starts part. Off unless set: a stack costs time at every allocation.
torch records beside its allocator, so the trace moves no allocation and is not an environment pin.

A tensor held in a reference cycle is freed by Python's cyclic garbage collector, whenever a pass runs; when passes
run depends on how many objects the process made, threads included, so SAVE and LOAD can free it at different
points. The stack of such a free is wherever the pass began, which reads like an unrelated line: a free inside a pass
(by the clock of torch's trace entries, Unix time) carries the frame GC_FRAME first.
"""

from __future__ import annotations

import bisect
import difflib
import gc
import gzip
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphpersist import run

ENV = "GRAPHPERSIST_ALLOC_TRACE"
SUFFIX = ".json.gz"
FORMAT = 1
MAX_ENTRIES = 1_000_000  # torch keeps the newest ones; a vLLM start makes tens of thousands before mark_setup()
FRAMES_KEPT = 8  # innermost frames outside torch's own package, per action
WINDOW = 400  # actions after the parting compared by kind, size and caller
SHOWN = 4  # actions listed per side
# torch's trace entries that change what the allocator hands out next (trace entries of torch.cuda.memory._snapshot)
ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map", "segment_unmap")
FREES = ("free_requested", "free_completed")
GC_FRAME = "(freed in a pass of Python's cyclic garbage collector)"


@dataclass(frozen=True)
class Action:
    """One allocator action: its kind, address, size and the Python stack it happened in (innermost frame first)."""

    kind: str
    addr: int
    size: int
    frames: tuple[str, ...]

    def key(self) -> tuple[str, int, int, str]:
        """The action with its caller: a stray allocation that took the address SAVE gave another one differs."""
        return self.kind, self.addr, self.size, self.frames[0] if self.frames else ""

    def request(self) -> tuple[str, int, str]:
        """What was asked, wherever it landed: the kind, the size and the innermost caller."""
        return self.kind, self.size, self.frames[0] if self.frames else ""

    def line(self) -> str:
        return f"{self.kind} {self.size} B at {self.addr:#x}{_stack(self.frames)}"


def _stack(frames: Sequence[str]) -> str:
    """A stack under the line it belongs to, innermost frame first."""
    return "".join(f"\n      <- {f}" for f in frames or ("(no Python frames)",))


@dataclass
class GcPasses:
    """The cyclic collector's passes while tracing, as (began, ended) in microseconds of Unix time: the clock of the
    `time_us` of torch's trace entries. A gc.callbacks entry from start() to dump()."""

    spans: list[tuple[int, int]] = field(default_factory=list)
    began: int | None = None

    def callback(self, phase: str, info: Mapping[str, int]) -> None:
        now = time.time_ns() // 1000
        if phase == "start":
            self.began = now
        elif self.began is not None:
            self.spans.append((self.began, now))
            self.began = None

    def covers(self, time_us: int) -> bool:
        """Whether a pass ran at `time_us` (the spans are in time order and do not overlap)."""
        i = bisect.bisect_right(self.spans, (time_us, float("inf"))) - 1
        return i >= 0 and self.spans[i][0] <= time_us <= self.spans[i][1]


def folder() -> Path | None:
    """The trace folder GRAPHPERSIST_ALLOC_TRACE names, or None (tracing off)."""
    value = os.environ.get(ENV, "").strip()
    return Path(value) if value else None


def start() -> bool:
    """Turns torch's allocation history on (Python stacks) if GRAPHPERSIST_ALLOC_TRACE is set; whether it did."""
    if folder() is None:
        return False
    import torch

    # context "all": a free's own stack too (a tensor freed by the garbage collector shows where its pass began)
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=MAX_ENTRIES)
    passes = run.current().gc_passes = GcPasses()
    gc.callbacks.append(passes.callback)
    return True


def frames_of(frames: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    """`file:line function`, innermost first, without torch's own frames (all of them where no other is left)."""
    shown = [f"{f.get('filename', '?')}:{f.get('line', '?')} {f.get('name', '?')}" for f in frames]
    outside = [s for s, f in zip(shown, frames, strict=True) if f"{os.sep}torch{os.sep}" not in str(f.get("filename"))]
    return tuple((outside or shown)[:FRAMES_KEPT])


def actions_of(snapshot: Mapping[str, Any], device: int, passes: GcPasses | None = None) -> list[Action]:
    """The allocator actions of `device` in a torch memory snapshot, oldest first; a free made during one of
    `passes` gets GC_FRAME first."""
    traces = snapshot.get("device_traces") or []
    entries = traces[device] if device < len(traces) else []
    return [
        Action(str(e["action"]), int(e["addr"]), int(e["size"]), _by_gc(e, passes) + frames_of(e.get("frames") or ()))
        for e in entries
        if e.get("action") in ACTIONS
    ]


def _by_gc(entry: Mapping[str, Any], passes: GcPasses | None) -> tuple[str, ...]:
    at = entry.get("time_us")
    by_gc = passes is not None and entry.get("action") in FREES and at is not None and passes.covers(int(at))
    return (GC_FRAME,) if by_gc else ()


def label() -> str:
    """`save-rank0` / `load-rank1` in an engine's session; `setup-<pid>` for the runtime used alone."""
    sess = run.current().session
    return _label(sess.mode.value, sess.rank) if sess is not None else f"setup-{os.getpid()}"


def _label(mode: str, rank: int) -> str:
    return f"{mode}-rank{rank}"


def path_for(name: str) -> Path | None:
    where = folder()
    return where / f"{name}{SUFFIX}" if where is not None else None


def dump() -> Path | None:
    """mark_setup(): writes this start's allocator actions (when tracing) and says where."""
    name = label()
    path = path_for(name)
    if path is None:
        return None
    import torch

    passes = run.current().gc_passes
    if passes is not None and passes.callback in gc.callbacks:
        gc.callbacks.remove(passes.callback)
    actions = actions_of(torch.cuda.memory._snapshot(), torch.cuda.current_device(), passes)
    write(path, name, actions)
    print(f"graphpersist: allocation trace: {len(actions)} allocator actions up to mark_setup() in {path}",
          file=sys.stderr)  # fmt: skip
    return path


def write(path: Path, name: str, actions: Sequence[Action]) -> None:
    """The trace file read() reads: gzipped JSON, one row per action."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [[a.kind, a.addr, a.size, list(a.frames)] for a in actions]
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        json.dump({"format": FORMAT, "label": name, "max_entries": MAX_ENTRIES, "actions": rows}, fh)


def read(path: Path) -> list[Action]:
    """A trace dump() wrote; ValueError naming the file when it is not one."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            doc = json.load(fh)
        if doc.get("format") != FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, this runtime reads format {FORMAT}")
        return [Action(str(k), int(a), int(s), tuple(str(f) for f in fr)) for k, a, s, fr in doc["actions"]]
    except (OSError, EOFError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: not an allocation trace of graphpersist ({exc})") from exc


def parting(saved: Sequence[Action], live: Sequence[Action]) -> str:
    """Where two starts' allocator actions part, and how; '' where they are the same."""
    first = next((i for i, (a, b) in enumerate(zip(saved, live, strict=False)) if a.key() != b.key()), None)
    if first is None:
        if len(saved) == len(live):
            return ""
        first = min(len(saved), len(live))
    head = (
        f"SAVE and LOAD part at allocator action {first} (of {len(saved)} and {len(live)}); the earlier ones are equal."
    )
    for name, acts in (("SAVE", saved), ("LOAD", live)):
        if len(acts) >= MAX_ENTRIES:
            head += f" {name}'s trace is full ({MAX_ENTRIES} actions): its oldest ones are missing."
    a, b = saved[first : first + WINDOW], live[first : first + WINDOW]
    ops = difflib.SequenceMatcher(None, [x.request() for x in a], [x.request() for x in b], autojunk=False)
    tag, i1, i2, j1, j2 = next((op for op in ops.get_opcodes() if op[0] != "equal"), ("same", 0, 0, 0, 0))
    if tag == "same" or (i1, j1) != (0, 0):  # the same request first, at another address
        return "\n".join([
            head,
            "The same request landed elsewhere: the allocator's state differed although every traced action before it "
            "was equal (memory torch does not trace: another pool, a library's own mapping, the region's cursor).",
            f"  SAVE: {a[0].line()}",
            f"  LOAD: {b[0].line()}",
        ])  # fmt: skip
    lines = [head]
    for name, acts, lo, hi in (("SAVE", a, i1, i2), ("LOAD", b, j1, j2)):
        if hi > lo:
            only = "has" if tag != "replace" else "made instead"
            lines.append(f"{name} {only} {hi - lo} action(s) here, first:")
            lines += [f"  {x.line()}" for x in acts[lo : min(hi, lo + SHOWN)]]
    return "\n".join(lines)


def holder(address: int) -> str:
    """Tracing: the block of torch's allocator that holds `address` now, and where it was allocated; else ''."""
    if folder() is None:
        return ""
    import torch

    for seg in torch.cuda.memory_snapshot():  # as memory.setup reads torch's blocks
        for block in seg["blocks"]:
            start, size = int(block["address"]), int(block["size"])
            if start <= address < start + size:
                where = _stack(frames_of(block.get("frames") or ()))
                return f"at LOAD, {address:#x} lies in a {size} B block ({block.get('state')}) allocated{where}"
    return f"at LOAD, no block of torch's allocator holds {address:#x}"


def advice() -> str:
    """What a refusal over a moved setup tensor says to do next."""
    where, sess = folder(), run.current().session
    names = (
        [_label(m, sess.rank) for m in ("save", "load")]
        if sess is not None
        else ["setup-<SAVE's pid>", "setup-<LOAD's pid>"]
    )
    pair = " ".join(f"{where or 'DIR'}/{name}{SUFFIX}" for name in names)
    if where is None:
        return (f"To name the allocation that moved it, run SAVE and LOAD with {ENV}=DIR set and compare them: "
                f"`graphpersist allocdiff {pair}`.")  # fmt: skip
    return f"Compare the two starts: `graphpersist allocdiff {pair}`."
