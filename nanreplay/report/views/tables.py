"""The report's tables: the culprit's inputs and output, per-parameter gradients, gradient shapes, non-finite leaves."""

from __future__ import annotations

import math
from dataclasses import dataclass

from nanreplay.report.format import dtype_max, fmt_shape, module_label, num, numel, op_base, sort_key, to_float
from nanreplay.report.views.elements import Cell, Fact

MAX_TABLE_ROWS = 1000  # gradient / shape tables: worst rows kept, the rest counted

# ------------------------------------------------------------------ culprit inputs / output

_ZERO_BAD = frozenset({"div", "sqrt", "rsqrt", "log", "log2", "log10", "reciprocal", "pow", "_softmax_backward_data",
                       "norm", "linalg_vector_norm", "atan2", "xlogy", "special_xlogy", "lgamma", "digamma",
                       "_log_softmax_backward_data"})
_NEG_BAD = frozenset({"sqrt", "rsqrt", "log", "log2", "log10", "pow", "lgamma", "digamma", "acos", "asin"})
_EXP_LIKE = frozenset({"exp", "exp2", "expm1", "sinh", "cosh", "softplus"})
_NEAR_OVERFLOW = 0.1


@dataclass
class StatsRow:
    label: str  # the argument's schema name ("mat2"), or "input 2" where it is not known
    cells: list[Cell]
    role: str = ""  # what the argument is: "weight (transposed)", "incoming gradient"


@dataclass
class StatsView:
    columns: list[str]
    rows: list[StatsRow]
    output: list[Fact]
    output_bad: bool
    scalars: str
    notes: list[str]
    forward_title: str = ""  # backward culprits: the forward op whose gradient it computed ...
    forward_rows: list[StatsRow] | None = None  # ... and that op's inputs


def _input_rows(base: str, inputs: list[dict], notes: list[str]) -> list[StatsRow]:
    """One row per tensor input, the value that explains the culprit flagged."""
    zero_bad = base in _ZERO_BAD
    neg_bad = base in _NEG_BAD
    rows = []
    for i, s in enumerate(inputs):
        dtype = s.get("dtype")
        dmax = dtype_max(dtype)
        absmax = to_float(s.get("absmax"))
        label = str(s.get("arg") or f"input {i}")
        near = bool(dmax and absmax is not None and absmax >= _NEAR_OVERFLOW * dmax)
        if base in _EXP_LIKE and dmax and absmax is not None and (to_float(s.get("max")) or 0) > math.log(dmax):
            near = True
            notes.append(f"exp overflows {dtype} above {math.log(dmax):.4g}; {label} reaches {num(s.get('max'))}.")
        # for a division only the denominator's zeros matter
        denominator = s.get("arg") == "other" if s.get("arg") else i >= 1
        zeros_bad = bool(s.get("zeros")) and zero_bad and (base != "div" or denominator)
        if base == "mul" and s.get("zeros") and any((x.get("inf") or 0) for x in inputs):
            zeros_bad = True  # 0 × ∞
        rows.append(StatsRow(label, [
            Cell(fmt_shape(s.get("shape"))), Cell(str(dtype)),
            Cell(num(s.get("min")), bad=near and (to_float(s.get("min")) or 0) < 0),
            Cell(num(s.get("max")), bad=near and (to_float(s.get("max")) or 0) > 0),
            Cell(num(s.get("absmin_nonzero"))),
            Cell(num(s.get("zeros")), bad=zeros_bad),
            Cell(num(s.get("negatives")), bad=bool(s.get("negatives")) and neg_bad),
            Cell(num(s.get("nan")), bad=bool(s.get("nan"))),
            Cell(num(s.get("inf")), bad=bool(s.get("inf"))),
        ], role=str(s.get("role") or "")))
    return rows


