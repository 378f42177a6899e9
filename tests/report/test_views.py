"""What the report's reader trips over (issue 15), checked on the view models and the rendered page:
contradictions, named culprit inputs, the gradient table, the charts, jargon, the environment, the terminal."""

from __future__ import annotations

import copy
import math
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from nanreplay import report
from nanreplay.analysis import analyze
from nanreplay.analysis.arguments import input_roles, tensor_arg_names
from nanreplay.report import charts
from nanreplay.report.format import first_sentence, op_base, segments
from nanreplay.report.views.chain import ROLES
from samples import EXPECTED, SAMPLES, flags, names

_cache: dict[str, dict] = {}


def sample(name: str) -> dict:
    """A sample's analysis JSON, analyzed once per session; tests change deep copies."""
    if name not in _cache:
        _cache[name] = analyze(SAMPLES / f"{name}.pt", **flags(name)).to_json()
    return copy.deepcopy(_cache[name])


def view(d: dict) -> report.ReportView:
    return report.build_view(d, report.gather_sources(d))


class Text(HTMLParser):
    """The text a reader sees (script and style bodies left out), and the text of prose paragraphs."""

    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skip = 0
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        self._skip += tag in ("script", "style")

    def handle_endtag(self, tag):
        self._skip -= tag in ("script", "style")

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)

    @property
    def text(self) -> str:
        return re.sub(r"\s+", " ", " ".join(self.parts))


def page_text(d: dict) -> str:
    return Text(report.render_html(d)).text


# ------------------------------------------------------------------ no sentence its own tables contradict


def test_the_precision_sentence_is_written_from_the_table_it_sits_under():
    d = sample("fp16_overflow")
    wrong = ("Precision probe: the same step is finite in float32, float64 but not in float64 — a precision/range "
             "problem, not a math domain error.")
    right = d["diagnosis"]["precision"]
    d["diagnosis"]["precision"] = wrong  # what the diagnosis said before it was fixed at the source
    d["diagnosis"]["explanation"] = d["diagnosis"]["explanation"].replace(right, "").rstrip() + " " + wrong
    v = view(d)
    ok = [r[0].text for r in v.precision.rows if r[3].text == "finite"]
    assert ok and "float64" in ok
    # fc2's weights grew: every finite row's loss is far beyond the run's history, and the rows say so
    assert "magnitude problem" in v.precision.sentence and all(t in v.precision.sentence for t in ok)
    text = page_text(d)
    assert "but not in float64" not in text  # the diagnosis' copy is not shown anywhere on the page
    assert "precision" not in v.banner.explanation.lower()
    d = sample("sqrt_zero")
    assert "non-finite in float64 too" in view(d).precision.sentence


@pytest.mark.parametrize("name", ["sqrt_zero", "log_zero"])
def test_a_precision_row_stopped_at_the_culprit_says_so_instead_of_a_blank_count(name):
    """The probe stops at the culprit (in backward for sqrt at 0, in forward for log(0)): the row shows what
    was not reached, never '— non-finite'."""
    rows = {r[0].text: [c.text for c in r] for r in view(sample(name)).precision.rows}
    f64 = rows["float64"]
    assert "—" not in " ".join(f64) and f64[3] == "non-finite"
    if name == "sqrt_zero":
        assert f64[2] == "non-finite (stopped at the culprit)"
    else:
        assert f64[1] == "not reached (stopped at the culprit)" and f64[2] == "not run (the loss is non-finite)"


@pytest.mark.parametrize("name", ["sqrt_zero", "log_softmax", "zero_log_zero", "fp16_overflow"])
def test_the_causal_strip_counts_what_the_table_shows_between_its_steps(name):
    ch = view(sample(name)).chain
    rows = [e for g in ch.groups for e in g.events]  # the table's rows, folded runs included, in order
    expected, n = [], 0
    for e in rows:
        if e.failure:
            continue  # the strip's last step stands for it
        if e.role == "propagation" and not e.culprit:
            n += 1
            continue
        if n:
            expected.append(("more", n))
            n = 0
        expected.append(("step", op_base(e.op)))
    if n:
        expected.append(("more", n))
    expected.append(("failure",))
    actual = [("more", int(f.title.split()[0])) if f.role == "more" else ("failure",) if f.role == "failure"
              else ("step", f.title) for f in ch.flow]
    assert actual == expected


