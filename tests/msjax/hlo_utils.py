"""Reading XLA's HLO text in tests: computations, instructions in program order, collectives and their bytes."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([0-9,]*)\]")
_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "pred": 1, "s8": 1, "u8": 1, "f64": 8, "s64": 8}


@dataclass
class Instr:
    name: str
    op: str  # e.g. "all-gather" ("-start" suffixes of async pairs removed), "fusion", "dot"
    shapes: list[tuple[str, tuple[int, ...]]]  # result array shapes (a tuple result has several)
    operands: list[str]
    calls: list[str]
    line: str

    @property
    def bytes(self) -> int:
        return sum(_BYTES.get(dt, 4) * math.prod(dims) for dt, dims in self.shapes)

    def group_size(self) -> int:
        """Devices per replica group (1 if the groups cannot be read)."""
        m = re.search(r"replica_groups=\{\{([0-9,]+)\}", self.line)
        if m:
            return len(m.group(1).split(","))
        m = re.search(r"replica_groups=\[(\d+),(\d+)\]", self.line)
        return int(m.group(2)) if m else 1


@dataclass
class Computation:
    name: str
    instrs: list[Instr] = field(default_factory=list)


def parse(text: str) -> dict[str, Computation]:
    """Computations of an HLO module text, each with its instructions in program order."""
    comps: dict[str, Computation] = {}
    current = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            name = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
            current = comps.setdefault(name, Computation(name))
            if line.startswith("ENTRY"):
                comps["ENTRY"] = current
            continue
        m = _INSTR.match(line)
        if not m or current is None:
            continue
        name, result, op, rest = m.groups()
        op = op.removesuffix("-start")
        args = re.split(r"\),\s*[a-z_]+=", rest, maxsplit=1)[0]
        calls = re.findall(r"(?:calls|to_apply|body|condition)=(%[\w.\-]+)", rest)
        current.instrs.append(Instr(name, op, [(dt, tuple(int(d) for d in dims.split(",") if d))
                                               for dt, dims in _SHAPE.findall(result)],
                                    re.findall(r"%[\w.\-]+", args), calls, line))
    return comps


def collectives(comps: dict[str, Computation], op: str | None = None) -> list[Instr]:
    """Every collective (or those of kind `op`) in every computation."""
    unique = {id(c): c for c in comps.values()}.values()  # "ENTRY" is an alias of the entry computation
    return [i for c in unique for i in c.instrs if i.op in COLLECTIVES and (op is None or i.op == op)]


def is_matmul(instr: Instr, comps: dict[str, Computation]) -> bool:
    """A dot, or a fusion whose fused computation contains one."""
    if instr.op in ("dot", "convolution"):
        return True
    return instr.op == "fusion" and any(
        any(j.op in ("dot", "convolution") for j in comps[c].instrs) for c in instr.calls if c in comps)


def dependents(comp: Computation, roots: set[str]) -> set[str]:
    """Names of the instructions in `comp` that (transitively) use any of `roots`."""
    out = set(roots)
    for instr in comp.instrs:
        if any(o in out for o in instr.operands):
            out.add(instr.name)
    return out
