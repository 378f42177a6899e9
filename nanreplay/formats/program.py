"""The step program: a training step's forward and loss as data nanreplay defines and validates.

A program is the straight-line list of aten ops one step actually executed (recorded on
real tensors by `capture/program.py`), stored as strict JSON next to the snapshot's tensors:

    {"schema": "nanreplay.step/1",
     "leaves":  [{"ref": 0, "kind": "param", "name": "fc1.weight", "shape": [8, 4], "dtype": "float32"}, ...],
                                      # a constant made in autocast's dtype taken from a tensor: "cast": true
     "nodes":   [{"op": "aten.addmm.default", "args": [{"r": 2}, {"r": 3}, {"r": 0}], "kwargs": {},
                  "out": 7, "meta": [[[16, 8], "float32"]], "module": 1, "frame": 0, "call": 3}, ...],
     "loss": 42,                      # the ref of the scalar loss
     "modules": ["", "fc1", ...],     # qualified module names ("" the model itself, "<loss>" the loss)
     "scopes": [[1, -1], ...],        # module calls: [module index, enclosing call or -1]; nodes say "scope"
     "frames": [{"file", "line", "function", "code", "context"}, ...],
     "calls": ["", "F.linear", ...]}  # torch-level call names, by call number

Arguments are a closed grammar of literals: null, booleans, integers, finite floats,
`{"f": "inf" | "-inf" | "nan"}`, `{"c": [re, im]}` (a complex scalar), `{"r": ref}` (a tensor),
`{"dtype": ...}`, `{"device": ...}`, `{"layout": ...}`, `{"memory_format": ...}`, lists of these, and strings only where a rule
for that (op, argument) exists. Node flags: `"grad": false` (ran under no_grad), `"cast": true`
(its dtype literal is autocast's dtype: a cast autocast inserted, or a dtype taken from a tensor
autocast made, `torch.zeros(..., dtype=q.dtype)`; replays in other dtypes map it as autocast's),
`"random": "<constant>"` (a random op: its recorded value replaces
it), `"mask": "<constant>"` (native_dropout: output = input * mask * scale), `"view": [strides, offset]`
(a `take` that stands for an `as_strided`: the replay makes the view eager made, once its index is that view's).

Nothing here reaches pickle, eval or an import: `decode()` validates every name, type,
reference and shape before anything is built, and `dry_run()` recomputes every shape on
the meta device and bounds the replay's memory before a byte is allocated.
See docs/snapshot-format.md.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from nanreplay import torch_internals as ti
from nanreplay.errors import SnapshotError
from nanreplay.formats.ops import ALLOWED_OPS, STRING_ARGS

SCHEMA = "nanreplay.step/1"
LEAF_KINDS = ("param", "buffer", "batch", "constant")

MAX_NODES = 2_000_000
MAX_TEXT = 400  # longest code line / file name / function name kept
MAX_CONTEXT = 15  # lines of source context per frame
MAX_NAME = 1000

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in (
        "float16", "bfloat16", "float32", "float64", "uint8", "int8", "int16", "int32", "int64", "bool",
        "complex64", "complex128", "float8_e4m3fn", "float8_e5m2")
    if isinstance(getattr(torch, name, None), torch.dtype)
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
LAYOUTS = {"strided": torch.strided}
MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "preserve_format": torch.preserve_format,
                  "channels_last": torch.channels_last, "channels_last_3d": torch.channels_last_3d}
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu", "meta")


def dtype_name(d: torch.dtype) -> str:
    return DTYPE_NAMES[d]


# ------------------------------------------------------------------ the decoded program


@dataclass(slots=True)
class Node:
    op: Any  # the OpOverload
    name: str  # "aten.addmm.default"
    args: list
    kwargs: dict
    out: Any  # ref, list of refs/None, or None
    meta: list  # [(shape, dtype name)] per output ref, in flat order
    module: int = 0
    scope: int | None = None  # the module call running it
    frame: int | None = None
    call: int = 0
    grad: bool = True
    cast: bool = False  # its dtype literal is autocast's dtype (a cast autocast inserted, or a dtype that follows one)
    random: str | None = None  # constant that replaces a random op's output
    mask: str | None = None  # native_dropout's mask
    view: tuple | None = None  # (strides, offset): a take that stands for an as_strided (`strided_index`)


@dataclass
class Leaf:
    ref: int
    kind: str  # param | buffer | batch | constant
    name: str
    shape: list[int]
    dtype: str
    path: list | None = None  # batch: the keys from the batch's root to this tensor
    cast: bool = False  # a constant in autocast's dtype that follows a tensor's (replays map it as autocast's)


@dataclass
class Program:
    leaves: list[Leaf]
    nodes: list[Node]
    loss: int
    modules: list[str]
    scopes: list[tuple[int, int]]
    frames: list[dict]
    calls: list[str]
    notes: list[str] = field(default_factory=list)  # what the capture side wants the analysis to say

    def dead_after(self) -> list[list[int]]:
        """For each node, the refs no later node reads (the replay drops them there, as eager Python drops
        intermediates: a program's replay holds no more memory than the step did). Computed once."""
        cached = self.__dict__.get("_dead_after")
        if cached is not None:
            return cached
        last: dict[int, int] = {}
        for i, node in enumerate(self.nodes):
            for r in node_inputs(node):
                last[r] = i
            for r in node_outputs(node):
                last.setdefault(r, i)  # made and never read: dropped right away
        dead: list[list[int]] = [[] for _ in self.nodes]
        for r, i in last.items():
            if r != self.loss:
                dead[i].append(r)
        self.__dict__["_dead_after"] = dead
        return dead

    def scopes_of(self, node: Node) -> tuple[tuple[str, str], ...]:
        """The module calls a node ran inside, outermost first, as (call key, module name)."""
        out = []
        s = node.scope
        while s is not None and s >= 0:
            m, parent = self.scopes[s]
            out.append((f"s{s}", self.modules[m]))
            s = parent
        if not out:
            name = self.modules[node.module]
            return ((name, name),) if name == "<loss>" else ()
        return tuple(reversed(out))


def refs_in(v: Any) -> list[int]:
    """The refs in an argument value (a Ref, or nested lists of values)."""
    if isinstance(v, Ref):
        return [int(v)]
    if isinstance(v, list):
        return [r for e in v for r in refs_in(e)]
    return []


def node_inputs(node: Node) -> list[int]:
    """The refs a node reads, positional arguments first."""
    return refs_in(node.args) + refs_in(list(node.kwargs.values()))


def node_outputs(node: Node) -> list[int]:
    """The refs a node makes (None outputs left out)."""
    return [r for r in _flat(node.out) if r is not None]


def _flat(out: Any) -> list:
    if isinstance(out, list):
        return list(out)
    return [out]


# ------------------------------------------------------------------ encoding (capture side)


def encode_float(x: float) -> Any:
    if math.isfinite(x):
        return x
    return {"f": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}


def to_json(program: dict) -> str:
    """Strict JSON: no NaN/Infinity tokens (non-finite floats are {"f": ...} objects)."""
    return json.dumps(program, allow_nan=False, separators=(",", ":"))


# ------------------------------------------------------------------ decoding (analysis side)


class _Invalid(Exception):
    pass


def _reject_constant(name: str) -> Any:
    raise _Invalid(f"non-standard JSON token {name}")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    d = {}
    for k, v in pairs:
        if k in d:
            raise _Invalid(f"duplicate key {k!r}")
        d[k] = v
    return d


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):  # 1e400: a number no JSON writer of finite floats makes
        raise _Invalid(f"the number {text[:40]} is out of range")
    return x


