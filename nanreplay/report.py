"""The HTML report and the terminal summary.

Compute first, render second: `build_view()` turns an Analysis into plain view
data; the jinja2 template (autoescaped) only lays it out.
"""

from __future__ import annotations

from pathlib import Path

from nanreplay import atomic
from nanreplay.analysis import Analysis
from nanreplay.errors import UsageError


def _template_dir() -> Path:
    inside = Path(__file__).parent / "templates"  # installed wheel
    return inside if inside.is_dir() else Path(__file__).parent.parent / "templates"  # source checkout


def _env():
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(_template_dir())),
                             autoescape=True, undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True)
    return env


def _where(src: dict | None) -> str:
    return f"{src['file']}:{src['line']}" if src else "(no user source line)"


def _module(m: str | None) -> str:
    if m is None:
        return "(unknown)"
    return m if m else "<root>"


def build_view(a: Analysis) -> dict:
    d = a.to_json()
    c = d["culprit"]
    fix = d["diagnosis"].get("fix") or {}
    return {
        "a": d,
        "title": f"nanreplay: {Path(a.snapshot).name}",
        "culprit": c,
        "where": _where(c["source"]) if c else "",
        "module": _module(c["module"]) if c else "",
        "fix": fix,
        "chain": d["chain"],
        "grads": sorted(d["gradients"], key=lambda g: (-(g["nan"] + g["inf"]), not g["has_grad"])),
    }


def render_html(a: Analysis) -> str:
    return _env().get_template("report.html.j2").render(**build_view(a))


def write_report(a: Analysis, path: str) -> None:
    html = render_html(a)
    try:
        atomic.write_text(path, html)
    except OSError as e:
        raise UsageError(f"{path}: cannot write the report: {e.strerror or e}") from None


def terminal_summary(a: Analysis, report_path: str | None) -> str:
    d = a.to_json()
    lines = [f"nanreplay: {a.snapshot}: {a.verdict.replace('_', ' ')}"]
    c = d["culprit"]
    diag = d["diagnosis"]
    if c:
        how = f"{c['phase']}"
        if c["backward_node"]:
            how += f", {c['backward_node']} ← {c['forward_op']}"
        lines.append(f"  culprit  {c['op']} ({how}) produced {c['kind'].upper()}")
        lines.append(f"  module   {_module(c['module'])}   at {_where(c['source'])}")
        if c["source"] and c["source"].get("code"):
            lines.append(f"           {c['source']['code']}")
    elif d["nonfinite_leaves"]:
        for r in d["nonfinite_leaves"][:5]:
            lines.append(f"  {r['role']:9}{r['name']}: {r['nan']} NaN, {r['inf']} Inf")
    if diag:
        lines.append(f"  cause    {diag['title']}")
        fix = diag.get("fix") or {}
        if fix.get("kind") and fix["kind"] != "none":
            badge = {True: "verified by replay", False: "NOT verified", None: "not verifiable"}[fix.get("verified")]
            code = (fix.get("after") or fix.get("code") or "").splitlines()
            lines.append(f"  fix      [{badge}] {code[0] if code else ''}")
            lines += [f"           {ln}" for ln in code[1:4]]
    am = d["anomaly_mode"]
    if am.get("raises") is not None:
        if am["raises"]:
            agree = "the culprit's node" if am.get("agrees_with_culprit") else "a later node than the culprit"
            lines.append(f"  anomaly  set_detect_anomaly would raise at {am['node']} ({agree})")
        else:
            lines.append("  anomaly  set_detect_anomaly would stay silent")
    if report_path:
        lines.append(f"  report   {report_path}")
    return "\n".join(lines)
