"""Argument checks for kernels that read (or allocate) a tensor as one dense block, ignoring its strides.

Round 5 of the crafted files (docs/trust.md): a step program can hand a kernel a view whose strides are not the
contiguous ones — a stride-0 `expand` of a 1-element tensor, a transpose, a stored leaf with any strides — and
the meta kernel, which computes shapes only, passes it. These kernels then walk the argument's `data_ptr` as
`numel` contiguous elements (or allocate an output with its strides and write `numel` elements into it):

* `native_group_norm` reads one `weight` and one `bias` per channel contiguously: an 8192-channel weight expanded
  from one float read 32 KB of the heap into the output;
* `native_layer_norm_backward` reads `mean` and `rstd` contiguously, one per row (the shapes are checked in
  formats/gradchecks.py; a stride-0 expansion of one value has the right shape);
* `_weight_norm_interface` reads `v` contiguously and makes its `norms` output with `g`'s strides, then writes one
  norm per slice into it: a stride-0 `g` has a 1-element storage, and the write corrupted the heap (glibc abort);
* `_embedding_bag` reads `indices` and `offsets` as dense arrays (a strided view's gaps came back as indices:
  a stride-0 expansion of one index to 1000 reads 8 KB of the heap as row numbers; the kernel's own range check
  then quotes a heap word, or selects rows by it);
* `mkldnn_rnn_layer` hands oneDNN the input and the hidden and cell states as dense memory: a stride-0 input read
  past its storage (torch's LSTM passes them contiguous, whatever `batch_first` says);
* the CPU flash-attention kernel walks `query`, `key` and `value` assuming the head dimension has stride 1.

torch's public forms make these arguments contiguous before the call (`F.group_norm`, `torch._weight_norm`, the
forward's own statistics, `scaled_dot_product_attention` for the head dimension), so the rule is that they are
(found by a scan: every allowlisted op torch's OpInfo samples reach, forward and backward, rerun with each tensor
argument made strided, transposed or stride-0 over a NaN-filled storage, and compared with the contiguous call).
`formats/opchecks.py` registers these in its table: they run in the dry run (meta tensors have strides) and
before every replayed kernel. Each gets the call's arguments by name and returns why it is refused, or None.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _dense(call: Any, *names: str) -> str | None:
    for name in names:
        t = call[name]
        if isinstance(t, torch.Tensor) and not t.is_contiguous():
            return (f"{name} is a strided view (strides {list(t.stride())}); the kernel reads it as one dense "
                    "block: a crafted view would make it read or write past its storage")
    return None


def _last_dim_dense(call: Any, *names: str) -> str | None:
    for name in names:
        t = call[name]
        if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
            return (f"{name}'s last dimension has stride {t.stride(-1)}; the kernel reads it as dense rows: a "
                    "crafted view would make it read past its storage")
    return None


# op packet -> its check (registered in opchecks' RULES)
LAYOUT_CHECKS: dict[str, Callable[[Any], str | None]] = {
    "native_group_norm": lambda c: _dense(c, "weight", "bias"),
    "native_layer_norm_backward": lambda c: _dense(c, "mean", "rstd"),
    "_weight_norm_interface": lambda c: _dense(c, "v", "g"),
    "_embedding_bag": lambda c: _dense(c, "indices", "offsets"),
    "mkldnn_rnn_layer": lambda c: _dense(c, "input", "weight0", "weight1", "weight2", "weight3", "hx_", "cx_"),
    "_scaled_dot_product_flash_attention_for_cpu": lambda c: _last_dim_dense(c, "query", "key", "value"),
}
