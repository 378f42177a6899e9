"""Which rule answers when several match: the registry's dispatch order, pinned.

More than one rule can claim a culprit (a log whose result where() picks from is both the where
trap and a log of zero); the first in dispatch order wins. A change to this list changes
diagnoses, so it must be deliberate.
"""

from __future__ import annotations

from nanreplay import diagnose

DISPATCH_ORDER = [
    "nonfinite_lr",  # the optimizer family (phase "optimizer" only) answers first for every update culprit
    "nonfinite_optimizer_state",
    "optimizer_eps",
    "update_overflow",
    "optimizer_kernel_path",
    "optimizer_update",
    "bce_saturated",
    "logsigmoid",
    "log_softmax",
    "zero_times_log_zero",
    "xlogy_at_zero",  # the reformulation table's rows (diagnose/forms.py): an exact form before any ε
    "log1mexp",
    "where_trap",
    "eigh_degenerate",
    "logdet_not_positive_definite",  # the NaN constant of torch.logdet's where over slogdet's sign
    "logsumexp_underflow",
    "log_of_product_underflow",  # log(p.prod(d)) -> log(p).sum(d), before the ε of log_of_zero
    "exp_underflow",
    "log_of_zero",
    "kl_div_target_zero",  # an xlogy too: kl_div's target carried the gradient (before the support edge's clamp)
    "log_prob_at_support_edge",
    "log_of_negative",
    "sqrt_cancellation",
    "sqrt_of_negative",
    "sqrt_at_zero",
    "pow_of_negative",
    "pow_at_zero",
    "acos_asin_boundary",
    "std_single_element",
    "ratio_to_zero_target",
    "masked_mean_empty",
    "empty_reduction",
    "normalize_zero_norm",
    "zero_scalar_divisor",  # a divisor that is a Python 0 (no tensor statistics): division_by_zero never sees it
    "division_by_zero",
    "logcosh",
    "softplus",
    "segment_softmax",
    "log_ratio_of_exps",
    "handwritten_softmax",
    "exp_overflow",
    "label_smoothing_masked",
    "constant_overflow",
    "zero_times_inf",
    "mask_value_sign",
    "softmax_all_masked",
    "training_diverged",
    "magnitude_overflow",
    "fp16_overflow",
    "ctc_infeasible",
    "exploded_weights",
    "huge_values",
    "domain_edge",
    "unrecognised",
]


def test_dispatch_order_is_pinned():
    assert [r.cause for r in diagnose.RULES] == DISPATCH_ORDER


def test_a_culprit_two_rules_claim_gets_the_earlier_rule(analyzed, monkeypatch):
    """where(h > 0, log(h), 0): the log's backward divides by h = 0. Both where_trap and log_of_zero
    answer for that site; where_trap comes first, so it is the diagnosis (its fix is the double where)."""
    sites = []
    real = diagnose.diagnose

    def spy(result, subject, step, c, chain, **kw):
        sites.append(diagnose.Site(step, step.events[c], chain, subject))
        return real(result, subject, step, c, chain, **kw)

    monkeypatch.setattr(diagnose, "diagnose", spy)
    d = analyzed("where_trap", verify=False)
    (site,) = sites
    claims = [r.cause for r in diagnose.RULES
              if (not r.ops or site.packet in r.ops or site.op_packet in r.ops) and r.fn(site) is not None]
    assert "where_trap" in claims and "log_of_zero" in claims
    assert claims.index("where_trap") < claims.index("log_of_zero")
    assert d["diagnosis"]["cause"] == claims[0] == "where_trap"