def test_the_failure_is_not_counted_as_a_propagation_step():
    ch = view(sample("sqrt_zero")).chain
    table_folded = [len(g.events) for g in ch.groups if g.collapsed]
    more = [int(f.title.split()[0]) for f in ch.flow if f.role == "more"]
    assert table_folded == [6] and more[-1] == 6  # the table folds 6; the strip once said "7"


def test_inf_is_spelled_with_its_sign_everywhere():
    d = sample("log_zero")  # log(0) = -inf, and the loss lam - counts * log(lam) became +inf
    v = view(d)
    assert d["culprit"]["output"]["neginf"] and not d["culprit"]["output"]["posinf"] and d["loss"] == "inf"
    assert "−Inf" in v.banner.headline and v.chain.flow[0].kind == "−Inf"
    assert v.chain.flow[-1].kind == "+Inf" and "the loss became +Inf" in report.terminal_summary(d, None)
    assert [e.kind for g in v.chain.groups for e in g.events][0] == "−Inf"
    d["loss"] = "-inf"
    assert "the loss became −Inf" in report.terminal_summary(d, None)


@pytest.mark.parametrize("name", ["sqrt_zero", "log_zero", "sqrt_negative"])
def test_terminal_and_page_spell_nan_and_inf_the_same_way(name):
    d = sample(name)
    text = report.terminal_summary(d, None) + report.markdown_summary(d)
    assert not re.search(r"\b(NAN|INF)\b", text) and not re.search(r"\b(NAN|INF)\b", page_text(d))
    kind = "NaN" if d["culprit"]["kind"] == "nan" else "Inf"
    assert kind in report.terminal_summary(d, None).split("produced")[1]


# ------------------------------------------------------------------ culprit inputs by name and role


def test_an_addmm_names_bias_activations_and_the_weight():
    d = sample("fp16_overflow")
    st = view(d).stats
    assert [(r.label, r.role) for r in st.rows] == [("self", "bias"), ("mat1", "activations (the layer's input)"),
                                                    ("mat2", "weight (transposed)")]
    weight = st.rows[2]
    assert weight.cells[3].text == "249.9"  # max of the weight: the story of this overflow
    assert d["culprit"]["forward_inputs"] is None and st.forward_rows is None


def test_a_backward_div_names_the_incoming_gradient_and_shows_the_forward_ops_input():
    d = sample("sqrt_zero")
    st = view(d).stats
    assert [(r.label, r.role) for r in st.rows] == [("self", "incoming gradient"),
                                                    ("other", "2·sqrt(x): twice sqrt's output")]
    (x,) = d["culprit"]["forward_inputs"]
    assert (x["arg"], x["role"], x["zeros"]) == ("self", "x: sqrt's input", 1)
    (row,) = st.forward_rows
    zeros = st.columns[1:].index("zeros")
    assert row.cells[zeros].bad and "aten.sqrt.default" in st.forward_title
    # the fix's reasoning quotes |x| up to ...: that x is now on the page
    reasoning = d["diagnosis"]["fix"]["reasoning"]
    quoted = float(re.search(r"\|x\| up to ([0-9.e-]+)", reasoning).group(1))
    assert math.isclose(quoted, x["absmax"], rel_tol=1e-2)
    log = view(sample("log_softmax")).stats
    assert [r.role for r in log.rows] == ["incoming gradient", "x: log's input"] and log.forward_rows


