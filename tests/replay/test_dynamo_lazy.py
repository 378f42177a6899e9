"""A replay does not import torch._dynamo to run its dispatch mode, and is unchanged once something has.

torch wraps each mode's handler in `_disable_dynamo`, which imports torch._dynamo (~1.1 s) on first use;
nanreplay's modes take that path only once torch._dynamo is loaded (torch_internals.TorchDispatchMode).
Each check runs in a fresh interpreter: this pytest process has long imported torch._dynamo.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from samples import ROOT, SAMPLES

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}


def _fresh(code: str, cwd) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=ENV, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_plain_dict_analysis_never_imports_dynamo(tmp_path):
    """The seed's `{'x', 'y', 'state'}` dict, analyzed with --model in this process: the culprit, its cause and the
    verified fix, and torch._dynamo never loaded (it was, through the first replay's mode, before)."""
    got = _fresh(f"""
        import json, sys
        import nanreplay
        a = nanreplay.analyze({str(SAMPLES / "nan_snapshot_step_3.pt")!r}, model="sample_snapshots.models:triplet")
        d = a.to_json()
        print(json.dumps({{"dynamo": "torch._dynamo" in sys.modules, "verdict": d["verdict"],
                          "node": d["culprit"]["backward_node"], "cause": d["diagnosis"]["cause"],
                          "verified": d["diagnosis"]["fix"]["verified"]}}))
    """, ROOT)
    assert got == {"dynamo": False, "verdict": "culprit_found", "node": "SqrtBackward0", "cause": "sqrt_at_zero",
                   "verified": True}


def test_a_model_that_compiles_replays_as_one_that_does_not(tmp_path):
    """User code that calls torch.compile loads torch._dynamo before the replay (in its factory) or in the middle
    of it (in forward). From then on the modes' handlers run as torch runs them, dynamo turned off around them: a
    handler traced by dynamo lost every backward op's link to its forward op. Same analysis as the eager model."""
    (tmp_path / "compiled_model.py").write_text(textwrap.dedent("""\
        import torch
        import torch.nn as nn

        def distance(a, p):
            return ((a - p) ** 2).sum(-1).sqrt()

        class Net(nn.Module):
            def __init__(self, how):
                super().__init__()
                self.enc = nn.Linear(8, 4)
                self.how = how
                self.dist = torch.compile(distance, backend="eager") if how == "compiled" else distance

            def forward(self, a, p):
                dist = torch.compile(distance, backend="eager") if self.how == "in_forward" else self.dist
                return dist(self.enc(a), self.enc(p)).mean()

        def build(how):
            return lambda: Net(how)
        eager, compiled, in_forward = build("eager"), build("compiled"), build("in_forward")
    """))
    got = _fresh("""
        import json, sys
        import torch
        import compiled_model, nanreplay
        torch.manual_seed(0)
        x = torch.randn(5, 8)
        torch.save({"x": (x, x.clone()), "y": None, "state": compiled_model.eager().state_dict()}, "snap.pt")
        rows = {}
        for name in ("eager", "in_forward", "compiled"):
            before = "torch._dynamo" in sys.modules
            d = nanreplay.analyze("snap.pt", model=f"compiled_model:{name}").to_json()
            c = d["culprit"]
            rows[name] = [before, d["verdict"], c["backward_node"], c["forward_op"], c["source"]["line"],
                          d["diagnosis"]["cause"], [e["forward_op"] for e in d["chain"]]]
        print(json.dumps(rows))
    """, tmp_path)
    assert got["eager"][0] is False and got["in_forward"][0] is False and got["compiled"][0] is True
    assert got["eager"][1:6] == ["culprit_found", "SqrtBackward0", "aten.sqrt.default", 5, "sqrt_at_zero"]
    assert got["in_forward"][1:] == got["eager"][1:] and got["compiled"][1:] == got["eager"][1:]


def test_probe_says_the_lazy_path_works():
    from nanreplay import torch_internals as ti

    assert ti.probe()["lazy_dynamo_off"] == "ok"
