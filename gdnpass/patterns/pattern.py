"""A registry entry: the parts of one pattern folder, and what a complete one has (:meth:`Pattern.missing`).

A folder ``gdnpass/patterns/<name>/`` holds ``matcher.py`` (the rule block, the rules, the capture, ``prepare`` and
the rewrite) and ``record.py`` (the fused op, its parameters and checks, the bytes it writes, its launches, scope,
adapters, Triton programs and the outputs ``run --check`` compares), and names its Triton launcher; its
``__init__.py`` exports ``PATTERN``, one :class:`Pattern`. The registry (:mod:`gdnpass.patterns`) lists them in
pass order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gdnpass.ir import FUSED_OPS, Graph
from gdnpass.patterns.common import HAZARD, STRUCTURAL, Capture, Context, refusal_names, rule_block_problems
from gdnpass.patterns.record import FusedOp


@dataclass(frozen=True)
class Pattern:
    name: str                     # the stable name reports use (gdn_conv_chain)
    matcher: type                 # candidates, prepare (optional), capture, rules, plan, rewrite; instantiated per pass
    capture: type                 # its Capture subclass
    record: FusedOp               # the fused op it creates
    rule_doc: str                 # the matcher module's docstring: the rule block, first
    kernel: str                   # the Triton launcher the record's Triton adapter calls (dotted name)
    example: dict = field(default_factory=dict)  # VerifyConfig fields of a small graph it fuses (the registry test)
    modes: tuple[str, ...] = ("narrow",)          # between-check flavours whose rules differ
    needs: tuple[str, ...] = ()                   # patterns whose fused nodes it takes (before it in the registry)

    def refusal_names(self, mode: str = "narrow") -> list[str]:
        return refusal_names(self.matcher().rules(Context(Graph(), mode)))

    def missing(self) -> list[str]:
        """The parts this entry lacks or gets wrong, as sentences (empty: complete). What a graph must show (the
        kernel names its programs report, the outputs --check compares) tests/patterns/test_registry.py checks on
        :attr:`example`."""
        out = []
        m, r = self.matcher, self.record
        if getattr(m, "name", None) != self.name:
            out.append(f"the matcher's name is {getattr(m, 'name', None)!r}, not {self.name!r}")
        for step in ("candidates", "capture", "rules", "plan", "rewrite"):
            if not callable(getattr(m, step, None)):
                out.append(f"the matcher has no {step}()")
        if out:
            return out
        modes = {mode: self.refusal_names(mode) for mode in self.modes}
        out += [f"rule block: {p}" for p in rule_block_problems(self.rule_doc, modes)]
        for mode in self.modes:
            rules = m().rules(Context(Graph(), mode))
            kinds = [x.kind for x in rules]
            if not rules or kinds != sorted(kinds, key=[STRUCTURAL, HAZARD].index):
                out.append(f"rules ({mode}): none, or a hazard before a structural rule")
            if len(set(modes[mode])) != len(modes[mode]):
                out.append(f"rules ({mode}): a refusal name twice")
        if not (isinstance(self.capture, type) and issubclass(self.capture, Capture)):
            out.append("the capture is not a patterns.common.Capture")
        else:
            for part in ("anchor", "removed", "written", "span"):
                if getattr(self.capture, part) is getattr(Capture, part):
                    out.append(f"the capture does not say {part}")
        out += self._record_missing(r)
        if not self.kernel.startswith("gdnpass.") or "." not in self.kernel[len("gdnpass."):]:
            out.append(f"kernel {self.kernel!r} is not a dotted name in gdnpass")
        if not self.example:
            out.append("no example graph")
        return out

    @staticmethod
    def _record_missing(r: Any) -> list[str]:
        if not isinstance(r, FusedOp):
            return ["no record (a patterns.record.FusedOp)"]
        out = []
        if r.op not in FUSED_OPS:
            out.append(f"the record's op {r.op} is not a fused op (ir.fused_op)")
        if not r.src or not r.outs:
            out.append("the record does not say what it reads (src) and writes (outs)")
        for part in ("check", "launches", "torch", "triton", "programs", "watch", "variant"):
            if not callable(getattr(r, part)):
                out.append(f"the record has no {part}")
        if r.scope is None:
            out.append("the record has no scope (its kernel's limits)")
        if "replaced" not in r.params:
            out.append("the record's params lack 'replaced'")
        return out