def parse_json(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_no_duplicates,
                          parse_float=_finite_float)
    except _Invalid:
        raise
    except (ValueError, RecursionError) as e:
        raise _Invalid(f"not valid JSON ({type(e).__name__})") from None


def _int(v: Any, what: str, lo: int = 0, hi: int = 2**62) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise _Invalid(f"{what} must be an integer in [{lo}, {hi}]")
    return v


def _str(v: Any, what: str, limit: int = MAX_NAME) -> str:
    if not isinstance(v, str) or len(v) > limit:
        raise _Invalid(f"{what} must be a string of at most {limit} characters")
    if _SURROGATE.search(v):
        raise _Invalid(f"{what} is not valid Unicode (it holds a lone surrogate)")
    return v


_SURROGATE = re.compile("[\ud800-\udfff]")


def _shape(v: Any, what: str) -> list[int]:
    if not isinstance(v, list) or len(v) > 16:
        raise _Invalid(f"{what} must be a list of at most 16 sizes")
    return [_int(s, what, 0, 2**40) for s in v]


def _dtype(v: Any, what: str) -> str:
    if v not in DTYPES:
        raise _Invalid(f"{what}: unknown dtype {str(v)[:40]!r}")
    return v


def decode(text: str) -> Program:
    """Parse and validate a step program; every violation is one line naming where it is."""
    try:
        return _decode(parse_json(text) if isinstance(text, str) else _fail("the step program is not text"))
    except _Invalid as e:
        raise SnapshotError(f"invalid step program: {e}") from None


