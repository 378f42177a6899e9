"""A step program replayed from a segment's start instead of its first node (nanreplay/seeded.py, the precision
probe): what the instrumented replay keeps for that, and the partial replays themselves. Mixed into StepModule.

`keep_boundaries()` makes the next forward keep, at the start of each segment of the checkpoint plan (the
module calls at the depth that holds least: a transformer's blocks), the values live there — made before it and
read at or after it; leaves aside, a replay makes those itself — and, for each segment that a recomputation may
replay (`Segment.unit`), the gradients that reached its outputs in that replay's backward. References, not
copies, each with its version counter as it was, so that a value written in place later is never used as what
the segment read.
"""

from __future__ import annotations

from typing import Any

import torch

from nanreplay import torch_internals as ti
from nanreplay.formats.segments import Segment, checkpoint_plan, live_at


class Boundaries:
    """StepModule's partial replays (its `program`, `_leaves`, `_run_nodes`, `_run` and `_node` are used)."""

    def keep_boundaries(self) -> bool:
        """Keep the boundaries of the next forward (see the module). False where the program has no segments."""
        segs = checkpoint_plan(self.program)
        if not segs:
            return False
        live = live_at(self.program, {seg.start for seg in segs if seg.start > 0})
        outs = {seg.stop: seg for seg in segs if seg.unit is not None and seg.outputs}
        self.__dict__["_keep"] = (live, outs)
        self.__dict__["_kept"] = ({}, {})
        return True

    def _keep_at(self, i: int, env: dict) -> None:
        live, outs = self.__dict__["_keep"]
        values, grads = self.__dict__["_kept"]
        with ti.function_modes_off(), ti.dispatch_modes_off():  # unseen: the replay's numbering stays its own
            if i in live:
                values[i] = {r: (env[r].detach(), env[r]._version) for r in live[i]
                             if isinstance(env.get(r), torch.Tensor)}
            seg = outs.get(i)
            if seg is not None:
                got = grads[seg.start] = {}
                for r in seg.outputs:
                    t = env.get(r)
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(lambda g, r=r, got=got: got.__setitem__(r, (g, g._version)))

    def kept(self, i: int) -> dict[int, torch.Tensor] | None:
        """The values live at node `i` as the kept forward made them, or None: not kept there, or one was
        written in place after it (its version moved), so it no longer holds what node `i` read."""
        return _unchanged(self.__dict__.get("_kept", ({}, {}))[0].get(i))

    def kept_grads(self, start: int) -> dict[int, torch.Tensor] | None:
        """The gradients that reached the outputs of the segment starting at node `start`, by ref (None as kept)."""
        return _unchanged(self.__dict__.get("_kept", ({}, {}))[1].get(start))

    def kept_starts(self) -> list[int]:
        return sorted(self.__dict__.get("_kept", ({}, {}))[0])

    def segment_at(self, start: int) -> Segment | None:
        """The checkpoint plan's segment that starts at node `start`."""
        return next((s for s in checkpoint_plan(self.program) or [] if s.start == start), None)

    def trim_kept(self, node: int, backward: bool) -> None:
        """Once the culprit is known (its forward op ran as `node`): only what its probe reads stays — the boundary
        before it, and for a backward culprit the last one too (the loss's forward starts there) and the
        gradients of the segment it is in; the rest (about an activation each) is let go."""
        values, grads = self.__dict__.get("_kept", ({}, {}))
        before = [s for s in values if s <= node]
        want = {max(before)} if before else set()
        if backward and values:
            want.add(max(values))
        seg = max((s for s in grads if s <= node), default=None) if backward else None
        self.__dict__["_kept"] = ({s: v for s, v in values.items() if s in want},
                                  {seg: grads[seg]} if seg is not None else {})

    def drop_kept(self, grads_only: bool = False) -> None:
        """Let go of what was kept (only the gradients: no backward culprit will read them)."""
        values = self.__dict__.get("_kept", ({}, {}))[0] if grads_only else {}
        self.__dict__["_keep"], self.__dict__["_kept"] = None, (values, {})

    def current_node(self) -> int | None:
        """The index of the node running now (the Recorder files each op under it)."""
        return self._node

    def run_from(self, start: int, stop: int, seeded: dict[int, torch.Tensor], inputs: Any = None,
                 target: Any = None, *, watch: int | None = None) -> tuple[dict, Any]:
        """Nodes [start, stop) on this copy's own leaves and `seeded` (the values live at `start`), under the
        caller's grad mode: (the values live after them, the raw output of node `watch` or None)."""
        env = self._with(seeded, inputs, target)
        grad_on = torch.is_grad_enabled()
        seen: list = []
        self.__dict__["_watch"] = (watch, seen) if watch is not None else None
        try:
            self._run_nodes(start, stop, env, grad_on)
        finally:
            torch.set_grad_enabled(grad_on)
            self._node = None
            self.__dict__["_watch"] = None
        return env, seen[0] if seen else None


    def prefix(self, stop: int, inputs: Any = None, target: Any = None) -> tuple[dict, bool]:
        """The forward's nodes [0, stop) as `forward` runs them, under the caller's grad mode: the values there, and
        the grad mode the last of them left (restored unseen: `forward` makes no call between two nodes)."""
        env = self._leaves(inputs, target)
        grad_on = torch.is_grad_enabled()
        try:
            self._run_nodes(0, stop, env, grad_on)
        finally:
            left = torch.is_grad_enabled()
            with ti.function_modes_off():
                torch.set_grad_enabled(grad_on)
            self._node = None
        return env, left

    def suffix(self, start: int, env: dict, left: bool) -> torch.Tensor:
        """The rest of the forward from `prefix`'s values (the caller's own dict of them) and grad mode: the loss,
        with the same calls `forward` makes from that node on."""
        grad_on = torch.is_grad_enabled()
        with ti.function_modes_off():
            torch.set_grad_enabled(left)
        try:
            self._run_nodes(start, len(self.program.nodes), env, grad_on)
        finally:
            torch.set_grad_enabled(grad_on)
            self._node = None
        return env[self.program.loss]

    def inputs_of(self, start: int, node: int, seeded: dict[int, torch.Tensor], inputs: Any = None,
                  target: Any = None) -> tuple[list, dict] | None:
        """The arguments node `node` is called with, from nodes [start, node) run under no_grad on `seeded`;
        None for a node that does not call its op with them (a random op's recorded value, dropout's mask,
        zeros, a strided view)."""
        n = self.program.nodes[node]
        if n.random is not None or n.mask is not None or n.view is not None or n.name in _SPECIAL:
            return None
        with torch.no_grad():
            env, _out = self.run_from(start, node, seeded, inputs, target) if node > start else \
                (self._with(seeded, inputs, target), None)
            self._node = node
            try:
                with ti.function_modes_off():
                    return self._checked_args(n, env)
            finally:
                self._node = None

    def _with(self, seeded: dict, inputs: Any, target: Any) -> dict:
        env = self._leaves(inputs, target)
        env.update(seeded)
        return env


_SPECIAL = frozenset({"aten.empty.memory_format", "aten.empty_like.default", "aten.new_empty.default",
                      "aten.empty_strided.default"})  # StepModule._FILL_ZERO: made as zeros, not by their op


def _unchanged(got: dict | None) -> dict[int, torch.Tensor] | None:
    if got is None or any(t._version != v for t, v in got.values()):
        return None
    return {r: t for r, (t, _v) in got.items()}
