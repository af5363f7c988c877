"""Read the stack samples `sitecustomize.py` wrote and say where each process spent its time.

    python stackview.py DIR [--since UNIX] [--until UNIX] [--bucket 1.0] [--focus REGEX] [--top 30]

For each process (pid, argv): a timeline, one line per bucket of seconds, naming the innermost frame that matches
--focus (default: engine, runtime and driver code) and the leaf frame of the busiest thread; then the frames with
the most inclusive samples. Threads parked in a wait (select, poll, sleep, lock acquire) are left out.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

IDLE = re.compile(
    r"(threading\.py:wait|selectors\.py:select|queues\.py:get|:_recv_bytes|time\.sleep|:poll:|"
    r"socket\.py:accept|connection\.py:wait|zmq/.*:recv|:_worker:|thread\.py:_worker|:acquire:)"
)


def read(path: Path) -> tuple[str, list[tuple[float, str, str]]]:
    header, samples, last = "", [], {}
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("#"):
            header = line
            continue
        parts = line.split("\t", 2)
        if len(parts) != 3:
            continue
        t, thread, stack = parts
        stack = last.get(thread, "") if stack == "=" else stack
        last[thread] = stack
        samples.append((float(t), thread, stack))
    return header, samples


def busy(stack: str) -> bool:
    leaf = stack.rsplit(";", 1)[-1]
    return bool(stack) and not IDLE.search(leaf)


def label(stack: str, focus: re.Pattern[str]) -> str:
    frames = stack.split(";")
    inner = next((f for f in reversed(frames) if focus.search(f)), "")
    return f"{inner} > {frames[-1]}" if inner and inner != frames[-1] else frames[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", type=Path)
    ap.add_argument("--since", type=float, default=0.0)
    ap.add_argument("--until", type=float, default=1e12)
    ap.add_argument("--bucket", type=float, default=1.0)
    ap.add_argument("--focus", default=r"vllm/|sglang/|graphpersist|gptools|driver\.py")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--thread", default="", help="only threads whose name contains this (e.g. MainThread)")
    ap.add_argument("--pid", default="", help="only this process")
    a = ap.parse_args()
    focus = re.compile(a.focus)
    for path in sorted(a.dir.glob(f"{a.pid or '*'}.stk"), key=lambda p: p.stat().st_mtime):
        header, samples = read(path)
        samples = [s for s in samples if a.since <= s[0] <= a.until and busy(s[2]) and a.thread in s[1]]
        if not samples:
            continue
        t0 = samples[0][0]
        print(f"\n=== {path.name} {header[:220]}\n    busy {samples[0][0]:.1f} .. {samples[-1][0]:.1f}")
        buckets: dict[int, Counter[str]] = {}
        for t, thread, stack in samples:
            buckets.setdefault(int((t - t0) // a.bucket), Counter())[f"[{thread}] {label(stack, focus)}"] += 1
        for b in sorted(buckets):
            (top, n), total = buckets[b].most_common(1)[0], sum(buckets[b].values())
            print(f"  +{b * a.bucket:7.1f}s ({t0 + b * a.bucket:.1f}) {n:3d}/{total:<3d} {top[:230]}")
        inclusive: Counter[str] = Counter()
        for _, _, stack in samples:
            inclusive.update(set(stack.split(";")))
        print("  inclusive:")
        for frame, n in inclusive.most_common(a.top):
            print(f"    {n:6d} {frame}")


if __name__ == "__main__":
    main()