def _fail(msg: str):
    raise _Invalid(msg)


def _decode(d: Any) -> Program:
    if not isinstance(d, dict):
        raise _Invalid("not a JSON object")
    if d.get("schema") != SCHEMA:
        raise _Invalid(f"schema {str(d.get('schema'))[:60]!r}, expected {SCHEMA!r}")
    unknown = set(d) - {"schema", "leaves", "nodes", "loss", "modules", "scopes", "frames", "calls", "notes"}
    if unknown:
        raise _Invalid(f"unknown top-level keys {sorted(unknown)[:5]}")
    modules = [_str(m, f"modules[{i}]") for i, m in enumerate(_list(d.get("modules"), "modules"))]
    calls = [_str(c, f"calls[{i}]", 200) for i, c in enumerate(_list(d.get("calls"), "calls"))]
    scopes = []
    for i, sc in enumerate(_list(d.get("scopes", []), "scopes")):
        if not (isinstance(sc, list) and len(sc) == 2):
            raise _Invalid(f"scopes[{i}] must be [module, parent]")
        scopes.append((_int(sc[0], f"scopes[{i}]", 0, max(len(modules) - 1, 0)), _int(sc[1], f"scopes[{i}]", -1, i - 1)))
    frames = [check_frame(f, i) for i, f in enumerate(_list(d.get("frames"), "frames"))]
    notes = [_str(n, "notes", 2000) for n in _list(d.get("notes", []), "notes")][:20]
    defined: set[int] = set()
    leaves = []
    for i, lf in enumerate(_list(d.get("leaves"), "leaves")):
        leaves.append(_leaf(lf, i, defined))
    nodes_raw = _list(d.get("nodes"), "nodes")
    if len(nodes_raw) > MAX_NODES:
        raise _Invalid(f"{len(nodes_raw)} nodes, more than the limit {MAX_NODES}")
    nodes = [_node(n, i, defined, len(modules), len(scopes), len(frames), len(calls)) for i, n in enumerate(nodes_raw)]
    loss = _int(d.get("loss"), "loss")
    if loss not in defined:
        raise _Invalid(f"loss refers to undefined ref {loss}")
    return Program(leaves, nodes, loss, modules, scopes, frames, calls, notes)


def _list(v: Any, what: str) -> list:
    if not isinstance(v, list):
        raise _Invalid(f"{what} must be a list")
    return v


def check_frame(f: Any, i: int, what: str | None = None) -> dict:
    """One recorded source frame checked (also a snapshot's `entry`, outside a program: `what` names it)."""
    what = what or f"frames[{i}]"
    if not isinstance(f, dict) or set(f) - {"file", "line", "function", "code", "context"}:
        raise _Invalid(f"{what} must be an object with file, line, function, code, context")
    out = {"file": _str(f.get("file"), f"{what}.file"), "line": _int(f.get("line"), f"{what}.line", 1, 10**7),
           "function": _str(f.get("function") or "", f"{what}.function", MAX_TEXT),
           "code": _str(f["code"], f"{what}.code", 10 * MAX_TEXT) if f.get("code") is not None else None}
    ctx = f.get("context")
    if ctx is not None:
        if not (isinstance(ctx, list) and len(ctx) == 2):
            raise _Invalid(f"{what}.context must be [first line, [lines]]")
        start = _int(ctx[0], f"{what}.context", 1, 10**7)
        lines = [_str(ln, f"{what}.context", 10 * MAX_TEXT) for ln in _list(ctx[1], f"{what}.context")]
        if len(lines) > 2 * MAX_CONTEXT + 1:
            raise _Invalid(f"{what}.context holds more than {2 * MAX_CONTEXT + 1} lines")
        if not start <= out["line"] < start + len(lines):
            raise _Invalid(f"{what}.context does not hold the frame's line {out['line']}")
        out["context"] = (start, lines)
    else:
        out["context"] = None
    return out


