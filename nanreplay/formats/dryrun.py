"""The dry run of a step program: every node on the meta device, before anything is allocated.

Each node's arguments pass the op's checks first (`formats/opchecks.py`: literals, and the values of index
tensors the snapshot stores), then its meta kernel recomputes the output shapes, which must be the ones
the file declares. The replay's peak memory is bounded as it goes, and the run stops at `max_memory`
*before* a node whose declared outputs would pass it: what a node makes is counted before it is made,
tensors as well as bytes (a step that unbinds a 10**7-row tensor is refused, not built). Ops whose output
size depends on data (`nonzero`, `masked_select`, `unique`...) are counted at the most their inputs allow,
not at what the file declares; the replay checks the rest (`repeat_interleave`) before the kernel runs.

Aliasing: leaves that are one tensor object in the snapshot (two batch entries, or a buffer and a parameter,
pickled as one) are one meta tensor here, so an in-place metadata change through one (`transpose_`,
`unsqueeze_`) changes the other in the dry run as it will in the replay. The shapes each node's tensor
arguments had here are kept (`checked_shapes`); the replay refuses a node whose arguments differ from them,
or a tensor argument whose view reaches past its storage, before its kernel runs (formats/stepmodel.py): a
kernel only ever runs on the shapes this validation checked.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nanreplay import torch_internals as ti
from nanreplay.confine import progress
from nanreplay.errors import LimitError, ReplayError, SnapshotError, kernel_message
from nanreplay.formats import derivchecks, opchecks  # noqa: F401 - derivchecks adds its checks to opchecks.RULES
from nanreplay.formats.ops import check_values
from nanreplay.formats.program import DTYPES, DeviceLiteral, Program, Ref
from nanreplay.limits import format_size, work_budget

TENSOR_BYTES = 1024  # what one tensor object costs beyond its data (Python object, sizes, autograd metadata)


def dry_run(program: Program, leaf_meta: dict[int, tuple[list[int], torch.dtype]], *,
            values: dict[int, torch.Tensor] | None = None, max_memory: int | None = None,
            same: dict[int, int] | None = None) -> int:
    """Every node on the meta device: arguments checked, shapes checked against the file, the replay's peak
    bytes bounded (returned). `values`: leaves whose values are known (the snapshot's stored index tensors).

    The bound: the inputs, plus every non-view output of the forward kept alive for backward, twice
    (backward's gradients of about the same sizes), plus one gradient per floating input, plus
    `TENSOR_BYTES` per tensor made. Past `max_memory`, LimitError before the node that would pass it.
    `same`: leaf ref -> the first leaf ref that is the same tensor object (`same_objects`).
    """
    env: dict[int, torch.Tensor] = {}
    known: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(meta leaf) -> (the meta leaf, its values)
    checked: list[tuple] = []
    program.__dict__["_checked_shapes"] = checked  # filled as the nodes pass: a refused program has no replay
    inputs = 0
    same = same or {}
    for ref, (shape, dtype) in leaf_meta.items():
        first = same.get(ref, ref)
        if first != ref and first in env:
            env[ref] = env[first]  # one object in the snapshot: one here (an in-place view change shows in both)
            continue
        env[ref] = torch.empty(shape, dtype=dtype, device="meta")
        inputs += _nbytes(shape, dtype) * (2 if dtype.is_floating_point or dtype.is_complex else 1) + TENSOR_BYTES
        if values is not None and ref in values:
            known[id(env[ref])] = (env[ref], values[ref])
    made = 0
    work, budget = 0, work_budget()
    dead = program.dead_after()
    total = len(program.nodes)
    for i, node in enumerate(program.nodes):
        progress.at(progress.DRY_RUN, i, node.name, total)  # a crash in a meta kernel below is then named (confine/)
        what = f"node {i} ({node.name})"
        args = [_meta_arg(a, env) for a in node.args]
        kwargs = with_output_size(node, {k: _meta_arg(v, env) for k, v in node.kwargs.items()})
        checked.append(arg_shapes(args, kwargs))
        try:
            opchecks.check(node.op, node.name.split(".")[1], args, kwargs, lambda t: _known(known, t))
        except opchecks.Refused as e:
            raise SnapshotError(f"invalid step program: {what}: {e}") from None
        refused = check_values(node.op, node.name, args, kwargs)  # formats/ops.py's value rules (CTC, weight norm)
        if refused:
            raise SnapshotError(f"invalid step program: {what}: {refused}")
        view = ti.op_is_view(node.op)
        declared = sum(_nbytes(s, DTYPES[d]) for s, d in node.meta)
        named = by_position(node.op, args, kwargs)  # a tensor given by keyword counts as one given by position
        upper = _data_dependent_bytes(node.name, named)
        if budget is not None and not view:
            work += node_work(node.name, named, node.meta)
            if work > budget:
                raise LimitError(f"replaying this step needs about {work:.2g} element operations by {what} (counted "
                                 f"from the step program's shapes before anything runs), more than --timeout allows "
                                 f"({budget:.2g}); raise --timeout, or --timeout 0 for no limit")
        copies = 0 if view else _expanded_bytes(args, kwargs)  # a kernel's own contiguous copy of an expanded view
        need = inputs + 2 * (made + (0 if view else max(declared, upper or 0))) + copies + TENSOR_BYTES * len(node.meta)
        if max_memory is not None and need > max_memory:
            raise LimitError(f"replaying this step needs about {format_size(need)} by {what} (bounded from the "
                             f"step program's shapes before it is built), more than --max-memory "
                             f"{format_size(max_memory)}; raise the limit if this machine has the memory")
        if _takes_device(node.op):  # a factory op without a device would allocate on the CPU for real
            kwargs["device"] = torch.device("meta")
            names = _arg_names(node.op)
            if "device" in names and names.index("device") < len(args):
                args[names.index("device")] = torch.device("meta")
        out = None
        if node.random is None and node.mask is None:
            try:
                with torch.no_grad():
                    out = node.op(*args, **kwargs)
            except (NotImplementedError, RuntimeError, TypeError, ValueError, IndexError) as e:
                out = _meta_retry(node, args, kwargs, e)
                if out is not None:
                    pass
                elif upper is not None or _is_missing_meta(e) or node.name in _META_STRICTER:
                    out = None  # no meta kernel: declared shapes (data-dependent ones counted at their most)
                elif isinstance(e, RecursionError):  # a RuntimeError, but torch's own state, not the shapes
                    raise ReplayError(f"the dry run of {what} hit a RecursionError inside torch: that says nothing "
                                      "about the snapshot (a damaged torch install, or a nanreplay bug: please "
                                      "report it)") from None
                else:
                    raise SnapshotError(f"invalid step program: {what} cannot run on the declared shapes: "
                                        f"{kernel_message(e)}") from None
        refs = node.out if isinstance(node.out, list) else [node.out]
        outs = (list(out) if isinstance(out, (tuple, list)) else [out]) if out is not None else [None] * len(refs)
        if isinstance(out, (tuple, list)) and isinstance(node.out, list) and len(outs) != len(refs):
            raise SnapshotError(f"invalid step program: {what} makes {len(outs)} outputs, the file declares "
                                f"{len(refs)}")
        metas = iter(node.meta)
        for k, (r, t) in enumerate(zip(refs, outs, strict=False)):
            if r is None:
                continue
            shape, dname = next(metas)
            dtype = DTYPES[dname]
            nbytes = _nbytes(shape, dtype)
            if isinstance(t, torch.Tensor) and list(t.shape) != shape:
                if k == 0:
                    raise SnapshotError(f"invalid step program: {what} declares shape {shape}, "
                                        f"but the op makes {list(t.shape)}")
                # meta kernels may disagree on auxiliary outputs (workspaces): count the larger
                nbytes = max(nbytes, _nbytes(list(t.shape), t.dtype))
                t = None
            env[r] = t if isinstance(t, torch.Tensor) else torch.empty(shape, dtype=dtype, device="meta")
            if not view:
                made += nbytes
            made += TENSOR_BYTES // 2  # x2 below
        if upper is not None and not view:
            made += max(0, upper - declared)
        for r in dead[i]:
            env.pop(r, None)
    return inputs + 2 * made


def same_objects(leaves: dict[int, torch.Tensor]) -> dict[int, int]:
    """Leaf ref -> the first leaf ref that is the very same tensor object (torch.load keeps a pickled object's
    identity: a batch that names one tensor twice loads as one object)."""
    first: dict[int, int] = {}
    out = {}
    for ref, t in leaves.items():
        out[ref] = first.setdefault(id(t), ref)
    return {r: f for r, f in out.items() if r != f}


def arg_shapes(args: list, kwargs: dict) -> tuple:
    """The shapes of a call's tensor arguments (in lists too), in order: what the dry run checked."""
    return tuple(tuple(t.shape) for v in (*args, *kwargs.values())
                 for t in (v if isinstance(v, (list, tuple)) else (v,)) if isinstance(t, torch.Tensor))


def outside_storage(args: list, kwargs: dict) -> torch.Tensor | None:
    """A tensor argument whose view (offset, sizes, strides) reaches past the end of its storage, or None. (A
    contiguous tensor at offset 0 is as a kernel made it: storages are never resized by an allowed op.)"""
    for v in (*args, *kwargs.values()):
        for t in (v if isinstance(v, (list, tuple)) else (v,)):
            if not isinstance(t, torch.Tensor) or t.is_contiguous() and not t.storage_offset():
                continue
            if t.numel() and t.layout == torch.strided and t.device.type != "meta":
                last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
                if min(t.stride(), default=0) < 0 or (last + 1) * t.element_size() > t.untyped_storage().nbytes():
                    return t
    return None


_REPEAT = {"aten.repeat_interleave.Tensor", "aten.repeat_interleave.self_Tensor"}


def with_output_size(node, kwargs: dict) -> dict:
    """`repeat_interleave` by a tensor of repeats: its output size is the declared one (`output_size`), so the
    kernel allocates what the dry run bounded and checks the repeats add up to it (the replay does the same)."""
    if node.name not in _REPEAT or kwargs.get("output_size") is not None or not node.meta:
        return kwargs
    shape = node.meta[0][0]
    names = _arg_names(node.op)
    dim = kwargs.get("dim", node.args[names.index("dim")] if "dim" in names and names.index("dim") < len(node.args)
                     else None)
    d = 0 if dim is None or not shape else dim % len(shape)
    return {**kwargs, "output_size": shape[d] if shape else 0}


def _known(known: dict, t: Any) -> torch.Tensor | None:
    hit = known.get(id(t))
    return hit[1] if hit is not None and hit[0] is t else None  # (an id is reused once its tensor is gone)


# ---- what a node costs: work, and the copies its kernel makes


def _tensors(args: list, kwargs: dict | None = None):
    for v in [*args, *(kwargs or {}).values()]:
        for t in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(t, torch.Tensor):
                yield t


def node_work(name: str, args: list, meta: list) -> int:
    """Element operations one node costs, roughly: the elements of its tensor arguments (an expanded view counted
    at its full size: the kernel visits every element) and of its declared outputs, and for a matrix product,
    convolution or attention its multiply-adds, for a pooling its windows. `args` in the schema's order
    (`by_position`: a tensor given by keyword is counted in its place)."""
    touched = sum(t.numel() for t in _tensors(args)) + sum(math.prod(s) for s, _ in meta)
    out = math.prod(meta[0][0]) if meta else 0
    packet = name.split(".")[1] if "." in name else name
    ts = [t for t in args if isinstance(t, torch.Tensor)]
    if packet in _CONTRACT_LAST and ts:  # out[..., m, n] = sum over k: k is the last dim of the first matrix
        a = ts[1] if packet in ("addmm", "baddbmm", "addbmm", "addmv") and len(ts) > 1 else ts[0]
        k = a.shape[-1] if a.dim() else 1
        if packet == "addbmm" and a.dim() == 3:
            k *= a.shape[0]
        touched += out * k
    elif packet in _CONVOLUTION and len(ts) > 1:
        w = ts[1] if packet != "convolution_backward" else ts[2] if len(ts) > 2 else ts[1]
        touched += max(out, ts[0].numel()) * (w.numel() // max(w.shape[0], 1) if w.dim() else 1)
    elif packet == "einsum" and args and isinstance(args[0], str) and len(args) > 1:
        touched += _einsum_work(args[0], [t for t in args[1] if isinstance(t, torch.Tensor)]
                                if isinstance(args[1], (list, tuple)) else [])
    elif packet in _CUBIC and ts and ts[0].dim() >= 2:  # a factorisation or solve: n^3 per matrix, plus n^2 per rhs
        n = max(ts[0].shape[-1], ts[0].shape[-2])
        touched += ts[0].numel() * n + sum(t.numel() for t in ts[1:]) * n
    elif "attention" in packet and len(ts) >= 3:
        q, k = ts[0], ts[1]
        if q.dim() >= 2 and k.dim() >= 2:
            touched += 2 * q.numel() * k.shape[-2]
    elif packet in _POOL_WINDOW and ts:  # every output (every gradient, backward) visits its whole window
        touched += max(out, ts[0].numel()) * _window(packet, args[_POOL_WINDOW[packet]])
    elif packet in ("index_put", "index_put_") and len(args) > 1 and isinstance(args[0], torch.Tensor):
        touched += _indexed(args[0], args[1] if isinstance(args[1], (list, tuple)) else [])  # values broadcast
    elif packet in ("index_fill", "index_fill_") and len(args) > 2 and isinstance(args[0], torch.Tensor) \
            and isinstance(args[2], torch.Tensor) and isinstance(args[1], int) and args[0].dim():
        x = args[0]  # every index fills a whole slice
        touched += args[2].numel() * (x.numel() // max(x.shape[args[1] % x.dim()], 1))
    elif packet in ("_embedding_bag", "embedding_bag") and len(ts) > 1 and ts[0].dim():
        touched += ts[1].numel() * ts[0].shape[-1]  # every index adds a row of the weight into its bag
    elif packet == "multilabel_margin_loss_forward" and ts and ts[0].dim():
        touched += ts[0].numel() * ts[0].shape[-1]  # each sample: every target label against every class
    return touched


# (conv2d and its kin reach `convolution` below the dispatcher: only a crafted program names them, uncounted before)
_CONVOLUTION = frozenset({"convolution", "_convolution", "convolution_backward", "conv1d", "conv2d", "conv3d",
                          "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"})
# pooling packets -> the position of their kernel_size (the work is the output's elements times the window's)
_POOL_WINDOW = {p: 1 for p in ("max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices",
                               "max_pool3d_with_indices", "avg_pool1d", "avg_pool2d", "avg_pool3d",
                               "fractional_max_pool2d", "fractional_max_pool3d")} | {"avg_pool2d_backward": 2}


def _indexed(x: torch.Tensor, indices: list) -> int:
    """The elements `x[indices]` names (a boolean mask at its size, the most it can select): what index_put writes,
    whatever the values' shape (a 1-element value broadcasts to all of them)."""
    rest, dim, shapes = 1, 0, []
    for t in indices:
        if not isinstance(t, torch.Tensor):  # None: that dimension whole
            rest *= x.shape[dim] if dim < x.dim() else 1
            dim += 1
        elif t.dtype in (torch.bool, torch.uint8):
            shapes.append((t.numel(),))
            dim += max(t.dim(), 1)
        else:
            shapes.append(tuple(t.shape))
            dim += 1
    try:
        n = math.prod(torch.broadcast_shapes(*shapes)) if shapes else 1
    except RuntimeError:
        n = max((math.prod(sh) for sh in shapes), default=1)
    return n * rest * math.prod(x.shape[dim:])


def _window(packet: str, kernel_size: Any) -> int:
    """The elements of one pooling window (a one-number kernel_size stands for every spatial dimension)."""
    ks = [k for k in (kernel_size if isinstance(kernel_size, (list, tuple)) else [kernel_size]) if isinstance(k, int)]
    dims = 3 if "3d" in packet else 1 if "1d" in packet else 2
    if not ks:
        return 1
    return max(ks[0], 1) ** dims if len(ks) == 1 else math.prod(max(k, 1) for k in ks)


def by_position(op, args: list, kwargs: dict) -> list:
    """The call's arguments in the schema's order, those given by keyword in their place (a program may name
    any argument: `convolution(x, weight=w)`), defaults filled in: what the counts below index by position."""
    schema = ti.op_schema(op)
    if schema is None or not kwargs:
        return list(args)
    out = list(args)
    for p in schema.arguments[len(args):]:
        out.append(kwargs[p.name] if p.name in kwargs else p.default_value if p.has_default_value() else None)
    return out


def _einsum_work(equation: str, operands: list) -> int:
    """The multiply-adds of an einsum: the product of the sizes of every index it names (0 where it cannot say)."""
    terms = equation.replace(" ", "").split("->")[0].split(",")
    if len(terms) != len(operands):
        return 0
    sizes: dict[str, int] = {}
    for term, t in zip(terms, operands, strict=True):
        head, dots, tail = term.partition("...")
        if dots:  # the ellipsis's dimensions broadcast from the right: named '0' (the last), '1', ... here
            n = t.dim() - len(head) - len(tail)
            if "." in head + tail or not 0 <= n <= 10:
                return 0  # the elements touched stand for it
            term = head + "".join(str(j) for j in reversed(range(n))) + tail
        if "." in term or len(term) != t.dim():
            return 0
        for c, n in zip(term, t.shape, strict=True):
            sizes[c] = max(sizes.get(c, 1), n)
    return math.prod(sizes.values())


_CUBIC = frozenset({"linalg_cholesky_ex", "cholesky", "_linalg_solve_ex", "_linalg_svd", "_linalg_eigh", "linalg_eig",
                    "linalg_inv_ex", "_linalg_det", "_linalg_slogdet", "linalg_qr", "cholesky_solve",
                    "_cholesky_solve_helper", "cholesky_inverse", "triangular_solve", "logdet", "geqrf",
                    "linalg_householder_product", "linalg_solve_triangular", "matrix_exp", "linalg_matrix_exp"})
_CONTRACT_LAST = frozenset({"mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "linear", "mv", "addmv", "dot",
                            "vdot", "_grouped_mm", "inner", "cdist", "_cdist_forward", "_pdist_forward"})


def _expanded_bytes(args: list, kwargs: dict) -> int:
    """The bytes of the expanded views (a stride-0 dimension of more than one element) among a node's tensor
    arguments: many kernels make a contiguous copy of such an input first, at its full size."""
    total = 0
    for t in _tensors(args, kwargs):
        if t.layout == torch.strided and any(s == 0 and n > 1 for n, s in zip(t.shape, t.stride(), strict=True)):
            total += t.numel() * t.element_size()
    return total


# ---- ops whose output size depends on the data: their most, from the inputs' sizes


def _numel(t: Any) -> int:
    return t.numel() if isinstance(t, torch.Tensor) else 1


def _elsize(t: Any) -> int:
    return t.element_size() if isinstance(t, torch.Tensor) else 8


def _nonzero(args: list) -> int:
    x = args[0]
    return _numel(x) * max(x.dim(), 1) * 8


def _masked_select(args: list) -> int:
    x, m = args[0], args[1]
    try:
        n = math.prod(torch.broadcast_shapes(tuple(x.shape), tuple(m.shape)))
    except (RuntimeError, AttributeError):
        n = max(_numel(x), _numel(m))
    return n * _elsize(x)


def _unique(args: list) -> int:
    x = args[0]
    return _numel(x) * (_elsize(x) + 16)  # values, inverse, counts


def _index(args: list) -> int | None:
    x, idx = args[0], args[1] if len(args) > 1 else []
    if not any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in idx or []):
        return None  # integer indices: the meta kernel knows the shape
    others = math.prod(_numel(t) for t in idx if isinstance(t, torch.Tensor) and t.dtype not in (torch.bool, torch.uint8))
    return _numel(x) * _elsize(x) * max(others, 1)


def _pack_padded(args: list) -> int:
    x = args[0]  # the packed data holds at most every time step of every sample, beside one batch size per step
    return _numel(x) * _elsize(x) + (max(x.shape[:2]) if x.dim() >= 2 else 1) * 8


_DATA_DEPENDENT = {"aten.nonzero.default": _nonzero, "aten.masked_select.default": _masked_select,
                   "aten._pack_padded_sequence.default": _pack_padded,
                   "aten._unique2.default": _unique, "aten.unique_consecutive.default": _unique,
                   "aten.index.Tensor": _index, "aten.index.Tensor_hacked_twin": _index}


def _data_dependent_bytes(name: str, args: list) -> int | None:
    fn = _DATA_DEPENDENT.get(name)
    return fn(args) if fn is not None else None


# ---- helpers


def _arg_names(op) -> list[str]:
    schema = ti.op_schema(op)
    return [a.name for a in schema.arguments] if schema is not None else []


def _takes_device(op) -> bool:
    return "device" in _arg_names(op)


def _nbytes(shape: list[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * (torch.finfo(dtype).bits // 8 if dtype.is_floating_point else
                               (1 if dtype == torch.bool else torch.iinfo(dtype).bits // 8)
                               if not dtype.is_complex else 16)


def _meta_arg(v: Any, env: dict) -> Any:
    if isinstance(v, Ref):
        return env[v]
    if isinstance(v, DeviceLiteral):
        return torch.device("meta")
    if isinstance(v, list):
        return [_meta_arg(x, env) for x in v]
    return v


def _is_missing_meta(e: BaseException) -> bool:
    msg = str(e)
    return isinstance(e, NotImplementedError) or "meta" in msg.lower() and ("not implemented" in msg.lower()
                                                                             or "could not run" in msg.lower())


# Ops whose meta kernel refuses what the CPU kernel runs (torch 2.13: _grouped_mm's meta wants bfloat16): their
# declared shapes are trusted here and checked against what the kernel made during the replay.
_META_STRICTER = frozenset({"aten._grouped_mm.default"})


def _meta_retry(node, args: list, kwargs: dict, e: BaseException) -> Any:
    """A view whose input's meta strides differ from the real ones (a leaf or a fallback output is made
    contiguous here; the recorded tensor was not): the same view of a contiguous input has the same shape."""
    if not (ti.op_is_view(node.op) and "stride" in str(e) and args and isinstance(args[0], torch.Tensor)):
        return None
    try:
        with torch.no_grad():
            return node.op(args[0].contiguous(), *args[1:], **kwargs)
    except (NotImplementedError, RuntimeError, TypeError, ValueError, IndexError):
        return None
