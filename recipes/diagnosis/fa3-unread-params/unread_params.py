"""Which parameter bytes sgl-kernel's FA3 forward kernels never read, from their SASS: the evidence behind
`_FA3_FWD_UNREAD` in overlays/sglang/sglang/srt/graphpersist_adapter.py.

SAVE writes zeros at a kernel's unread parameter bytes so that two SAVEs agree where the launcher left stack garbage.
That is only safe for bytes no instruction of the kernel reads. This script disassembles every sm_90a cubin of a
`flash_ops.abi3.so` (cuobjdump + nvdisasm), and for each kernel whose name matches the rule's pattern collects what
it reads of its parameter buffer:

- direct constant loads `c[0x0][0x210 + offset]` (the parameter buffer starts at constant-bank byte 0x210), with the
  load's width;
- indexed constant loads `c[0x0][Rn + imm]`, whose register is resolved from the MOV/SEL that set it (an unresolved
  one makes the kernel unusable for the rule);
- parameter addresses taken through `c[0x0][0x198]` (the buffer's generic address) plus an immediate: each must reach
  only TMA instructions (UTMA*), which read a 128-byte descriptor there; any other use makes the kernel unusable.

It prints, for the kernels whose reads could all be accounted for, the parameter layout they share and the byte ranges
inside the parameter that none of them reads, as a Python literal to paste into the rule. Run with:

    python unread_params.py flash_ops.abi3.so --tools DIR   # DIR holds cuobjdump and nvdisasm (CUDA 13 wheels)

`flash_ops.abi3.so` is in the pinned `sglang-kernel` wheel (sgl_kernel/); cuobjdump and nvdisasm come from the PyPI
wheels `nvidia-cuda-cuobjdump` and `nvidia-cuda-nvdisasm` (nvidia/cu13/bin). Takes about two minutes on two cores.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

PARAM_BANK = 0x210  # constant-bank byte of parameter-buffer byte 0 (sm_90)
PARAM_ADDR = 0x198  # constant-bank byte holding the parameter buffer's generic address
TMA_DESCRIPTOR = 128
DEFAULT_PATTERN = r"FlashAttnFwdSm90.*Li128ENS_10bfloat16_tEfNS_4arch4Sm90E(?:Lb[01]E){5}Lb0E(?:Lb[01]E){7}"
DIRECT = re.compile(r"c\[0x0\]\[(0x[0-9a-f]+)\]")
INDEXED = re.compile(r"c\[0x0\]\[(R\d+)\+(0x[0-9a-f]+)\]")
OPCODE = re.compile(r"\*/\s+(?:@!?U?P\w+\s+)?(\S+)")
SECTION = re.compile(r"\s*\.text\.(\S+):")


def width(opcode: str) -> int:
    """Bytes a constant load of this opcode reads (an ALU operand reads 4)."""
    if not opcode.startswith(("LDC", "ULDC")):
        return 4
    for tag, n in ((".128", 16), (".64", 8), (".U8", 1), (".S8", 1), (".U16", 2), (".S16", 2)):
        if tag in opcode:
            return n
    return 4


def resolve_index(lines: list[str], at: int, reg: str, depth: int = 0) -> list[int] | None:
    """Every value register `reg` can hold at line `at`, read backwards in straight-line code from the unpredicated
    MOV or SEL that last set it (predicated MOVs on the way add their values; a SEL that keeps the register's value
    adds what it held before). None, so the kernel is not used, where that is not certain: a branch target (label)
    in between, another instruction writing the register, or no definition within 300 lines."""
    values: list[int] = []
    for j in range(at - 1, max(0, at - 300), -1):
        line = lines[j]
        if line.lstrip().startswith(".L_") or line.lstrip().startswith("$"):
            return None  # another path may reach `at` with another value
        op = OPCODE.search(line)
        if not op or not re.match(rf"\S+ {reg}\b", line[op.start(1) :]):
            continue
        predicated = re.search(r"\*/\s+@", line) is not None
        mov = re.search(rf"(?:IMAD\.MOV\.U32|MOV) {reg}, (?:RZ, RZ, )?(0x[0-9a-f]+) ;", line)
        sel = re.search(rf"SEL {reg}, (0x[0-9a-f]+|RZ|{reg}), (0x[0-9a-f]+|RZ|{reg}), !?P\d ;", line)
        if mov:
            values.append(int(mov.group(1), 16))
            if predicated:
                continue
            return values
        if sel and not predicated:
            values += [0 if g == "RZ" else int(g, 16) for g in sel.groups() if g != reg]
            if reg in sel.groups():
                before = resolve_index(lines, j, reg, depth + 1) if depth < 8 else None
                if before is None:
                    return None
                values += before
            return values
        return None  # set by something else (arithmetic, a load): not a constant this reading can bound
    return None


def taken_addresses(lines: list[str], at: int, problems: list[str]) -> set[int]:
    """Offsets added to the buffer's address loaded at line `at`, each checked to reach only TMA instructions."""
    load = re.search(rf"ULDC\.64 (UR(\d+)), c\[0x0\]\[{PARAM_ADDR:#x}\]", lines[at])
    if not load:
        problems.append(f"buffer address read otherwise: {lines[at].strip()}")
        return set()
    base, high = load.group(1), f"UR{int(load.group(2)) + 1}"
    offsets: dict[str, tuple[int, int]] = {}  # register -> (buffer offset, the line that set it)
    for k in range(at + 1, min(len(lines), at + 400)):
        line = lines[k]
        if not re.search(rf"\b({base}|{high})\b", line):
            continue
        add = re.search(rf"UIADD3 (UR\d+), UP\d, {base}, (0x[0-9a-f]+), URZ", line)
        if add:
            offsets[add.group(1)] = (int(add.group(2), 16), k)
            if add.group(1) == base:
                break
            continue
        if re.search(rf"UIADD3\.X (UR\d+), URZ, {high}, URZ", line):
            continue
        dest = OPCODE.search(line)
        if dest and re.search(rf"^\S+ ({base}|{high})\b", line[dest.start(1) :]) and line.count(base) == 1:
            break  # overwritten without being read
        problems.append(f"buffer address used otherwise: {line.strip()}")
        break
    for reg, (off, start) in offsets.items():
        for k in range(start + 1, min(len(lines), start + 3000)):
            line = lines[k]
            if not re.search(rf"\b{reg}\b", line):
                continue
            op = OPCODE.search(line)
            opcode = op.group(1) if op else ""
            if opcode.startswith("UTMA"):
                continue
            if re.search(rf"^\S+ {reg}\b", line[op.start(1) :] if op else ""):
                break  # redefined
            problems.append(f"address of buffer byte {off} used otherwise: {line.strip()}")
            break
    return {off for off, _line in offsets.values()}