def _leaf(lf: Any, i: int, defined: set[int]) -> Leaf:
    what = f"leaves[{i}]"
    if not isinstance(lf, dict) or set(lf) - {"ref", "kind", "name", "shape", "dtype", "path", "cast"}:
        raise _Invalid(f"{what} must be an object with ref, kind, name, shape, dtype (and path, cast)")
    cast = lf.get("cast", False)
    if not isinstance(cast, bool) or (cast and lf.get("kind") != "constant"):
        raise _Invalid(f"{what}.cast must be true or false, and true only for a constant")
    ref = _int(lf.get("ref"), f"{what}.ref")
    if ref in defined:
        raise _Invalid(f"{what}: ref {ref} is defined twice")
    kind = lf.get("kind")
    if kind not in LEAF_KINDS:
        raise _Invalid(f"{what}.kind must be one of {LEAF_KINDS}")
    path = lf.get("path")
    if path is not None:
        key = lambda p: isinstance(p, (str, int)) and not isinstance(p, bool)  # noqa: E731
        path = [tuple(p) if isinstance(p, list) else p for p in _list(path, f"{what}.path")]  # a tuple key
        if len(path) > 16 or not all(key(p) or (type(p) is tuple and 0 < len(p) <= 8 and all(map(key, p))) for p in path):
            raise _Invalid(f"{what}.path must be a short list of keys and indices (or of short lists of keys)")
    defined.add(ref)
    return Leaf(ref, kind, _str(lf.get("name"), f"{what}.name"), _shape(lf.get("shape"), f"{what}.shape"),
                _dtype(lf.get("dtype"), f"{what}.dtype"), path, cast)


_NODE_KEYS = {"op", "args", "kwargs", "out", "meta", "module", "scope", "frame", "call", "grad", "cast", "random",
              "mask", "view"}


def _node(n: Any, i: int, defined: set[int], n_modules: int, n_scopes: int, n_frames: int, n_calls: int) -> Node:
    what = f"node {i}"
    if not isinstance(n, dict) or set(n) - _NODE_KEYS:
        extra = sorted(set(n) - _NODE_KEYS)[:3] if isinstance(n, dict) else None
        raise _Invalid(f"{what}: not a node object" + (f" (unknown keys {extra})" if extra else ""))
    name = n.get("op")
    if not isinstance(name, str) or name not in ALLOWED_OPS:
        raise _Invalid(f"{what}: op {str(name)[:80]!r} is not on the allowlist of pure tensor ops")
    what = f"node {i} ({name})"
    op = resolve_op(name)
    schema = ti.op_schema(op)
    if schema is None:
        raise _Invalid(f"{what}: this torch has no schema for the op")
    args = _list(n.get("args", []), f"{what} args")
    kwargs = n.get("kwargs", {})
    if not isinstance(kwargs, dict):
        raise _Invalid(f"{what}: kwargs must be an object")
    dec_args, dec_kwargs = _check_call(schema, name, args, kwargs, defined, what)
    out = n.get("out")
    refs = _flat(out)
    meta = _list(n.get("meta", []), f"{what} meta")
    real = [r for r in refs if r is not None]
    if len(meta) != len(real):
        raise _Invalid(f"{what}: meta must describe each of its {len(real)} outputs")
    checked_meta = []
    for j, m in enumerate(meta):
        if not (isinstance(m, list) and len(m) == 2):
            raise _Invalid(f"{what}: meta[{j}] must be [shape, dtype]")
        checked_meta.append((_shape(m[0], f"{what} meta"), _dtype(m[1], f"{what} meta")))
    for r in real:
        _int(r, f"{what} out")
        if r in defined:
            raise _Invalid(f"{what}: output ref {r} is defined twice")
        defined.add(r)
    module = _int(n.get("module", 0), f"{what} module", 0, max(n_modules - 1, 0))
    scope = n.get("scope")
    if scope is not None:
        scope = _int(scope, f"{what} scope", 0, n_scopes - 1)
    frame = n.get("frame")
    if frame is not None:
        frame = _int(frame, f"{what} frame", 0, max(n_frames - 1, 0))
        if n_frames == 0:
            raise _Invalid(f"{what}: frame given but the frame table is empty")
    call = _int(n.get("call", 0), f"{what} call", 0, max(n_calls - 1, 0))
    flags = {}
    for key in ("grad", "cast"):
        if key in n and not isinstance(n[key], bool):
            raise _Invalid(f"{what}: {key} must be true or false")
        flags[key] = n.get(key, key == "grad")
    random = n.get("random")
    mask = n.get("mask")
    draws = is_random_call(op, dec_args, dec_kwargs)
    if random is not None:
        random = _str(random, f"{what} random")
        if not draws or name == DROPOUT:
            raise _Invalid(f"{what}: only random ops can be replaced by a recorded value")
    if mask is not None:
        mask = _str(mask, f"{what} mask")
        if name != DROPOUT:
            raise _Invalid(f"{what}: a dropout mask belongs only to {DROPOUT}")
    if draws and random is None and mask is None:
        raise _Invalid(f"{what}: a random op must carry its recorded value")
    view = n.get("view")
    if view is not None:
        if name != TAKE or len(dec_args) != 2 or not (isinstance(view, list) and len(view) == 2 and isinstance(view[0], list)
                                and len(view[0]) == len(checked_meta[0][0])):
            raise _Invalid(f"{what}: view is [strides, offset] of a take's output, one stride per dimension")
        view = (tuple(_int(s, f"{what} view stride") for s in view[0]), _int(view[1], f"{what} view offset"))
    return Node(op, name, dec_args, dec_kwargs, out, checked_meta, module, scope, frame, call, flags["grad"],
                flags["cast"], random, mask, view)