def test_argument_names_follow_the_schema_and_never_guess():
    assert tensor_arg_names("aten.addmm.default", 3) == ["self", "mat1", "mat2"]
    assert tensor_arg_names("aten.convolution.default", 3) == ["input", "weight", "bias"]
    assert tensor_arg_names("aten.convolution.default", 2) == ["input", "weight"]  # bias=None
    assert tensor_arg_names("aten.cat.default", 3) == ["tensors[0]", "tensors[1]", "tensors[2]"]
    assert tensor_arg_names("aten.div.Tensor", 5) == [None] * 5  # does not fit the schema: no names
    assert tensor_arg_names("not.an.op", 2) == [None, None]
    assert input_roles("aten.addmm.default", ["self", "mat1", "mat2"], call="torch.addmm") == [None, None, None]
    assert input_roles("aten.div.Tensor", ["self", "other"]) == ["numerator", "denominator"]


def test_the_second_look_gives_no_answer_rather_than_a_wrong_one():
    from nanreplay.formats import load, rebuild
    from nanreplay.replay.probe import forward_op_inputs

    subject = rebuild(load(SAMPLES / "sqrt_zero.pt"), model=None, loss=None, device=None, trust=False)
    assert forward_op_inputs(subject, 0, "aten.this_is_not_it.default") is None
    assert forward_op_inputs(subject, 10**6, "aten.sqrt.default") is None  # the forward never gets there
    first = forward_op_inputs(subject, 0, _first_op(subject))
    assert first is not None and all("shape" in s for s in first)


def _first_op(subject) -> str:
    from nanreplay import replay

    return str(replay.run_subject(subject).ops[0].op)


# ------------------------------------------------------------------ the per-parameter gradient table


def test_gradient_table_puts_the_failing_parameter_first_and_shows_finite_statistics():
    d = sample("sqrt_zero")
    failing = d["failure"]["name"]
    gt = view(d).gradients
    names_ = [r[0].text for r in gt.rows]
    assert names_[0] == failing and gt.classes[0] == "failing" and gt.failing == failing
    assert set(gt.classes[1:]) == {""}
    by = {r[0].text: r for r in gt.rows}
    partly = [g for g in d["gradients"] if 0 < g["nan"] + g["inf"] < math.prod(g["shape"])]
    assert partly, "a gradient that is partly NaN"
    g = partly[0]
    row = by[g["name"]]
    assert row[3].text.endswith("%") and row[3].bad  # the non-finite fraction
    assert row[4].text == report.num(g["finite_mean"]) and row[4].text != "NaN"  # mean over the finite values
    page = page_text(d)
    assert "NaN NaN NaN" not in page


def test_one_element_gradients_have_no_std_and_shapes_sort_by_size():
    d = sample("fp16_overflow")
    gt = view(d).gradients
    by = {r[0].text: r for r in gt.rows}
    assert by["head.bias"][5].text == "—"  # one element: a std has no value (it used to say 0)
    sizes = {r[1].text: int(r[1].sort) for r in gt.rows}
    assert sizes["64×64"] == 4096 and sizes["64"] == 64 and sizes["1"] == 1


# ------------------------------------------------------------------ charts


def _text_boxes(ch: charts.BarChart) -> list[tuple[str, float]]:
    out = [(b.value, b.value_y) for b in ch.bars if b.value]
    out += [("◆", b.mark_y) for b in ch.bars if b.culprit]
    return out


@pytest.mark.parametrize("name", ["fp16_overflow", "sqrt_zero"])
def test_bar_chart_text_stays_inside_and_off_the_limit_line(name):
    av = view(sample(name)).activations
    for ch in filter(None, (av.chart, av.narrow)):
        for text, y in _text_boxes(ch):
            assert y - charts.FONT >= 0, f"{text!r} cut at the top edge"
            for line in ch.lines:
                assert abs(y - line.y) > charts.FONT / 2 + 1 or y < line.y - charts.FONT, f"{text!r} struck through"
        assert ch.lines and all(line.label_y > line.y - charts.FONT for line in ch.lines)
        assert all(bar.x + bar.w <= ch.right + 0.5 for bar in ch.bars) and ch.width <= charts.WIDTH