def stats_view(d: dict) -> StatsView | None:
    c = d.get("culprit")
    if not c:
        return None
    notes: list[str] = []
    rows = _input_rows(op_base(c.get("op")), c.get("inputs") or [], notes)
    forward_title, forward_rows = "", None
    if c.get("phase") == "backward" and c.get("forward_op"):
        fwd = c.get("forward_inputs")
        forward_title = (f"The forward op whose gradient this is, {c['forward_op']}, received (replayed once more up "
                         "to that op):")
        if fwd:
            forward_rows = _input_rows(op_base(c["forward_op"]), fwd, notes)
        else:
            forward_title = f"The inputs of the forward op {c['forward_op']} could not be looked up again."
    out = c.get("output") or {}
    output = [Fact("elements", num(out.get("numel"))),
              Fact("NaN", num(out.get("nan")), tone="bad" if out.get("nan") else ""),
              Fact("+Inf", num(out.get("posinf")), tone="bad" if out.get("posinf") else ""),
              Fact("−Inf", num(out.get("neginf")), tone="bad" if out.get("neginf") else "")]
    low = sorted({s.get("dtype") for s in c.get("inputs") or []} & {"float16", "bfloat16"})
    if low and c.get("kind") == "inf":
        notes.append(", ".join(f"{t} holds at most {num(dtype_max(t), 5)}" for t in low) +
                     ": a result beyond that becomes Inf even when every input is modest.")
    scalars = ", ".join(str(x) if isinstance(x, bool) or not isinstance(x, (int, float, str)) else num(x)
                        for x in c.get("scalars") or [])
    cols = ["", "shape", "dtype", "min", "max", "smallest |x| ≠ 0", "zeros", "negatives", "NaN", "Inf"]
    return StatsView(cols, rows, output, bool(out.get("nan") or out.get("posinf") or out.get("neginf")), scalars,
                     notes, forward_title, forward_rows)


# ------------------------------------------------------------------ gradients and shapes


@dataclass
class GradTable:
    rows: list[list[Cell]]
    total: int
    omitted: int
    nonfinite: int
    no_grad: int
    zero: int
    failing: str = ""  # the parameter the verdict names (its gradient is the failure): first, highlighted
    classes: list[str] | None = None  # per row: "failing" for that parameter's row


def _finite_stat(g: dict, key: str) -> object:
    """A statistic over the gradient's finite values (older JSON without `finite_*`: over all of them)."""
    if f"finite_{key}" in g:
        return g[f"finite_{key}"]
    return g.get(key)


def gradient_table(d: dict) -> GradTable | None:
    """The per-parameter walk as a table: the failing parameter first, then worst first.

    Mean, std and max |g| are over each gradient's finite values, so a gradient that is
    partly NaN still shows what the rest looks like; how much of it is non-finite has its
    own column. (Plain Python: a report must not pay for importing pandas to sort a list.)
    """
    grads = [g for g in d.get("gradients") or [] if isinstance(g, dict)]
    if not grads:
        return None
    fail = d.get("failure") or {}
    failing = str(fail.get("name")) if fail.get("what") == "gradient" else ""
    table = []
    for g in grads:
        numel_v = g.get("numel")
        r = _GradRow(name=g.get("name"), shape=g.get("shape"), has_grad=bool(g.get("has_grad")),
                     mean=_finite_stat(g, "mean"), std=_finite_stat(g, "std"), max_abs=_finite_stat(g, "max_abs"),
                     nan=_count(g.get("nan")), inf=_count(g.get("inf")), finite=g.get("finite"),
                     size=_count(numel_v if isinstance(numel_v, int) else numel(g.get("shape"))))
        r.bad = r.nan + r.inf
        r.frac = r.bad / r.size if r.size else (1.0 if r.bad else 0.0)
        mx = to_float(r.max_abs)
        r.max_f = -1.0 if mx is None or math.isnan(mx) else mx
        r.zero = r.has_grad and r.max_f == 0.0 and r.bad == 0
        r.rank = (4 if r.name == failing else 3 if r.bad > 0 else 2 if not r.has_grad
                  else 1 if r.zero else 0)
        table.append(r)
    table.sort(key=lambda r: (r.name is None, str(r.name)))
    table.sort(key=lambda r: (r.rank, r.frac, r.bad, r.max_f), reverse=True)  # stable: names break ties
    total = len(table)
    shown = table[:MAX_TABLE_ROWS]
    rows, classes = [], []
    for r in shown:
        shape = Cell(fmt_shape(r.shape), sort=str(int(r.size)), title=f"{int(r.size):,} elements")
        if not r.has_grad:
            status = Cell("NO GRADIENT", bad=False, sort="2")
            frac = Cell("—", sort="-1")
            stats = [Cell("—", sort="-Infinity") for _ in range(3)]
        else:
            label = ("NaN + Inf" if r.nan and r.inf else "NaN" if r.nan else "Inf" if r.inf
                     else "all zero" if r.zero else "finite")
            status = Cell(label, bad=bool(r.bad), sort={4: "4", 3: "3", 1: "1"}.get(int(r.rank), "0"))
            if r.bad:
                pct = 100.0 * r.frac
                frac = Cell("all" if r.bad == r.size else f"{pct:.3g}%", bad=True, sort=repr(r.frac),
                            title=f"{int(r.bad):,} of {int(r.size):,} elements NaN or Inf")
            else:
                frac = Cell("0", sort="0")
            mean, std, mx = (None if isinstance(x, float) and math.isnan(x) else x for x in (r.mean, r.std, r.max_abs))
            none = "no finite value" if r.bad and r.bad >= r.size else ""
            one = r.size < 2 or (isinstance(r.finite, (int, float)) and not math.isnan(r.finite) and r.finite < 2)
            stats = [Cell(num(mean), sort=sort_key(mean), title=none),
                     Cell("—" if one else num(std), sort=sort_key(None if one else std),
                          title="a std needs two finite values" if one else ""),
                     Cell(num(mx), sort=sort_key(mx), title=none)]
        rows.append([Cell(str(r.name)), shape, status, frac, *stats,
                     Cell(num(int(r.nan)), bad=bool(r.nan), sort=str(int(r.nan))),
                     Cell(num(int(r.inf)), bad=bool(r.inf), sort=str(int(r.inf)))])
        classes.append("failing" if failing and r.name == failing else "")
    return GradTable(rows, total, total - len(shown), sum(r.bad > 0 for r in table),
                     sum(not r.has_grad for r in table), sum(r.zero for r in table),
                     failing=failing if any(r.name == failing for r in table) else "",
                     classes=classes)


