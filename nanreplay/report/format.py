"""How the report writes values for people: numbers, shapes, module names, source locations, op names.

Pure functions of their arguments, shared by every section's view builder and the
terminal summary. The few a template may call sit in one dict, `TEMPLATE_GLOBALS`.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanreplay.numbers import NONFINITE_TEXT, num  # noqa: F401 - the views import num from here


def to_float(x: Any) -> float | None:
    """A JSON number or one of stats.jsonable's strings ("nan", "inf", "-inf") as a float; else None."""
    if isinstance(x, bool) or x is None:
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, str) and x in NONFINITE_TEXT:
        return float(x)
    return None


def sort_key(x: Any, *, missing: float = -math.inf) -> str:
    """A value the page's table sorter parses with parseFloat: NaN sorts as the worst (largest)."""
    f = to_float(x)
    if f is None:
        f = missing
    if math.isnan(f):
        return "Infinity"
    if math.isinf(f):
        return "Infinity" if f > 0 else "-Infinity"
    return repr(f)


def fmt_shape(s: Any) -> str:
    if s is None:
        return "—"
    if isinstance(s, (list, tuple)):
        return "scalar" if not s else "×".join(str(d) for d in s)
    return str(s)


ROOT_LABEL = "(the model)"  # the root module, "" in the JSON: the model's own forward, outside any submodule
LOSS_LABEL = "(the loss)"  # "<loss>" in the JSON: the loss function after the model


def module_label(m: str | None, model_class: str | None = None) -> str:
    """A module path for people: the root module and the loss function are named, not written as `<root>`."""
    if m is None:
        return "(outside any module)"
    if m == "":
        return f"{model_class} (the model)" if model_class else ROOT_LABEL
    if m == "<loss>":
        return LOSS_LABEL
    return m


def module_short(m: str | None) -> str:
    """module_label without the model's class: for chart axes and narrow cells."""
    return module_label(m)


def loss_name(d: dict) -> tuple[str | None, bool]:
    """(the loss's name, whether the user named it with --loss on this command line; else the snapshot did)."""
    given = (d.get("invocation") or {}).get("loss")
    return (given or (d.get("model") or {}).get("loss")), bool(given)


def where(src: dict | None) -> str:
    return f"{src.get('file')}:{src.get('line')}" if src else ""


def short_where(src: dict | None) -> str:
    """`file.py:12`: the file's name only."""
    return f"{Path(str(src.get('file'))).name}:{src.get('line')}" if src else ""


def op_base(op: str | None) -> str:
    """'aten.div.Tensor' -> 'div', 'aten.mul_.Tensor' -> 'mul'."""
    if not op:
        return ""
    parts = op.split(".")
    base = parts[1] if parts[0] == "aten" and len(parts) > 1 else parts[0]
    return base.rstrip("_") or base


def kind_of_value(x: Any) -> str:
    """How a non-finite number is spelled everywhere (HTML, terminal, Markdown): NaN, +Inf, −Inf; '' when finite."""
    f = to_float(x)
    if f is None or math.isfinite(f):
        return ""
    return num(f)


def kind_text(kind: str | None, out: dict | None = None) -> str:
    """'nan' -> 'NaN'; 'inf' -> '+Inf' / '−Inf' when the output's counts say which, else 'Inf'."""
    if kind == "nan":
        return "NaN"
    if kind == "inf" and out:
        pos, neg = out.get("posinf", 0), out.get("neginf", 0)
        if pos and not neg:
            return "+Inf"
        if neg and not pos:
            return "−Inf"
    return "Inf" if kind == "inf" else (kind or "non-finite")


# torch.finfo(dtype).max, written out: rendering needs no torch (a confined analysis is rendered from its JSON)
_DTYPE_MAX = {"float16": 65504.0, "half": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38,
              "float": 3.4028234663852886e38, "float64": 1.7976931348623157e308, "double": 1.7976931348623157e308,
              "float8_e4m3fn": 448.0, "float8_e4m3fnuz": 240.0, "float8_e5m2": 57344.0, "float8_e5m2fnuz": 57344.0}


def dtype_max(dtype: str | None) -> float | None:
    """The largest finite value of a floating torch dtype named by its string ('float16'); else None."""
    return _DTYPE_MAX.get(dtype or "")


def numel(shape: Any) -> int | None:
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) for d in shape):
        return None
    return math.prod(shape)


FIX_LABELS = {
    "epsilon": "add an epsilon", "clamp": "clamp the input", "log_softmax": "use log_softmax",
    "logsigmoid": "use logsigmoid", "xlogy": "use xlogy", "bce_with_logits": "use BCE with logits",
    "max_subtraction": "subtract the max first", "finite_mask_value": "a finite mask value",
    "double_where": "the double-where trick", "correction": "std/var correction", "bf16_or_grad_scaler": "bf16 or GradScaler",
    "lower_lr_clip_grads": "lower LR, clip gradients", "clean_input": "clean the input batch",
    "restore_parameters": "restore the weights", "guard_empty_reduction": "guard the empty reduction", "none": "no fix",
    "compiler": "change the compiled region", "softplus": "use softplus", "log1mexp": "use log(-expm1(x))",
    "zero_infinity": "CTC zero_infinity (or filter)", "mask_rows": "mask the rows (in the data)",
    "float32_softmax": "scores and softmax in float32",
    "positive_parametrisation": "a positive parametrisation (softplus)",
    "non_saturating": "non-saturating activations (or normalisation)",
}


