"""Headless Chromium driven over the DevTools protocol on a pipe: the real-browser checks of the report.

Only the standard library: Chromium is started with `--remote-debugging-pipe` (it reads
commands on fd 3 and writes replies on fd 4, NUL-separated JSON), so no WebSocket client,
no Selenium and no Playwright are needed. One browser serves a whole test module; each
page gets a fresh tab.

    with Chromium.start() as browser:
        page = browser.open(path, width=420)
        page.overflowing()          # elements that stick out of the viewport horizontally
        page.problems()             # console errors, exceptions, CSP violations
        pdf_pages(page.pdf("letter"))  # what each printed page says (pdftotext)
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

PAPER = {"a4": (8.27, 11.69), "letter": (8.5, 11.0)}  # inches
PDF_MARGIN = 0.4  # inches: Page.printToPDF's default margin on every side

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")

# Runs before the page's own script in every document (DevTools scripts are not subject to the page's CSP).
WATCH = """
window.__problems = [];
document.addEventListener('securitypolicyviolation', function (e) {
  window.__problems.push('CSP violation: ' + e.violatedDirective + ' blocked ' + (e.blockedURI || 'inline'));
});
window.addEventListener('error', function (e) { window.__problems.push('error: ' + e.message); });
"""

# Every element whose box sticks out of the viewport on the right (or left), unless a clipping ancestor hides it.
OVERFLOW = """
(function () {
  var vw = document.documentElement.clientWidth, out = [];
  function clipped(el) {
    for (var p = el.parentElement; p && p !== document.body; p = p.parentElement) {
      var s = getComputedStyle(p);
      if (s.overflowX !== 'visible' || s.display === 'none') { return true; }
    }
    return false;
  }
  document.querySelectorAll('body *').forEach(function (el) {
    var r = el.getBoundingClientRect();
    if (!r.width || !r.height) { return; }
    if ((r.right > vw + 0.5 || r.left < -0.5) && !clipped(el)) {
      out.push(el.tagName.toLowerCase() + (el.className && el.className.baseVal === undefined ? '.' + el.className : '')
               + ' [' + Math.round(r.left) + ', ' + Math.round(r.right) + '] ' + (el.textContent || '').trim().slice(0, 40));
    }
  });
  return {viewport: vw, scroll: document.documentElement.scrollWidth, elements: out.slice(0, 20)};
})()
"""

# The smallest rendered font size of any visible chart text: an SVG scaled down shrinks its text.
CHART_TEXT = """
(function () {
  var sizes = [];
  document.querySelectorAll('svg.chart').forEach(function (svg) {
    var r = svg.getBoundingClientRect();
    if (!r.width) { return; }
    var scale = r.width / svg.viewBox.baseVal.width;
    svg.querySelectorAll('text').forEach(function (t) {
      sizes.push(parseFloat(getComputedStyle(t).fontSize) * scale);
    });
  });
  return sizes.length ? Math.min.apply(null, sizes) : null;
})()
"""


# Chart text cut off by the edge of its SVG (an SVG clips what it draws outside its box).
CHART_CLIPPED = """
(function () {
  var out = [];
  document.querySelectorAll('svg.chart').forEach(function (svg) {
    var box = svg.getBoundingClientRect();
    if (!box.width) { return; }
    svg.querySelectorAll('text').forEach(function (t) {
      var r = t.getBoundingClientRect();
      if (r.top < box.top - 1 || r.bottom > box.bottom + 1 || r.left < box.left - 1 || r.right > box.right + 1) {
        out.push((t.textContent || '').slice(0, 30));
      }
    });
  });
  return out;
})()
"""


# Every word (a run without spaces, up to a <wbr> or a tag) of the elements `selector` matches that is drawn on more
# than one line: a file name, code or an option cut where no reader would cut it.
SPLIT_WORDS = """
(function (selector) {
  var out = [];
  document.querySelectorAll(selector).forEach(function (el) {
    var walker = document.createTreeWalker(el, NodeFilter.SHOW_TEXT), n;
    while ((n = walker.nextNode())) {
      var re = /\\S+/g, m;
      while ((m = re.exec(n.data))) {
        var r = document.createRange(); r.setStart(n, m.index); r.setEnd(n, m.index + m[0].length);
        var tops = new Set(Array.from(r.getClientRects()).filter(function (x) { return x.width > 0; })
                           .map(function (x) { return Math.round(x.top); }));
        if (tops.size > 1) { out.push(m[0]); }
      }
    }
  });
  return out;
})
"""


def find() -> str | None:
    """The Chromium (or Chrome) executable on PATH, or None."""
    for name in CANDIDATES:
        exe = shutil.which(name)
        if exe:
            return exe
    return None


class Chromium:
    """One headless browser process and its DevTools pipe."""

    def __init__(self, exe: str):
        self.profile = tempfile.mkdtemp(prefix="nanreplay-chromium-")
        to_r, to_w = os.pipe()  # we write commands -> chromium reads fd 3
        from_r, from_w = os.pipe()  # chromium writes replies on fd 4 -> we read
        # move the child's ends out of the way of fds 3 and 4 before dup2 puts them there
        child_r = fcntl.fcntl(to_r, fcntl.F_DUPFD_CLOEXEC, 10)
        child_w = fcntl.fcntl(from_w, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(to_r)
        os.close(from_w)

        def fds() -> None:
            os.dup2(child_r, 3)
            os.dup2(child_w, 4)

        self.proc = subprocess.Popen(
            [exe, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe", "--no-first-run",
             "--disable-extensions", "--disable-dev-shm-usage", "--disable-background-networking",
             f"--user-data-dir={self.profile}", "about:blank"],
            close_fds=False, preexec_fn=fds, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        os.close(child_r)
        os.close(child_w)
        self.w = os.fdopen(to_w, "wb", buffering=0)
        self.r = os.fdopen(from_r, "rb", buffering=0)
        self.buf = b""
        self.next_id = 0
        self.events: list[dict] = []

    @classmethod
    def start(cls) -> Chromium:
        exe = find()
        if exe is None:
            raise FileNotFoundError("no chromium on PATH")
        return cls(exe)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _read(self) -> dict:
        while b"\0" not in self.buf:
            chunk = self.r.read(1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed its DevTools pipe")
            self.buf += chunk
        msg, _, self.buf = self.buf.partition(b"\0")
        return json.loads(msg)

    def send(self, method: str, session: str | None = None, **params) -> dict:
        self.next_id += 1
        mid = self.next_id
        msg: dict = {"id": mid, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        self.w.write(json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == mid:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str, session: str, timeout: float = 20.0) -> dict:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for i, e in enumerate(self.events):
                if e.get("method") == method and e.get("sessionId") == session:
                    return self.events.pop(i)
            self.events.append(self._read())
        raise TimeoutError(method)

    def open(self, path: Path, *, width: int, height: int = 900) -> Page:
        """A fresh tab at `width` CSS pixels (a phone below 700), with `path` loaded."""
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for m in ("Page.enable", "Runtime.enable", "Log.enable"):
            self.send(m, session)
        self.send("Page.addScriptToEvaluateOnNewDocument", session, source=WATCH)
        self.send("Emulation.setDeviceMetricsOverride", session, width=width, height=height, deviceScaleFactor=1,
                  mobile=width < 700)
        self.send("Page.navigate", session, url=Path(path).resolve().as_uri())
        self.wait_for("Page.loadEventFired", session)
        return Page(self, session, target)

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except (RuntimeError, OSError, ValueError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        for f in (self.w, self.r):
            f.close()
        shutil.rmtree(self.profile, ignore_errors=True)


class Page:
    def __init__(self, browser: Chromium, session: str, target: str):
        self.browser, self.session, self.target = browser, session, target

    def eval(self, expression: str):
        r = self.browser.send("Runtime.evaluate", self.session, expression=expression, returnByValue=True)
        if "exceptionDetails" in r:
            raise RuntimeError(r["exceptionDetails"])
        return r["result"].get("value")

    def problems(self) -> list[str]:
        """Console errors and warnings, uncaught exceptions and CSP violations seen so far on this page."""
        out = list(self.eval("window.__problems") or [])
        for e in self.browser.events:
            if e.get("sessionId") != self.session:
                continue
            p = e.get("params") or {}
            if e["method"] == "Runtime.exceptionThrown":
                out.append(f"exception: {p.get('exceptionDetails', {}).get('text')}")
            elif e["method"] == "Runtime.consoleAPICalled" and p.get("type") in ("error", "warning", "assert"):
                out.append(f"console.{p['type']}: {[a.get('value') for a in p.get('args', [])]}")
            elif e["method"] == "Log.entryAdded" and p.get("entry", {}).get("level") in ("error", "warning"):
                out.append(f"log: {p['entry'].get('text')}")
        return out

    def overflowing(self) -> dict:
        return self.eval(OVERFLOW)

    def smallest_chart_text(self) -> float | None:
        return self.eval(CHART_TEXT)

    def clipped_chart_text(self) -> list[str]:
        return self.eval(CHART_CLIPPED)

    def screenshot(self, out: Path, *, width: int, height: int) -> None:
        shot = self.browser.send("Page.captureScreenshot", self.session, format="png", captureBeyondViewport=True,
                                 clip={"x": 0, "y": 0, "width": width, "height": height, "scale": 1})
        Path(out).write_bytes(base64.b64decode(shot["data"]))

    def pdf(self, paper: str = "a4") -> bytes:
        """The page printed (A4 or Letter, backgrounds on), as Chromium's print-to-PDF makes it."""
        width, height = PAPER[paper]
        r = self.browser.send("Page.printToPDF", self.session, printBackground=True, paperWidth=width,
                              paperHeight=height)
        return base64.b64decode(r["data"])

    def split_words(self, selector: str) -> list[str]:
        """The words inside `selector` that the current layout draws across a line break (see SPLIT_WORDS)."""
        return self.eval(f"{SPLIT_WORDS}({json.dumps(selector)})")

    def emulate_print(self, paper: str) -> None:
        """Lay the page out as printed on `paper`: print media, as wide as the paper inside print-to-PDF's margins."""
        width = round((PAPER[paper][0] - 2 * PDF_MARGIN) * 96)
        self.browser.send("Emulation.setDeviceMetricsOverride", self.session, width=width, height=1000,
                          deviceScaleFactor=1, mobile=False)
        self.browser.send("Emulation.setEmulatedMedia", self.session, media="print")

    def close(self) -> None:
        self.browser.send("Target.closeTarget", targetId=self.target)


def pdf_text(pdf: bytes) -> str:
    """The text of a PDF, as poppler's pdftotext reads it."""
    return subprocess.run(["pdftotext", "-enc", "UTF-8", "-", "-"], input=pdf, capture_output=True, check=True).stdout.decode()


def pdf_pages(pdf: bytes) -> list[str]:
    """The text of each page of a PDF (pdftotext ends every page with a form feed)."""
    return pdf_text(pdf).split("\f")[:-1]
