"""Argument checks for the antialiased resampling kernels, whose window grows with the inverse of their scale.

Round 5 of the crafted files (docs/trust.md): `_upsample_bilinear2d_aa` and `_upsample_bicubic2d_aa` take, beside
the output size, the scale the caller used (`F.interpolate(..., scale_factor=s, antialias=True)` passes `s`, with
the output size `floor(input * s)`). The kernels size their interpolation windows from `1 / scale`, not from the
sizes: a tiny positive scale (1e-5 for a 16 → 4 resize, which opchecks' rule lets through as finite and positive)
makes a window of millions of taps and the kernel crashed (SIGSEGV), and a scale far from the sizes (0.01 for a
16 → 40 resize) filled the output with non-finite values of memory it never wrote. A real call's scale always
matches its sizes within one output pixel; the rule asks exactly that.
`formats/opchecks.py` registers these in its table (the dry run and every replay).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _aa_scales(call: Any) -> str | None:
    x, size = call["self"], call["output_size"]
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or not isinstance(size, (list, tuple)) or len(size) != 2:
        return None
    for name, n_in, n_out in (("scales_h", x.shape[-2], size[0]), ("scales_w", x.shape[-1], size[1])):
        s = call[name]
        if s is None or not isinstance(s, (int, float)) or not isinstance(n_out, int):
            continue  # no scale: the kernel takes it from the sizes (opchecks' rule checks the scale's sign)
        if not n_out - 1 <= n_in * s <= n_out + 1:
            return (f"{name} {s:g} does not match the resize of {n_in} to {n_out} (the kernel sizes its windows "
                    "from the scale: a crafted one makes them larger than the input)")
    return None


# op packet -> its check (registered in opchecks' RULES)
SCALE_CHECKS: dict[str, Callable[[Any], str | None]] = {
    "_upsample_bilinear2d_aa": _aa_scales,
    "_upsample_bicubic2d_aa": _aa_scales,
}