@dataclass
class _GradRow:
    name: object
    shape: object
    has_grad: bool
    mean: object
    std: object
    max_abs: object
    nan: int
    inf: int
    finite: object
    size: int
    bad: int = 0
    frac: float = 0.0
    max_f: float = -1.0
    zero: bool = False
    rank: int = 0


def _count(v: object) -> int:
    """A count from the JSON (a number, or text that reads as one); anything else is 0."""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v
    try:
        f = float(v) if isinstance(v, (float, str)) else math.nan
    except ValueError:
        return 0
    return int(f) if math.isfinite(f) else 0


@dataclass
class ShapeTable:
    rows: list[list[Cell]]
    total: int
    mismatches: int
    no_grad: int
    omitted: int


def shape_table(d: dict) -> ShapeTable | None:
    rows_in = d.get("gradient_shapes") or []
    if not rows_in:
        return None
    model_class = (d.get("model") or {}).get("class")
    seen: dict[str, int] = {}
    rows = []
    for r in rows_in:
        m = r.get("module")
        seen[m] = seen.get(m, 0) + 1
        label = module_label(m, model_class) + (f" (call {seen[m]})" if seen[m] > 1 else "")
        if r.get("grad_shape") is None:
            status, bad, rank = "no gradient reached this output", False, 1
        elif r.get("mismatch"):
            status, bad, rank = "MISMATCH", True, 2
        else:
            status, bad, rank = "ok", False, 0
        rows.append((rank, [Cell(label), Cell(fmt_shape(r.get("output_shape"))),
                            Cell(fmt_shape(r.get("grad_shape")), bad=bad), Cell(status, bad=bad)]))
    mism = sum(1 for rank, _ in rows if rank == 2)
    nog = sum(1 for rank, _ in rows if rank == 1)
    ordered = sorted(rows, key=lambda t: -t[0])  # stable: flagged rows first, call order within
    kept = [cells for _, cells in ordered[:MAX_TABLE_ROWS]]
    return ShapeTable(kept, len(rows), mism, nog, len(rows) - len(kept))


# ------------------------------------------------------------------ leaves


@dataclass
class LeavesTable:
    rows: list[list[Cell]]
    note: str


def leaves_table(d: dict) -> LeavesTable | None:
    leaves = d.get("nonfinite_leaves") or []
    if not leaves:
        return None
    rows = []
    for r in leaves:
        samples = r.get("samples") or []
        role = str(r.get("role")) + (" (intentional constant, e.g. a mask: ignored)" if r.get("literal") else "")
        rows.append([Cell(str(r.get("name"))), Cell(role), Cell(fmt_shape(r.get("shape"))),
                     Cell(num(r.get("nan")), bad=bool(r.get("nan"))), Cell(num(r.get("inf")), bad=bool(r.get("inf"))),
                     Cell(", ".join(map(str, samples[:20])) + (" …" if len(samples) > 20 else "") if samples else "—")])
    note = ""
    if d["verdict"] == "culprit_found":
        note = "Buffers holding ±Inf and no NaN are treated as intentional constants (attention masks)."
    return LeavesTable(rows, note)