TAKE = "aten.take.default"


def strided_index(size: list[int], stride: list[int] | tuple, offset: int, device=None) -> torch.Tensor:
    """The flat indices as_strided(size, stride, offset) reads from a dense tensor: the take that records it."""
    index = torch.full(list(size), offset, dtype=torch.int64, device=device)
    for d, (n, st) in enumerate(zip(size, stride, strict=True)):
        index += (torch.arange(n, dtype=torch.int64, device=device) * st).view([n if i == d else 1 for i in range(len(size))])
    return index


DROPOUT = "aten.native_dropout.default"


def is_random_call(op, args: list | tuple, kwargs: dict) -> bool:
    """Does this call draw random numbers? Random-tagged attention kernels with dropout_p == 0 do not."""
    if not ti.is_random_op(op):
        return False
    schema = ti.op_schema(op)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "dropout_p" in names:
        i = names.index("dropout_p")
        p = kwargs.get("dropout_p", args[i] if i < len(args) else 0.0)
        return bool(p)
    return True


def resolve_op(name: str):
    """'aten.add.Tensor' -> torch.ops.aten.add.Tensor, for allowlisted names only."""
    if name not in ALLOWED_OPS:
        raise _Invalid(f"op {name[:80]!r} is not on the allowlist")
    _, packet, overload = name.split(".")
    try:
        return getattr(getattr(torch.ops.aten, packet), overload)
    except AttributeError:
        raise _Invalid(f"op {name!r} does not exist in this torch ({torch.__version__})") from None


# ---- argument type checks against the op's own schema


def _check_call(schema, op_name: str, args: list, kwargs: dict, defined: set[int], what: str) -> tuple[list, dict]:
    params = list(schema.arguments)
    if len(args) > len(params):
        raise _Invalid(f"{what}: {len(args)} arguments, the op takes at most {len(params)}")
    by_name = {a.name: a for a in params}
    out_args, out_kwargs = [], {}
    for a, v in zip(params, args, strict=False):
        if a.kwarg_only:
            raise _Invalid(f"{what}: argument {a.name} is keyword-only")
        out_args.append(_check_value(v, _type(a), op_name, a.name, defined, what))
    for k, v in kwargs.items():
        a = by_name.get(k)
        if a is None:
            raise _Invalid(f"{what}: the op has no argument {str(k)[:40]!r}")
        out_kwargs[k] = _check_value(v, _type(a), op_name, k, defined, what)
    for a in params[len(args):]:
        if a.name not in kwargs and not a.has_default_value() and not _optional(_type(a)):
            raise _Invalid(f"{what}: missing argument {a.name}")
    return out_args, out_kwargs


def _type(a):
    """The argument's declared type (ScalarType, Layout, MemoryFormat — not the int they lower to)."""
    return getattr(a, "real_type", a.type)


def _optional(t) -> bool:
    return t.kind() == "OptionalType"


_FLOAT_WORDS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
_EINSUM = re.compile(r"^[a-zA-Z.,\->\s]{1,128}$")


