"""The op allowlist: what the capture sweep added is allowed, and nothing DESIGN.md's never-allow list names is."""

from __future__ import annotations

import re

import torch

from nanreplay.formats.ops import ALLOWED_OPS, SWEEP_PACKETS

NEVER = re.compile(r"from_file|_copy_from|\.set_|^aten\.set_|as_strided|resize_|record_stream|pin_memory|share_memory_|"
                   r"_assert_|_print|\.lift|\.out$|_out$")


def test_no_allowed_overload_is_on_the_never_allow_list():
    bad = [n for n in ALLOWED_OPS if NEVER.search(n) or not n.startswith("aten.")]
    assert bad == []


def test_no_allowed_overload_writes_to_a_keyword_output_or_takes_a_storage_or_stream():
    for name in ALLOWED_OPS:
        _, packet, overload = name.split(".")
        schema = getattr(getattr(torch.ops.aten, packet), overload)._schema
        for a in schema.arguments:
            t = str(a.type)
            assert "Storage" not in t and "Stream" not in t, name
            assert not (a.alias_info is not None and a.alias_info.is_write and a.kwarg_only), name


def test_the_sweep_additions_are_allowed_in_this_torch():
    allowed_packets = {n.split(".")[1] for n in ALLOWED_OPS}
    present = {p for p in SWEEP_PACKETS if hasattr(torch.ops.aten, p)}
    assert {"histc", "_trilinear", "channel_shuffle", "linalg_matrix_exp"} <= present
    assert present <= allowed_packets
