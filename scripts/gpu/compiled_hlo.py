"""What a compiled program does on the device, read from its optimized HLO
text (jax's Compiled.as_text()): the kernels it launches, the weights it
copies, the bytes some of its kernels write. scripts/gpu/e2e.py reports them
for the engine's decode step; tests/models/test_gpu_program_checks.py checks
the parsing on CPU-compiled programs against XLA's own HloModule.

The same parse reads a lowered program's HLO, before XLA's passes (jax's
Lowered.as_text(dialect="hlo"): what a CPU-only machine has of a program
cross-lowered for CUDA). Its dots, custom calls (Pallas kernels) and weight
copies are the program's own; its "kernels" are every operation, unfused.

Kernel-level computations: the entry and what it runs as a unit of its own
(call, e.g. a GPU command buffer; while bodies and conditions; conditional
branches; async wrappers). A fusion's computation, or a reduction's, is the
body of one kernel, not kernels. A kernel is any instruction of a
kernel-level computation except those that only name or route buffers
(parameter, tuple, bitcast, ...) or run other computations.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

# Instructions that launch nothing: they name, route or alias buffers, or hand
# work to another computation (whose own instructions are counted).
NOT_KERNELS = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "call", "while", "conditional",
    "async-start", "async-update", "async-done", "copy-done", "send-done", "recv-done", "after-all",
    "add-dependency", "opt-barrier", "partition-id", "replica-id", "domain"})
# Opcodes whose called computations are kernel-level.
RUNS_COMPUTATIONS = frozenset({"call", "while", "conditional", "async-start"})
# Ops that forward a value without computing it (a weight through them is still the weight).
PASS_THROUGH = frozenset({"bitcast", "reshape", "transpose", "convert", "copy", "get-tuple-element"})
COPIES = frozenset({"copy", "copy-start", "concatenate"})

# The decode attention's name scope (pallas_kernels/paged_decode_attention.py): its
# kernel and the kernel merging its splits.
DECODE_ATTENTION = "paged_decode_attention"

BYTES_PER_ELEMENT = {"pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
                     "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                     "c128": 16, "token": 0}

# A computation's header: "name (params) -> shape {" in a compiled module's
# text, "name {" in a lowered one's (jax's Lowered.as_text(dialect="hlo")).
_COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+)(?: \(.*\) -> .*)? \{$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = (.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_CALLED = re.compile(r"\b(calls|to_apply|body|condition|branch_computations|true_computation|false_computation)="
                     r"(\{[^}]*\}|%?[\w.\-]+)")


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attributes: str
    called: dict[str, list[str]]  # attribute (calls, to_apply, body, ...) -> computation names

    @property
    def op_name(self) -> str:
        match = re.search(r'op_name="((?:[^"\\]|\\.)*)"', self.attributes)
        return match.group(1).replace("\\'", "'") if match else ""


@dataclasses.dataclass
class Module:
    computations: dict[str, list[Instruction]]
    entry: str

    def kernel_level(self) -> list[str]:
        """The entry and the computations it runs as units (see the module docstring), in order."""
        order, todo = [], [self.entry]
        while todo:
            name = todo.pop(0)
            if name in order or name not in self.computations:
                continue
            order.append(name)
            for instruction in self.computations[name]:
                if instruction.opcode in RUNS_COMPUTATIONS:
                    todo += [c for names in instruction.called.values() for c in names]
        return order

    def runs(self) -> Counter:
        """How many times each kernel-level computation runs per run of the
        entry, counting each instruction that runs it (a computation called
        from every layer of a lowered, unoptimized module runs once per
        layer; a while body counts once)."""
        levels = self.kernel_level()
        sites: dict[str, list[str]] = {}  # computation -> the computation of each instruction running it
        for name in levels:
            for instruction in self.computations[name]:
                if instruction.opcode in RUNS_COMPUTATIONS:
                    for called in {c for names in instruction.called.values() for c in names}:
                        sites.setdefault(called, []).append(name)
        runs: Counter = Counter()

        def count(name: str) -> int:
            if name not in runs:
                runs[name] = 1 if name == self.entry else sum(count(caller) for caller in sites.get(name, []))
            return runs[name]

        for name in levels:
            count(name)
        return runs

    def kernels(self) -> list[Instruction]:
        """Each kernel as many times as its computation runs."""
        runs = self.runs()
        return [i for c in self.kernel_level() for i in self.computations[c] if i.opcode not in NOT_KERNELS
                for _ in range(runs[c])]


def _split_top_level(text: str) -> tuple[str, str]:
    """(the text inside the parenthesis `text` opens, the rest after it)."""
    depth = 0
    for position, char in enumerate(text):
        depth += char in "({["
        depth -= char in ")}]"
        if depth == 0:
            return text[1:position], text[position + 1:]
    return text[1:], ""


def _operands(inside: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for position, char in enumerate(inside + ","):
        if char in "({[":
            depth += 1
        elif char in ")}]":
            depth -= 1
        elif char == "," and depth == 0:
            part = inside[start:position].strip()
            if part:
                parts.append(part.split()[-1].lstrip("%"))  # "f32[2]{0} %x" or "%x"
            start = position + 1
    return parts


def parse(text: str) -> Module:
    computations: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = computations.setdefault(header.group(2), [])
            entry = header.group(2) if header.group(1) else entry
            continue
        match = _INSTRUCTION.match(line) if current is not None else None
        if not match:
            continue
        name, rest = match.groups()
        if rest.startswith("("):  # a tuple shape
            inside, rest = _split_top_level(rest)
            shape, rest = f"({inside})", rest.lstrip()
        else:
            shape, _, rest = rest.partition(" ")
        opcode, paren, rest = rest.partition("(")
        inside, attributes = _split_top_level(paren + rest)
        called = {key: [c.strip().lstrip("%") for c in value.strip("{}").split(",") if c.strip()]
                  for key, value in _CALLED.findall(attributes)}
        current.append(Instruction(name, shape, opcode, _operands(inside), attributes, called))
    return Module(computations, entry)


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape: an array (f32[2,3]{1,0}) or a tuple of them."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        size = 1
        for dim in filter(None, dims.split(",")):
            size *= int(dim)
        total += size * BYTES_PER_ELEMENT.get(dtype, 1 if dtype.startswith("f8") else 0)
    return int(total)


def kernel_counts(text: str) -> Counter:
    """Kernels per opcode; custom calls also per target ("custom-call
    __cublas$gemm"), fusions per kind ("fusion kCustom": a Triton or cuBLAS
    GEMM fusion on a GPU)."""
    counts: Counter = Counter()
    for instruction in parse(text).kernels():
        counts[instruction.opcode] += 1
        if instruction.opcode == "custom-call":
            target = re.search(r'custom_call_target="([^"]*)"', instruction.attributes)
            counts[f"custom-call {target.group(1) if target else '?'}"] += 1
        elif instruction.opcode == "fusion":
            kind = re.search(r"\bkind=(\w+)", instruction.attributes)
            counts[f"fusion {kind.group(1) if kind else '?'}"] += 1
    return counts


def kernels_per_layer(text: str, num_layers: int) -> float:
    """The kernels a compiled step launches (fusions, custom calls such as
    cuBLAS GEMMs and Pallas kernels, copies, ...), per model layer."""
    return _total(kernel_counts(text)) / num_layers


def _total(counts: Counter) -> int:
    """The kernels of kernel_counts' counts (its per-opcode entries, not the per-target or per-kind ones)."""
    return sum(n for op, n in counts.items() if " " not in op)