def _check_value(v: Any, t, op_name: str, arg: str, defined: set[int], what: str) -> Any:
    """A decoded argument value of schema type `t`, or _Invalid."""
    kind = t.kind()
    if v is None:
        if kind in ("OptionalType", "NoneType"):
            return None
        raise _Invalid(f"{what}: argument {arg} may not be null")
    if kind == "OptionalType":
        return _check_value(v, t.getElementType(), op_name, arg, defined, what)
    if kind == "TensorType":
        if isinstance(v, dict) and "r" in v:
            return _tensor_ref(v, arg, defined, what)
        return _number(v, arg, what, allow_int=True)  # a Python scalar the op wraps (x * 0.5)
    if kind == "ListType":
        if not isinstance(v, list) or len(v) > 100_000:
            raise _Invalid(f"{what}: argument {arg} must be a list")
        el = t.getElementType()
        return [_check_value(x, el, op_name, arg, defined, what) for x in v]
    if kind == "BoolType":
        if not isinstance(v, bool):
            raise _Invalid(f"{what}: argument {arg} must be true or false")
        return v
    if kind in ("IntType", "SymIntType"):
        # int64, as aten takes it: `x[1:]` records its open end as 2**63 - 1
        if not isinstance(v, int) or isinstance(v, bool) or not -(2**63) <= v < 2**63:
            raise _Invalid(f"{what}: argument {arg} must be an integer")
        return v
    if kind in ("FloatType", "NumberType", "SymFloatType"):
        return _number(v, arg, what, allow_int=True)
    if kind == "ScalarTypeType":
        if not (isinstance(v, dict) and set(v) == {"dtype"}):
            raise _Invalid(f"{what}: argument {arg} must be a dtype")
        return DTYPES[_dtype(v["dtype"], f"{what} {arg}")]
    if kind == "DeviceObjType":
        if not (isinstance(v, dict) and set(v) == {"device"} and v["device"] in DEVICE_TYPES):
            raise _Invalid(f"{what}: argument {arg} must be a device ({', '.join(DEVICE_TYPES)})")
        return DeviceLiteral(v["device"])
    if kind == "LayoutType":
        if not (isinstance(v, dict) and set(v) == {"layout"} and v["layout"] in LAYOUTS):
            raise _Invalid(f"{what}: argument {arg} must be a layout")
        return LAYOUTS[v["layout"]]
    if kind == "MemoryFormatType":
        if not (isinstance(v, dict) and set(v) == {"memory_format"} and v["memory_format"] in MEMORY_FORMATS):
            raise _Invalid(f"{what}: argument {arg} must be a memory format")
        return MEMORY_FORMATS[v["memory_format"]]
    if kind == "StringType":
        rule = STRING_ARGS.get((op_name.split(".")[1], arg))
        if rule is None:
            raise _Invalid(f"{what}: argument {arg} may not be a string")
        if not isinstance(v, str) or not (v in rule if isinstance(rule, frozenset) else rule.fullmatch(v)):
            raise _Invalid(f"{what}: argument {arg} has a value that is not allowed")
        return v
    raise _Invalid(f"{what}: argument {arg} has type {t}, which a step program may not carry")


def _tensor_ref(v: Any, arg: str, defined: set[int], what: str) -> Ref:
    if not (isinstance(v, dict) and set(v) == {"r"}):
        raise _Invalid(f"{what}: argument {arg} must be a tensor reference")
    r = _int(v["r"], f"{what} {arg}")
    if r not in defined:
        raise _Invalid(f"{what}: argument {arg} uses ref {r} before it is defined")
    return Ref(r)


def _number(v: Any, arg: str, what: str, allow_int: bool) -> float | int:
    if isinstance(v, bool):
        return v  # a Scalar may be a bool
    if isinstance(v, int) and allow_int:
        if abs(v) > 2**63:
            raise _Invalid(f"{what}: argument {arg} is out of range")
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            raise _Invalid(f"{what}: argument {arg} is not a finite number")
        return v
    if isinstance(v, dict) and set(v) == {"f"} and v["f"] in _FLOAT_WORDS:
        return _FLOAT_WORDS[v["f"]]
    if isinstance(v, dict) and set(v) == {"c"} and isinstance(v["c"], list) and len(v["c"]) == 2:
        # a complex scalar (`z * 1j`): its real and imaginary parts, each a float literal
        re_, im_ = (_number(x, arg, what, allow_int=False) for x in v["c"])
        if isinstance(re_, bool) or isinstance(im_, bool):
            raise _Invalid(f"{what}: argument {arg} must be a number")
        return complex(re_, im_)
    raise _Invalid(f"{what}: argument {arg} must be a number")


class Ref(int):
    """A decoded tensor reference (an int that knows it is one)."""

    __slots__ = ()


class DeviceLiteral(str):
    """A device type in the program; the replay maps it to the replay device."""

    __slots__ = ()
