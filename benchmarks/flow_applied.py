"""Flow diagnoses judged by applying them (docs/flow.md, "Judged by applying"): each loop of flowcases/cases.py
trained under NanGuard in its own process from a scratch copy; its first snapshot analyzed where the code cannot be
imported; the snapshot's kind, verdict, cause, where the flow ends and the fix; where the fix is an edit, the edit
made in the copy and the loop trained on (where the fix is advice, `BY_HAND` says how a user would apply it, and
that is applied instead, labelled so).

    python benchmarks/flow_applied.py [CASE...]       # prints one JSON row per case, then a Markdown table
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.isolation import analyze_isolated, apply_edits  # noqa: E402

HERE = Path(__file__).resolve().parent / "flowcases"
ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
CASES = ("relu_high_lr", "deep_sigmoid", "long_rnn", "rnn_saturated_init", "data_cut", "round_path",
         "unused_branch", "sigmoid_output", "lr_spike")
BY_HAND = {  # advice, as a user would apply it: (before, after) in cases.py
    "relu_high_lr": ("RELU_LR = 1.0", "RELU_LR = 0.1"),  # "keep the peak learning rate below that, e.g. 0.1"
    "data_cut": ("self.fc2.weight.data, self.fc2.bias", "self.fc2.weight, self.fc2.bias"),  # "not `.data`"
    "round_path": ("q = torch.round(self.enc(x) * 4) / 4", "s = self.enc(x) * 4; q = (s + (torch.round(s) - s)"
                   ".detach()) / 4"),  # the straight-through estimator the advice writes out
    "sigmoid_output": ("return torch.sigmoid(self.out(torch.relu(self.fc(x))))",
                       "return self.out(torch.relu(self.fc(x)))"),  # logits, and the loss with logits:
    "rnn_saturated_init": ("self.rnn.weight_hh_l0.mul_(scale)", "pass"),  # "a smaller init"
    "deep_sigmoid": ("x = torch.sigmoid(layer(x))  # BUG", "x = F.gelu(layer(x))"),  # GELU, with a Kaiming init:
}
LOSS_BY_HAND = {"sigmoid_output": ("return F.binary_cross_entropy(p, y)",
                                   "return F.binary_cross_entropy_with_logits(p, y)"),
                "deep_sigmoid": ("self.out = nn.Linear(8, 1)\n", "self.out = nn.Linear(8, 1)\n        for lin in self.layers:"
                                 "\n            nn.init.kaiming_normal_(lin.weight, nonlinearity='relu')\n"
                                 "            nn.init.zeros_(lin.bias)\n")}  # (not a loss: the second edit of a fix)


def train(proj: Path, name: str, out: Path) -> dict:
    res = subprocess.run([sys.executable, "cases.py", str(out), name], cwd=proj, capture_output=True, text=True,
                         timeout=900, env=ENV)
    if res.returncode != 0:
        return {"error": res.stderr[-500:]}
    return json.loads(res.stdout.splitlines()[-1])


def _where(d: dict) -> str:
    gf = d.get("gradient_flow") or {}
    row = next((r for r in gf.get("per_parameter") or [] if r.get("verdict") == gf.get("verdict")), None)
    src = (row or {}).get("source") or (d.get("culprit") or {}).get("source") or {}
    mod = (row or {}).get("module") or (d.get("culprit") or {}).get("module")
    op = (row or {}).get("op") or (d.get("culprit") or {}).get("op")
    line = f"cases.py:{src['line']}" if src.get("line") else "-"
    return f"{op or '-'} ({mod or '<root>'}) {line}"


def judge(name: str, work: Path) -> dict:
    proj = work / name / "proj"
    proj.mkdir(parents=True)
    shutil.copy(HERE / "cases.py", proj / "cases.py")
    before = train(proj, name, work / name / "snaps")
    row = {"case": name, "before": before}
    if "error" in before or not before["snapshots"]:
        row["snapshot"] = "none"
        return row
    first = before["snapshots"][0]
    d = analyze_isolated([first], work / name / "elsewhere", also_blocked=("cases",))[first]
    diag = d.get("diagnosis") or {}
    fix = diag.get("fix") or {}
    row.update(snapshot=d["snapshot_info"]["trigger"], verdict=d["verdict"], cause=diag.get("cause"),
               mechanism=(diag.get("mechanism") or {}).get("kind"), where=_where(d), fix_kind=fix.get("kind"),
               verified=fix.get("verified"), edits=[(e["before"], e["after"]) for e in fix.get("edits") or []],
               advice=(fix.get("code") or "").splitlines()[:2])
    fixed = work / name / "fixed"
    fixed.mkdir()
    shutil.copy(proj / "cases.py", fixed / "cases.py")
    if fix.get("edits"):
        apply_edits(fixed / "cases.py", fix["edits"])
        row["applied"] = "edit"
    elif name in BY_HAND:
        for b, a in [BY_HAND[name], *([LOSS_BY_HAND[name]] if name in LOSS_BY_HAND else [])]:
            text = (fixed / "cases.py").read_text()
            assert b in text, b
            (fixed / "cases.py").write_text(text.replace(b, a, 1))
        row["applied"] = "advice, by hand"
    else:
        return row
    row["after"] = train(fixed, name, work / name / "snaps_fixed")
    return row


def table(rows: list[dict]) -> str:
    out = ["| case | snapshot (first) | verdict / cause | where | fix | applied | after: snapshots, loss first → last |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        b, a = r.get("before") or {}, r.get("after")
        cause = f"{r.get('verdict', '-')} / {r.get('cause', '-')}" + (f" (mechanism: {r['mechanism']})"
                                                                        if r.get("mechanism") else "")
        fix = "; ".join(f"`{x}` → `{y}`" for x, y in r.get("edits") or []) or r.get("fix_kind") or "-"
        if r.get("verified") is not None:
            fix += f" (verified: {r['verified']})"
        after = "-"
        if a and "losses" in a:
            ls = a["losses"]
            after = (f"{len(a['snapshots'])}, {ls[0]:.3g} → {ls[-1]:.3g} ({len(ls)} steps), zero-gradient steps "
                     f"{a['zero_steps']:.0%}")
        ls = b.get("losses") or [float("nan")]
        out.append(f"| {r['case']} | {r.get('snapshot', '-')} | {cause} | {r.get('where', '-')} | {fix} | "
                   f"{r.get('applied', '-')} | {after} (before: {ls[0]:.3g} → {ls[-1]:.3g}) |")
    return "\n".join(out)


def main(names: list[str]) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names or CASES:
            rows.append(judge(name, Path(tmp)))
            print(json.dumps(rows[-1], default=str), flush=True)
    print(table(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
