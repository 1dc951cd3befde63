"""The loops of a cubin's SASS, to compare two builds of a kernel without a GPU.

A tile loop's cost shows in its body: instruction count, local-memory spills (``STL``/``LDL``),
MMAs, ``MUFU`` and global stores.  ``cuobjdump -sass`` lists the code (NVIDIA's
``nvidia-cuda-cuobjdump`` wheel carries it, and it runs ``nvdisasm`` from the
``nvidia-cuda-nvdisasm`` wheel, which must be on PATH: a CPU machine can run both); a loop is a
backward branch, and its body is everything from the branch target to the branch.

    python -m cula_aot.compiler.sass A.cubin [B.cubin]

prints each cubin's loops, and with two cubins the opcode counts that differ between their
smallest MMA-bearing loops (the hot tile loop of the K2 and fused kernels).  ``CUOBJDUMP`` names
the binary when it is not on PATH.
"""

import collections
import dataclasses
import os
import re
import shutil
import subprocess
import sys

_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\s+(?:`\(\.L_x_\d+\)\s+)?0x([0-9a-f]+)")
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")
# Shorter backward branches are spin waits (mbarrier try-wait, ELECT loops), not tile loops.
MIN_LOOP_BYTES = 0x200
COUNTED = ("MMA", "STL", "LDL", "MUFU", "STG")


@dataclasses.dataclass(frozen=True)
class Loop:
    start: int
    end: int
    body: tuple  # the instructions, predicate stripped

    def count(self, token: str) -> int:
        return sum(token in instruction for instruction in self.body)

    def opcodes(self) -> collections.Counter:
        return collections.Counter(instruction.split()[0] for instruction in self.body)

    def counts(self) -> str:
        return f"{len(self.body)} instructions, " + ", ".join(f"{token} {self.count(token)}" for token in COUNTED)

    def summary(self) -> str:
        return f"loop {self.start:#x}-{self.end:#x}: {self.counts()}"


def instructions(sass: str) -> list:
    """(address, instruction without its predicate) for every instruction line of ``sass``."""
    return [(int(m.group(1), 16), _PREDICATE.sub("", m.group(2))) for m in map(_LINE.match, sass.splitlines()) if m]


def loops(sass: str, min_bytes: int = MIN_LOOP_BYTES) -> list:
    """Every loop of ``sass`` (a backward branch spanning at least ``min_bytes``), in code order."""
    code = instructions(sass)
    found = []
    for address, instruction in code:
        m = _BRANCH.search(instruction)
        if m and int(m.group(1), 16) <= address - min_bytes:
            start = int(m.group(1), 16)
            found.append(Loop(start, address, tuple(i for a, i in code if start <= a <= address)))
    return found


def hot_loop(sass: str) -> Loop:
    """The smallest loop with MMAs: the tile step itself, not a loop around it."""
    candidates = [loop for loop in loops(sass) if loop.count("MMA")]
    if not candidates:
        raise ValueError("no loop with MMAs in this SASS")
    return min(candidates, key=lambda loop: len(loop.body))


def opcode_difference(a: Loop, b: Loop) -> dict:
    """Opcode → (count in ``a``, count in ``b``) where the two differ."""
    ca, cb = a.opcodes(), b.opcodes()
    return {op: (ca[op], cb[op]) for op in sorted(set(ca) | set(cb)) if ca[op] != cb[op]}


def disassemble(cubin_path: str) -> str:
    tool = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if tool is None:
        raise FileNotFoundError(
            "cuobjdump not found: set CUOBJDUMP or put it on PATH (pip download nvidia-cuda-cuobjdump carries it)"
        )
    return subprocess.run([tool, "-sass", cubin_path], capture_output=True, text=True, check=True).stdout


def main(argv=None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not 1 <= len(paths) <= 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    listings = [disassemble(p) for p in paths]
    for path, sass in zip(paths, listings):
        code = instructions(sass)
        if not code:
            raise SystemExit(f"{path}: cuobjdump listed no SASS instructions (not a cubin?)")
        whole = Loop(code[0][0], code[-1][0], tuple(i for _, i in code))
        print(f"{os.path.basename(path)}: {whole.counts()}")
        for loop in loops(sass):
            print("  " + loop.summary())
    if len(listings) == 2:
        a, b = (hot_loop(s) for s in listings)
        print(f"hot loops: {len(a.body)} → {len(b.body)} instructions; opcodes that differ:")
        for op, (na, nb) in opcode_difference(a, b).items():
            print(f"  {op:24s} {na:5d} {nb:5d} {nb - na:+d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