def fix_label(kind: str | None) -> str:
    """A fix kind (JSON identifier) as words: 'bf16_or_grad_scaler' -> 'bf16 or GradScaler'."""
    return FIX_LABELS.get(kind or "", (kind or "").replace("_", " "))


@dataclass
class Seg:
    """A piece of prose: plain text, or code (what the prose wrote between backticks)."""

    text: str
    code: bool = False


_TICKS = re.compile(r"`([^`\n]+)`")


def segments(text: str) -> list[Seg]:
    """Prose with `code` spans as segments: the page shows them as code, never as raw backticks."""
    out: list[Seg] = []
    pos = 0
    for m in _TICKS.finditer(text or ""):
        if m.start() > pos:
            out.append(Seg(text[pos:m.start()]))
        out.append(Seg(m.group(1), True))
        pos = m.end()
    if pos < len(text or ""):
        out.append(Seg(text[pos:]))
    return out


def plain(text: str) -> str:
    """Prose without its backticks: for the terminal."""
    return "".join(s.text for s in segments(text))


_SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)(?<!\bvs)(?<!\betc)\.\s+(?=\S)")


def first_sentence(text: str) -> tuple[str, str]:
    """(the first sentence, the rest) of a paragraph."""
    text = (text or "").strip()
    m = _SENTENCE_END.search(text)
    if not m:
        return text, ""
    return text[:m.start() + 1], text[m.end():].strip()


# A number with a minus sign in it (1e-10, -2.5): a browser may break a line after the '-'; it must stay whole.
_SCI = re.compile(r"(?<![\w.])(?:-\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|\d+(?:\.\d+)?[eE]-\d+)\b")
CODE_BREAKS = "/_.,(="  # where a code line may wrap: after one of these, never inside a word
PATH_BREAKS = "/_"  # a file name: after a folder or between words, not before its extension


def breakable(text: object, *, at: str = CODE_BREAKS):
    """`text` as markup that wraps where a reader expects: after a character of `at` (a `<wbr>`, which copying
    ignores; "" for prose) and never inside a number like `1e-10` (kept on one line). Escaped like every
    printed value."""
    from markupsafe import Markup, escape

    from nanreplay.sanitize import cap, html_visible

    s = cap(html_visible(str(text)))  # what every other printed value gets (html.py's finalize skips markup)
    out, pos = [], 0
    for m in _SCI.finditer(s):
        out.append(_wbr(s[pos:m.start()], at))
        out.append(Markup('<span class="nobr">') + escape(m.group()) + Markup("</span>"))
        pos = m.end()
    out.append(_wbr(s[pos:], at))
    return Markup("").join(out)


@functools.lru_cache(maxsize=8)
def _break_after(at: str) -> re.Pattern:
    chars = re.escape(at)
    return re.compile(f"(?<=[{chars}])(?=[^\\s{chars})\\d])")


def _wbr(part: str, at: str):
    from markupsafe import Markup, escape

    if not at:
        return escape(part)
    return Markup("<wbr>").join(escape(p) for p in _break_after(at).split(part))



MAX_PIECE = 40  # characters: a longer run without a "/" (a 200-character folder name) still wraps, in pieces of this


def code_words(line: str) -> list[list[str]]:
    """A line of a command or of code as the words it may wrap between, each word as its unbreakable pieces.

    Words are split at spaces outside quotes, so an argument never wraps inside (`--json`, a quoted path
    with spaces): a browser would otherwise break after the hyphens of `--json`, and a printed `--`/`json`
    reads as two arguments. A word breaks further only after a `/` (a long path), and a run longer than
    `MAX_PIECE` in pieces of that length. The words joined with single spaces, their pieces with nothing,
    give the line back.
    """
    words, word, quote = [], "", ""
    for ch in line:
        if ch == " " and not quote:
            words.append(word)
            word = ""
            continue
        word += ch
        if ch in "'\"" and quote in ("", ch):
            quote = "" if quote else ch
    words.append(word)
    return [_pieces(w) for w in words]


def _pieces(word: str) -> list[str]:
    parts = [p for p in re.split(r"(?<=/)", word) if p] or [""]
    return [p[i:i + MAX_PIECE] for p in parts for i in range(0, max(len(p), 1), MAX_PIECE)]


TEMPLATE_GLOBALS: dict[str, Any] = {"num": num, "fmt_shape": fmt_shape, "code_words": code_words,
                                    "breakable": breakable}
