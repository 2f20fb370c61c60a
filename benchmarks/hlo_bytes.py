"""Per-op HBM bytes of an optimised (post-layout) XLA HLO module, from its text: where a compiled program's
memory traffic goes.

    python benchmarks/hlo_bytes.py PROGRAM.hlo [--top 25]

:func:`op_bytes` lists every instruction the program runs (the entry computation and the computations it runs
through ``while`` / ``conditional`` / ``call`` / async ops; fused computations are looked into only to see which
parts of their operands a fusion reads) with the bytes it moves between HBM and the core:

* a buffer in a memory space other than HBM (``S(n)`` with ``n > 0`` in its layout: VMEM, SMEM, ...) counts 0;
* a fusion reads each operand once, except an operand the fused computation only slices (``slice``,
  ``dynamic-slice``, ``gather``, also through bitcasts and nested fusions): then the slices' bytes; a fusion
  whose root updates an operand in place (``dynamic-update-slice``, ``scatter``; or such an op alone) writes the
  update, not the whole buffer, and does not read the buffer it updates;
* a Mosaic kernel (``tpu_custom_call``) counts the ``bytes_accessed`` of its ``cost_estimate`` when it has one,
  else its operands and results in full (flagged ``estimated: false``);
* an async copy or slice (``copy-start``, ``slice-start``) reads its operand and writes its destination (the
  result tuple's first array); the ``-done`` halves count 0;
* ``parameter``, ``constant``, ``tuple``, ``get-tuple-element``, ``bitcast``, control flow and async wrappers
  count 0 (their bodies' ops are listed themselves); a ``while`` body is listed once, as XLA's cost analysis
  counts it.

It is a model of the traffic, not XLA's own cost analysis (which this module does not reproduce exactly): use it to
see which ops dominate, and compare its total with ``compiled.cost_analysis()["bytes accessed"]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
from collections import Counter
from pathlib import Path

DTYPE_BITS = {
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32,
    "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "f8e4m3fn": 8, "f8e5m2": 8,
    "f8e4m3b11fnuz": 8, "f8e4m3fnuz": 8, "f8e5m2fnuz": 8, "f8e8m0fnu": 8, "f4e2m1fn": 4, "c64": 64, "c128": 128,
    "token": 0,
}
FREE_OPS = {
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "conditional", "call",
    "after-all", "partition-id", "replica-id", "opt-barrier", "async-start", "async-update", "async-done",
    "copy-done", "slice-done", "add-dependency", "iota",
}
SLICING_OPS = {"slice", "dynamic-slice", "gather"}
IN_PLACE_OPS = {"dynamic-update-slice": 1, "scatter": 2}
"""Ops that update operand 0 in place, and which operand holds the update."""
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"^([a-z][\w\-]*)\(")
_OPNAME = re.compile(r'op_name="([^"]*)"')
_COST = re.compile(r'"cost_estimate"\s*:\s*\{[^}]*?"bytes_accessed"\s*:\s*"?([0-9.e+]+)')
_CALLED = re.compile(r"\b(body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def array_bytes(type_text: str) -> int:
    """HBM bytes of the arrays in an HLO type (a tuple's leaves summed); arrays in another memory space count 0."""
    total = 0
    for dtype, dims, layout in _ARRAY.findall(type_text):
        if dtype not in DTYPE_BITS:
            continue
        if layout and re.search(r"\bS\(([1-9]\d*)\)", layout):
            continue
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += (n * DTYPE_BITS[dtype] + 7) // 8
    return total


def _split_top(text: str) -> tuple[str, str]:
    """``"TYPE opcode(...)..."`` -> (TYPE, rest): the type may be a parenthesised tuple."""
    text = text.strip()
    if text.startswith("("):
        depth = 0
        for i, ch in enumerate(text):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return text[: i + 1], text[i + 1:].strip()
    head, _, rest = text.partition(" ")
    return head, rest.strip()


def _operands(rest: str) -> list[str]:
    """Operand names of ``opcode(%a, %b, ...)`` (the first parenthesised group)."""
    start = rest.find("(")
    depth, end = 0, len(rest)
    for i in range(start, len(rest)):
        depth += rest[i] == "("
        depth -= rest[i] == ")"
        if depth == 0:
            end = i
            break
    return re.findall(r"%([\w.\-]+)", rest[start + 1: end])


@dataclasses.dataclass
class Instr:
    name: str
    type_text: str
    opcode: str
    operands: list[str]
    text: str
    root: bool


def parse_module(text: str) -> tuple[dict[str, list[Instr]], str]:
    """``({computation name: instructions}, entry computation name)``."""
    comps: dict[str, list[Instr]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        type_text, rest = _split_top(m.group(3))
        op = _OPCODE.match(rest)
        comps[current].append(Instr(m.group(2), type_text, op.group(1) if op else "?", _operands(rest), line,
                                    bool(m.group(1))))
    return comps, entry


def _run_computations(comps: dict[str, list[Instr]], entry: str) -> list[str]:
    """Computations whose instructions run as ops: the entry and what it reaches through control flow."""
    out, todo = [], [entry]
    while todo:
        name = todo.pop()
        if name in out or name not in comps:
            continue
        out.append(name)
        for ins in comps[name]:
            if ins.opcode in ("fusion", "custom-call", "reduce", "reduce-window", "scatter", "sort", "map",
                              "select-and-scatter", "all-reduce", "reduce-scatter"):
                continue
            todo += [c for _, c in _CALLED.findall(ins.text)]
            for group in _BRANCHES.findall(ins.text):
                todo += re.findall(r"%?([\w.\-]+)", group)
    return out


def _params_and_users(fused: list[Instr]) -> tuple[dict[str, int], dict[str, list[Instr]]]:
    """A fused computation's ``{parameter name: operand index}`` and ``{instruction name: its users}``."""
    params = {f.name: int(re.search(r"parameter\((\d+)\)", f.text).group(1)) for f in fused if f.opcode == "parameter"}
    users: dict[str, list[Instr]] = {f.name: [] for f in fused}
    for f in fused:
        for o in f.operands:
            if o in users:
                users[o].append(f)
    return params, users


def _read_bytes(name: str, full: int, users: dict[str, list[Instr]], comps: dict[str, list[Instr]]) -> int:
    """Bytes of value ``name`` (``full`` bytes) that its users inside a fused computation read: the slices when
    every use slices it (through bitcasts and nested fusions), else all of it."""
    total = 0
    for u in users.get(name, []):
        if u.opcode in SLICING_OPS and u.operands and u.operands[0] == name:
            total += array_bytes(u.type_text)
        elif u.opcode == "bitcast":
            total += _read_bytes(u.name, full, users, comps)
        elif u.opcode == "fusion":
            called = re.search(r"calls=%?([\w.\-]+)", u.text)
            nested = comps.get(called.group(1), []) if called else []
            n_params, n_users = _params_and_users(nested)
            inner = [p for p, i in n_params.items() if i < len(u.operands) and u.operands[i] == name]
            total += sum(_read_bytes(p, full, n_users, comps) for p in inner) if inner else full
        else:
            return full
    return min(full, total) if users.get(name) else full


def _fusion_bytes(ins: Instr, fused: list[Instr], types: dict[str, str], comps: dict[str, list[Instr]]) -> int:
    """Bytes a fusion moves: operands read (sliced operands by their slices), the result written (in place:
    the update only)."""
    params, users = _params_and_users(fused)
    root = next((f for f in fused if f.root), fused[-1] if fused else None)
    in_place = None
    written = array_bytes(ins.type_text)
    if root is not None and root.opcode in IN_PLACE_OPS and root.operands[0] in params:
        in_place = params[root.operands[0]]
        upd = next((f for f in fused if f.name == root.operands[IN_PLACE_OPS[root.opcode]]), None)
        written = array_bytes(upd.type_text) if upd is not None else written
    total = written
    for pname, idx in params.items():
        if idx >= len(ins.operands) or idx == in_place:
            continue
        total += _read_bytes(pname, array_bytes(types.get(ins.operands[idx], "")), users, comps)
    return total


def op_bytes(text: str) -> list[dict]:
    """One row per op that moves bytes: ``{"name", "opcode", "type", "bytes", "op_name", "computation"}`` (plus
    ``"kernel"`` and ``"estimated"`` for Mosaic kernels), largest first."""
    comps, entry = parse_module(text)
    types = {ins.name: ins.type_text for instrs in comps.values() for ins in instrs}
    rows = []
    for comp in _run_computations(comps, entry):
        for ins in comps[comp]:
            if ins.opcode in FREE_OPS:
                continue
            row = {"name": ins.name, "opcode": ins.opcode, "type": ins.type_text, "computation": comp}
            m = _OPNAME.search(ins.text)
            row["op_name"] = m.group(1) if m else ""
            if ins.opcode == "fusion":
                called = re.search(r"calls=%?([\w.\-]+)", ins.text)
                nbytes = _fusion_bytes(ins, comps.get(called.group(1), []) if called else [], types, comps)
            elif ins.opcode in IN_PLACE_OPS:
                nbytes = 2 * array_bytes(types.get(ins.operands[IN_PLACE_OPS[ins.opcode]], ""))
            elif ins.opcode in ("dynamic-slice", "slice"):
                nbytes = 2 * array_bytes(ins.type_text)
            elif ins.opcode.endswith("-start"):  # (destination, source, context): read the source, write the first
                first = _ARRAY.search(ins.type_text)
                nbytes = sum(array_bytes(types.get(o, "")) for o in ins.operands) + (
                    array_bytes(first.group(0)) if first else 0)
            elif ins.opcode == "custom-call" and "tpu_custom_call" in ins.text:
                cost = _COST.search(ins.text)
                row["kernel"] = ins.name.split(".")[0]  # Pallas names the call after the kernel
                row["estimated"] = cost is not None
                nbytes = int(float(cost.group(1))) if cost else (
                    array_bytes(ins.type_text) + sum(array_bytes(types.get(o, "")) for o in ins.operands))
            else:
                nbytes = array_bytes(ins.type_text) + sum(array_bytes(types.get(o, "")) for o in ins.operands)
            if nbytes:
                row["bytes"] = nbytes
                rows.append(row)
    return sorted(rows, key=lambda r: -r["bytes"])


def source_of(op_name: str) -> str:
    """A short source path of an op's ``op_name`` metadata: the model path after the jit/scan wrappers, without
    the leading ``jit(...)/K3ForCausalLM/model`` and ``while/body/eval_jaxpr`` parts."""
    parts = [p for p in op_name.split("/") if p and not p.startswith(("jit(", "eval_jaxpr", "checkpoint"))
             and p not in ("K3ForCausalLM", "model", "while", "body", "closed_call", "pjit")]
    return "/".join(parts)


def summary(rows: list[dict], top: int = 25) -> dict:
    """Total bytes, Mosaic kernels' bytes, and the ``top`` ops ``[bytes, opcode, source]``."""
    kernels = Counter()
    for r in rows:
        if "kernel" in r:
            kernels[r["kernel"]] += r["bytes"]
    return {
        "total": sum(r["bytes"] for r in rows),
        "kernels": dict(kernels.most_common()),
        "top": [[r["bytes"], r["opcode"], r.get("kernel") or source_of(r["op_name"])] for r in rows[:top]],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("hlo")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    print(json.dumps(summary(op_bytes(Path(args.hlo).read_text()), args.top)))


if __name__ == "__main__":
    main()