def test_bar_labels_number_repeated_calls_and_few_bars_make_a_small_chart():
    av = view(sample("sqrt_zero")).activations
    labels = [b.label for b in av.chart.bars]
    assert len(labels) == len(set(labels)), labels  # encoder.0 twice: "#1", "#2"
    assert "encoder.0 #2" in labels
    two = charts.log_bars([charts.BarItem(1.0, "a", "a"), charts.BarItem(2.0, "b", "b")], {"float32 max": 3.4e38})
    assert two.width < 400 and two.height < 320


def test_wide_charts_get_a_narrow_variant_with_readable_text():
    d = sample("sqrt_zero")
    d["activations"] = [dict(d["activations"][0], module=f"blocks.{i}.mlp") for i in range(80)]
    av = view(d).activations
    assert av.chart.width > charts.NARROW and av.narrow is not None
    assert av.narrow.width <= charts.NARROW and av.narrow.show_labels
    assert view(d).history.narrow.width <= charts.NARROW


def test_history_ticks_are_whole_steps_and_nonfinite_points_are_labelled():
    d = sample("sqrt_zero")
    h = view(d).history
    assert [t.label for t in h.chart.xticks] == ["0", "1", "2", "3"]
    bad = [dot for p in h.chart.panels for dot in p.dots if dot.bad]
    assert bad and bad[0].label.startswith("NaN at step 3")
    assert "non-finite values" in h.caption


# ------------------------------------------------------------------ words for people


@pytest.mark.parametrize("name", names())
def test_no_jargon_on_the_page(name):
    d = sample(name)
    text = page_text(d)
    assert not re.search(r"\bseed\b", text, re.I), "the document is called by its title"
    assert "Debugging Gradients That Misbehave" in text
    assert "<root>" not in text
    v = view(d)
    prose = "".join(s.text for s in v.banner.why + v.banner.details)
    assert "`" not in prose  # backticks became code, not raw markup
    legend = dict(v.chain.legend)
    for role in {e.role for g in v.chain.groups for e in g.events}:
        assert legend[role] == ROLES[role]
    assert not v.banner.headline.startswith("aten.")
    for s in (report.terminal_summary(d, None), report.markdown_summary(d)):
        assert not re.search(r"\bseed\b", s, re.I) and "<root>" not in s


def test_prose_helpers():
    assert [(s.text, s.code) for s in segments("the `sqrt(0).backward()` case")] == [
        ("the ", False), ("sqrt(0).backward()", True), (" case", False)]
    assert first_sentence("log(0) = -inf, e.g. here. sqrt(x) is next.") == ("log(0) = -inf, e.g. here.", "sqrt(x) is next.")


# ------------------------------------------------------------------ environment


def test_environment_shows_the_training_machine_beside_the_replay_machine():
    d = sample("sqrt_zero")
    d["snapshot_info"].update(world_size=8, rank=3)
    d["snapshot_info"]["environment"].update(torch="2.5.1+cu124", device="cuda:3", cuda="12.4")
    env = {r.label: r for r in view(d).environment.machines}
    assert env["torch"].captured == "2.5.1+cu124" and env["torch"].replayed == d["environment"]["torch"]
    assert env["torch"].differs and env["device"].captured == "cuda:3 (12.4)" and env["device"].differs
    assert env["processes"].captured == "rank 3 of 8"
    plain = sample("nan_snapshot_step_3")
    ev = view(plain).environment
    assert "plain state-dict snapshot" in ev.captured_note and {r.captured for r in ev.machines} == {"—"}


# ------------------------------------------------------------------ every sample: no raw identifiers in the banner


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fix_labels_are_words(name):
    b = view(sample(name)).banner
    label = b.fix.label.split(",")[0]
    assert label != b.fix.kind and " " in label  # "bf16 or GradScaler", not bf16_or_grad_scaler


def test_sample_list_is_complete():
    assert set(EXPECTED) | {"nan_snapshot_step_3"} == set(names())
    assert Path(SAMPLES).is_dir()
