"""The HTML report: render the view model with the one jinja2 environment, and write it atomically.

Autoescape is on, so no string that came from a snapshot or a model (module names, file
paths, keys, metadata) can become markup; the page also carries a Content-Security-Policy
that allows no network request and no script but its own, pinned by hash.

`jinja_env()` is shared with triage's index page: templates compile once per process.
"""

from __future__ import annotations

import base64
import functools
import hashlib
from pathlib import Path

from nanreplay import atomic
from nanreplay.analysis.result import Analysis
from nanreplay.errors import OutputError
from nanreplay.report.format import TEMPLATE_GLOBALS
from nanreplay.report.page import build_view
from nanreplay.report.sources import gather_sources
from nanreplay.sanitize import cap, cap_strings, html_visible

TEMPLATE_LIMIT = 100_000  # characters of any one printed value (chart geometry is the longest legitimate one)


def _template_dir() -> Path:
    return Path(__file__).parent / "templates"


def asset(name: str) -> str:
    """A file shipped with the templates (CSS, JS), as text."""
    return (_template_dir() / name).read_text(encoding="utf-8")


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii") + "'"


def csp(css: str, js: str) -> str:
    """The page's Content-Security-Policy: nothing from the network, only its own style and script (by hash)."""
    return ("default-src 'none'; img-src data:; " f"style-src {_sha256(css)}; script-src {_sha256(js)}; "
            "base-uri 'none'; form-action 'none'")


@functools.lru_cache(maxsize=1)
def jinja_env():
    """One jinja2 environment per process: templates compile once (triage renders many reports)."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(_template_dir())),
                             autoescape=True, undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, finalize=_visible)
    env.globals.update(TEMPLATE_GLOBALS)
    return env


def _visible(value):
    """Every value a template prints: a plain string gets bidi overrides made visible and a length cap
    (a backstop: the analysis' own strings are capped tighter before the views are built)."""
    from markupsafe import Markup

    if isinstance(value, str) and not isinstance(value, Markup):
        return cap(html_visible(value), TEMPLATE_LIMIT)
    return value


def render_html(a: Analysis | dict, *, index: str = "") -> str:
    """Read the source lines the report quotes, build the view, render the page (linked back to `index`, if any)."""
    from markupsafe import Markup

    d = a.to_json() if isinstance(a, Analysis) else a
    d = cap_strings(d)  # a 2 MB string in a snapshot must not become a 91 MB page
    v = build_view(d, gather_sources(d), index=index)
    css, js = asset("report.css"), asset("report.js")
    # The page's own CSS and JS are trusted files shipped with nanreplay; inlined verbatim so their CSP hashes match.
    return jinja_env().get_template("report.html.j2").render(v=v, css=Markup(css), js=Markup(js), csp=csp(css, js))


def write_report(a: Analysis | dict, path: str, *, index: str = "") -> None:
    """Render, then write atomically: a failure at any point leaves no file (and no half of one) behind."""
    html = render_html(a, index=index)
    try:
        atomic.write_text(path, html)
    except OSError as e:
        raise OutputError(f"{path}: cannot write the report: {e.strerror or e}") from None
