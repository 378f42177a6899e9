"""What a rule returns (`Diagnosis`, `Fix`), and the one registry of rules, filled by `@rule`.

    @rule("log_of_zero", aten.log, aten.log2, aten.log10, priority=180)
    def _log_zero(s: Site) -> Diagnosis | None: ...

A rule looks at a `Site` (the culprit as rules see it) and returns a `Diagnosis`, or None when
the pattern is not its own. More than one rule can claim a culprit (a log whose result where()
picks from is both the where trap and a log of zero), so the order rules are tried in decides
the diagnosis. That order is the priority, highest first, and nothing else: not the order the
rule modules were imported or written in. Priorities are unique (a tie fails at registration),
so the order is total; tests/test_rule_order.py pins it. Space them by ten to leave room.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Any

from nanreplay import torch_internals as ti
from nanreplay.diagnose.edits import codefix
from nanreplay.enums import FixKind

if TYPE_CHECKING:
    from nanreplay.diagnose.site import Site


@dataclass
class Fix:
    kind: FixKind  # a FixKind or its string; anything else fails loudly
    code: str  # the change: the user's statement rewritten, else guidance as a comment (never made-up names)
    epsilon: float | None = None
    reasoning: str = ""
    before: str | None = None  # the user's statement as written (when the source is readable)
    after: str | None = None
    patch: dict[int, Callable] | None = None  # call number -> rewrite, for verification
    variant: dict | None = None  # a whole-step change for verification (dtype / autocast)
    verified: bool | None = None  # replayed finite *and* plausible; False: replayed and not; None: not replayed
    verification: str | None = None
    guidance: str | None = None  # the change in words: shown (as a comment) where no line of the user's is rewritten
    alternatives: list[str] = field(default_factory=list)  # other changes that may help: never replayed
    replay: dict | None = None  # {loss, grad_norm, plausible, why} of the verification replay
    tested_as: str | None = None  # "line" (the rewritten line, at every call) | "op" (an op-level patch) | "step"
    probe: dict[int, Callable] | None = None  # the same patch with ε × 100: the loss must not depend on ε
    probe_down: dict[int, Callable] | None = None  # ... and with ε / 100: asked where ε × 100 moves healthy values
    compare_at: list[int] | None = None  # where the no-op check compares (the rewritten expression's end), if not
                                         # at the patched calls themselves (exp(x - max) differs from exp(x))
    noop_exempt: str | None = None  # why the no-op check does not apply (the original's finite values are noise)
    patched_ops: list[str] = field(default_factory=list)  # the ops (calls) the patch applied to in its replay
    edits: list[dict] = field(default_factory=list)  # every line the fix changes, in source order: {file, line,
                                                     # before, after}; before/after above is the culprit line's
    settings: dict | None = None  # what the fix sets where the run's optimizer / scheduler / autocast was made
                                  # ({"lr": 0.3}, {"eps": 1e-4}, {"schedule_cap": 1.0}, {"autocast_dtype": ...}):
                                  # an edit of that line where the snapshot recorded it (diagnose/edits/sitefix.py)
    rewrite: InitVar[codefix.Rewrite | None] = None  # the user's line rewritten: becomes code/before/after

    def __post_init__(self, rewrite: codefix.Rewrite | None) -> None:
        try:
            self.kind = FixKind(self.kind)
        except ValueError:
            raise ValueError(f"unknown fix kind {self.kind!r}") from None
        if rewrite is not None:
            self.code, self.before, self.after = rewrite.after, rewrite.before, rewrite.after
            every = sorted([rewrite, *rewrite.extra], key=lambda r: (str(r.file), r.first or r.line))
            self.edits = [r.edit() for r in every]
            if rewrite.extra:  # several lines: each after, with where it goes
                self.code = "\n".join(f"# {e['file']}:{e['line']}\n{e['after']}" for e in self.edits)
        elif self.guidance:
            self.code = "\n".join(f"# {ln}" if ln else "#" for ln in self.guidance.splitlines())
        if self.tested_as is None and self.variant:
            self.tested_as = "step"
        elif self.tested_as is None and self.patch:
            self.tested_as = "line" if rewrite is not None or self.after else "op"

    def to_json(self) -> dict:
        out = self._json()
        if self.settings:  # only where the fix sets something where the run was made (docs/json.md)
            out["settings"] = dict(self.settings)
        return out

    def _json(self) -> dict:
        return {"kind": self.kind.value, "code": self.code, "epsilon": self.epsilon, "verified": self.verified,
                "verification": self.verification, "reasoning": self.reasoning, "before": self.before,
                "after": self.after, "edits": [dict(e) for e in self.edits], "replay": self.replay, "tested_as": self.tested_as,
                "patched_calls": sorted(self.patch) if self.patch else [], "patched_ops": list(self.patched_ops),
                "alternatives": [{"code": a, "tested": False, "label": "untested"} for a in self.alternatives]}


# Fixes that compute the same maths in a stable form: equal to the original wherever it was finite (checked by
# replay), so where one replays finite it *is* this step's loss, and the reference other candidates must meet.
EXACT_KINDS = frozenset({FixKind.XLOGY, FixKind.LOG_SOFTMAX, FixKind.LOGSIGMOID, FixKind.BCE_WITH_LOGITS,
                         FixKind.MAX_SUBTRACTION, FixKind.STABLE_VARIANCE, FixKind.GUARD_EMPTY_REDUCTION,
                         FixKind.SOFTPLUS, FixKind.LOG1MEXP, FixKind.FINITE_FACTOR, FixKind.LOGADDEXP})


@dataclass
class Diagnosis:
    cause: str
    title: str
    explanation: str
    fixes: list[Fix] = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # more keys for the JSON's `diagnosis` (evidence, magnitude_origin, ...)


@dataclass(frozen=True)
class Rule:
    cause: str
    ops: frozenset[str]  # the op packets ('aten.log') whose culprits the rule looks at; empty: any op
    priority: int  # higher is tried first
    fn: Callable[[Site], Diagnosis | None]

    def applies_to(self, site: Site) -> bool:
        return not self.ops or site.packet in self.ops or site.op_packet in self.ops


class Registry:
    """The rules in dispatch order: by priority, highest first, whatever order they were added in."""

    def __init__(self) -> None:
        self._rules: list[Rule] = []

    def check(self, cause: str, priority: Any) -> None:
        """Fail loudly on what would make dispatch ambiguous: a second rule for a cause, a missing or tied priority."""
        if any(r.cause == cause for r in self._rules):
            raise ValueError(f"cause {cause!r} is registered twice")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"rule {cause!r} needs an explicit integer priority: @rule(cause, *ops, priority=N)")
        tie = next((r for r in self._rules if r.priority == priority), None)
        if tie is not None:
            raise ValueError(f"rule {cause!r}: priority {priority} is already {tie.cause!r}'s; "
                             "priorities decide which rule answers first and must be unique")

    def add(self, r: Rule) -> None:
        self.check(r.cause, r.priority)
        self._rules.append(r)
        self._rules.sort(key=lambda x: -x.priority)

    def __iter__(self) -> Iterator[Rule]:
        return iter(self._rules)

    def answer(self, site: Any) -> Diagnosis:
        """The first rule's diagnosis, highest priority first (a generic rule always answers)."""
        for r in self._rules:
            if not r.applies_to(site):
                continue
            diag = r.fn(site)
            if diag is not None:
                if diag.cause != r.cause:
                    raise RuntimeError(f"rule {r.cause!r} returned cause {diag.cause!r}")
                return diag
        raise RuntimeError(f"no rule answered for {getattr(site, 'op', site)!r}: the generic rules must")

    def __len__(self) -> int:
        return len(self._rules)


RULES = Registry()


def rule(cause: str, *ops: Any, priority: int | None = None) -> Callable:
    """Register a cause rule for culprits whose forward op is one of `ops` (none: any op).

    `priority` (required) places it in dispatch order: higher is tried first.
    """
    names = set()
    for op in ops:
        if not isinstance(op, ti.OpOverloadPacket):
            raise TypeError(f"rule {cause!r}: {op!r} is not an aten op (use torch.ops.aten.<name>)")
        names.add(str(op))
    RULES.check(cause, priority)

    def deco(fn: Callable[[Site], Diagnosis | None]) -> Callable:
        RULES.add(Rule(cause, frozenset(names), priority, fn))
        return fn

    return deco