def step_report(text: str, num_layers: int, attention_scope: str) -> dict:
    """What a compiled step launches, as scripts/gpu/e2e.py and deviceless.py
    report it: its kernels (in all, per layer, per opcode), the weights it
    copies or concatenates, and the bytes the kernels under
    `attention_scope` (an op_name scope) write."""
    counts = kernel_counts(text)
    kernels = _total(counts)
    copies = weight_copies(text)
    attention_bytes, attention_kernels = bytes_written(text, attention_scope)
    return {"kernels": kernels, "kernels_per_layer": kernels / num_layers, "kernel_counts": dict(counts.most_common()),
            "weight_copies": len(copies), "weight_copy_lines": copies[:20],
            "attention_bytes_written": attention_bytes, "attention_kernels": attention_kernels[:8]}


def bytes_written(text: str, name_contains: str) -> tuple[int, list[str]]:
    """(bytes the kernels whose op_name contains `name_contains` write, one
    line per kernel). A kernel's output shape is what it writes at most: a
    Pallas kernel may mask stores away (the decode kernel's splits that see
    no key write nothing), which the HLO does not show. An in-place update:
    a fusion's reports its whole buffer; a custom call's outputs aliased to
    its operands (a Pallas kernel writing rows of a pool it was given) are
    left out, the rows it stores there unknown to the HLO."""
    kernels = [i for i in parse(text).kernels() if name_contains in i.op_name]
    return sum(_fresh_output_bytes(i) for i in kernels), [f"{i.name} {i.opcode} {i.shape}" for i in kernels]


def _fresh_output_bytes(instruction: Instruction) -> int:
    """Bytes of the outputs `instruction` does not update in place (see bytes_written)."""
    aliasing = re.search(r"output_to_operand_aliasing=\{(.*?)\}(?:,|$)", instruction.attributes)
    aliased = {int(i) for i in re.findall(r"\{(\d+)\}:", aliasing.group(1))} if aliasing else set()
    arrays = _ARRAY.findall(instruction.shape)
    return sum(shape_bytes(f"{dtype}[{dims}]") for n, (dtype, dims) in enumerate(arrays) if n not in aliased)