def kernel_reads(lines: list[str]) -> tuple[set[int], list[str]]:
    """Buffer bytes one kernel reads, and what could not be accounted for (non-empty: do not use the kernel)."""
    reads: set[int] = set()
    problems: list[str] = []
    for i, line in enumerate(lines):
        if "c[0x0]" not in line:
            continue
        op = OPCODE.search(line)
        opcode = op.group(1) if op else ""
        for m in DIRECT.finditer(line):
            const = int(m.group(1), 16)
            if const == PARAM_ADDR:
                for off in taken_addresses(lines, i, problems):
                    reads.update(range(off, off + TMA_DESCRIPTOR))
            elif const >= PARAM_BANK:
                off = const - PARAM_BANK
                reads.update(range(off, off + width(opcode)))
        for m in INDEXED.finditer(line):
            values = resolve_index(lines, i, m.group(1))
            if values is None:
                problems.append(f"unresolved indexed load: {line.strip()}")
                continue
            for v in values:
                off = v + int(m.group(2), 16) - PARAM_BANK
                reads.update(range(off, off + width(opcode)))
    return reads, problems


def layouts(cuobjdump: Path, cubin: Path) -> dict[str, list[tuple[int, int]]]:
    """Each kernel's parameters (buffer offset, size), from EIATTR_KPARAM_INFO."""
    elf = subprocess.run([str(cuobjdump), "-elf", str(cubin)], capture_output=True, text=True, check=True).stdout
    found = {}
    for m in re.finditer(r"\.nv\.info\.(\S+)\n(.*?)(?=\n\.nv\.info\.|\Z)", elf, re.S):
        params = re.findall(r"Offset\s*:\s*(0x[0-9a-f]+)\s+Size\s*:\s*(0x[0-9a-f]+)", m.group(2))
        found[m.group(1)] = [(int(o, 16), int(s, 16)) for o, s in params]
    return found


def ranges(values: set[int]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for x in sorted(values):
        if out and out[-1][1] == x:
            out[-1][1] = x + 1
        else:
            out.append([x, x + 1])
    return [(a, b) for a, b in out]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("library", type=Path, help="the shared library holding the kernels (flash_ops.abi3.so)")
    ap.add_argument("--tools", type=Path, required=True, help="folder with cuobjdump and nvdisasm")
    ap.add_argument("--pattern", default=DEFAULT_PATTERN, help="regex over mangled kernel names (the rule's)")
    a = ap.parse_args(argv)
    pattern = re.compile(a.pattern)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"unread_params: extracting the cubins of {a.library}", file=sys.stderr)
        subprocess.run([str(a.tools / "cuobjdump"), "-xelf", "all", str(a.library.resolve())], cwd=tmp, check=True,
                       capture_output=True)  # fmt: skip
        cubins = sorted(Path(tmp).glob("*.sm_90a.cubin"))
        unread: set[int] | None = None
        used, refused, seen_layouts = 0, [], Counter()
        for n, cubin in enumerate(cubins, 1):
            sass = subprocess.run([str(a.tools / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True,
                                  check=True).stdout  # fmt: skip
            kernels: dict[str, list[str]] = {}
            current = None
            for line in sass.splitlines():
                m = SECTION.match(line)
                if m:
                    current = m.group(1) if pattern.search(m.group(1)) else None
                    if current:
                        kernels[current] = []
                elif current:
                    kernels[current].append(line)
            if not kernels:
                continue
            params = layouts(a.tools / "cuobjdump", cubin)
            print(f"unread_params: [{n}/{len(cubins)}] {cubin.name}: {len(kernels)} kernel(s)", file=sys.stderr)
            for name, lines in kernels.items():
                reads, problems = kernel_reads(lines)
                layout = params.get(name, [])
                if problems or len(layout) != 1:
                    refused.append((name, problems[:1] or [f"layout {layout}"]))
                    continue
                ((start, size),) = layout
                seen_layouts[(start, size)] += 1
                mine = set(range(start, start + size)) - reads
                unread = mine if unread is None else unread & mine
                used += 1
    print(f"kernels matched and accounted for: {used}; not usable: {len(refused)}")
    for name, why in refused[:10]:
        print(f"  not usable: {name[:100]}...: {why[0]}")
    print(f"parameter layouts (buffer offset, size): {dict(seen_layouts)}")
    if unread is None:
        print("no kernel to derive a rule from")
        return 1
    found = ranges(unread)
    print(f"bytes none of them reads: {sum(b - a for a, b in found)} in {len(found)} ranges")
    print("_FA3_FWD_UNREAD = (" + ", ".join(f"({x}, {y})" for x, y in found) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