def _is_weight(instruction: Instruction, prefix: str) -> bool:
    """An entry parameter holding a weight: jax names a parameter after its
    argument's path (params['layers']['wq'][0] -> params__layers____wq___0_)."""
    return instruction.opcode == "parameter" and (instruction.name.startswith(prefix)
                                                  or instruction.op_name.startswith(prefix))


def weight_copies(text: str, weights_prefix: str = "params") -> list[str]:
    """Kernels that copy or concatenate a weight (an entry parameter whose
    argument path starts with `weights_prefix`): a copy / concatenate at
    kernel level, or one inside a fusion, whose operand is the weight itself
    (through bitcasts, reshapes, transposes, converts). One line each,
    naming the weights."""
    module = parse(text)
    by_name = {c: {i.name: i for i in instructions} for c, instructions in module.computations.items()}
    callers: dict[str, tuple[str, Instruction]] = {}  # computation -> (its caller's computation, the call)
    for computation, instructions in module.computations.items():
        for instruction in instructions:
            for names in instruction.called.values():
                for name in names:
                    callers.setdefault(name, (computation, instruction))

    def source(computation: str, name: str, depth: int = 0) -> str | None:
        """The weight `name` in `computation` is, or None."""
        instruction = by_name[computation].get(name)
        if instruction is None or depth > 64:
            return None
        if instruction.opcode in PASS_THROUGH and instruction.operands:
            return source(computation, instruction.operands[0], depth + 1)
        if instruction.opcode == "parameter":
            if computation == module.entry:
                return instruction.op_name or instruction.name if _is_weight(instruction, weights_prefix) else None
            if computation in callers:
                caller_computation, call = callers[computation]
                index = _parameter_index(instruction)
                if index < len(call.operands):
                    return source(caller_computation, call.operands[index], depth + 1)
        return None

    found = []
    for computation in module.kernel_level():
        for instruction in module.computations[computation]:
            if instruction.opcode in COPIES:
                weights = [w for w in (source(computation, o) for o in instruction.operands) if w]
                if weights:
                    found.append(f"{instruction.name} {instruction.opcode} {instruction.shape} of {', '.join(weights)}")
            elif instruction.opcode == "fusion":
                for fused in _fused_computations(module, instruction):
                    for inner in module.computations[fused]:
                        if inner.opcode in COPIES:
                            weights = [w for w in (source(fused, o) for o in inner.operands) if w]
                            if weights:
                                found.append(f"{instruction.name} fusion ({inner.opcode} {inner.shape}) "
                                             f"of {', '.join(weights)}")
    return found


def _parameter_index(instruction: Instruction) -> int:
    """parameter(N)'s N: the parser keeps it as the instruction's only operand."""
    return int(instruction.operands[0]) if instruction.operands else 0


def _fused_computations(module: Module, fusion: Instruction) -> list[str]:
    """A fusion's computation and the fusions nested in it."""
    found, todo = [], list(fusion.called.get("calls", []))
    while todo:
        name = todo.pop()
        if name in found or name not in module.computations:
            continue
        found.append(name)
        todo += [c for i in module.computations[name] if i.opcode == "fusion" for c in i.called.get("calls", [])]
    return found


def weight_readers(text: str, weights_prefix: str = "params") -> dict[str, list[str]]:
    """Weight (an entry parameter whose name starts with `weights_prefix`)
    -> "name opcode" of each kernel that reads it, through the operations that
    only forward it (PASS_THROUGH) and into the computations that take it
    as an argument (each call followed on its own: a lowered module calls
    one computation from every layer). A fusion reads what its operands
    hold; a GEMM reading a weight in place is the one kernel reading it."""
    module = parse(text)
    readers: dict[str, list[str]] = {}

    def visit(computation: str, bound: dict[int, str], depth: int = 0) -> None:
        held: dict[str, str] = {}  # instruction -> the weight it holds
        for instruction in module.computations.get(computation, []):
            if instruction.opcode == "parameter":
                if computation == module.entry and _is_weight(instruction, weights_prefix):
                    held[instruction.name] = instruction.op_name or instruction.name
                elif _parameter_index(instruction) in bound:
                    held[instruction.name] = bound[_parameter_index(instruction)]
                continue
            weights = [held.get(o) for o in instruction.operands]
            if instruction.opcode in PASS_THROUGH:
                if weights and weights[0]:
                    held[instruction.name] = weights[0]
            elif instruction.opcode in RUNS_COMPUTATIONS:
                if depth < 64 and any(weights):
                    for names in instruction.called.values():
                        for called in names:
                            visit(called, {i: w for i, w in enumerate(weights) if w}, depth + 1)
            elif instruction.opcode not in NOT_KERNELS:
                for weight in dict.fromkeys(w for w in weights if w):
                    readers.setdefault(weight, []).append(f"{instruction.name} {instruction.opcode}")

    visit(module.entry, {})
    return readers
