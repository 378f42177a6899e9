"""Unstable compositions and their exact forms, as one table: composition -> stable form -> how people write it.

Read by the rules (rules/forms.py and the older stable-form rules in rules/logs.py and rules/softmax.py take
their fix kind and their reasoning from their row), by the fixes (the stable form is what a row's patch computes
and what its rewrite shows) and by the tests (tests/diagnose/test_forms_table.py drives every row to its failure
with a small fixture, tests/forms_cases.py, and checks that the exact form is offered first, verifies by replay
and is the code shown). Where a row has an exact form it is preferred over any ε: an ε changes the maths where
the value is extreme (a mixture-density loss's outlier gets a capped loss and no gradient); the exact form does
not. A row whose remedy is in the data (`exact` empty) says so: no ε can verify a quantity that is undefined.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanreplay.enums import FixKind


@dataclass(frozen=True)
class Form:
    unstable: str  # the composition, as people think of it
    exact: str  # its stable form ("" where the only remedy is in the data)
    kind: FixKind  # the fix kind a diagnosis of this row reports
    cause: str  # the rule (cause) that answers for it
    patterns: tuple[str, ...]  # how people write it: functional, method, operator, in-place, with weights
    why: str  # why the stable form is exact where the composition is not

    @property
    def in_data(self) -> bool:
        return not self.exact


TABLE: dict[str, Form] = {
    "softplus": Form(
        "log(1 + exp(x))", "F.softplus(x)", FixKind.SOFTPLUS, "softplus",
        ("torch.log(1 + torch.exp(x))", "(1 + x.exp()).log()", "torch.log1p(torch.exp(x))", "x.exp().log1p()",
         "torch.log(torch.exp(x) + 1)"),
        "softplus(x) = max(x, 0) + log1p(exp(-|x|)): exact for every x, where exp(x) overflows above ~88 in "
        "float32 (a clamp of x changes the value there)"),
    "logsumexp": Form(
        "log(sum(w * exp(a)))", "torch.logsumexp(a + torch.log(w), dim)", FixKind.MAX_SUBTRACTION,
        "logsumexp_underflow",
        ("torch.log(torch.exp(a).sum(d))", "torch.log((w * torch.exp(a)).sum(d))", "torch.log(torch.sum(pi * "
         "torch.exp(-0.5 * z ** 2) / sigma, d))"),
        "logsumexp subtracts the maximum first: every term is ≤ 1 and at least one is 1, so the sum neither "
        "underflows to 0 (log(0) = -inf) nor overflows; an ε inside the log instead caps the loss of the sample "
        "that underflowed and removes its gradient"),
    "log_ratio_of_exps": Form(
        "log(exp(a) / sum(exp(S))), a softmax entry written with exps (NT-Xent / InfoNCE)",
        "a - torch.logsumexp(S, dim)", FixKind.LOG_SOFTMAX, "log_ratio_of_exps",
        ("-torch.log(torch.exp(a) / torch.exp(S).sum(d))", "pos = torch.exp(a); neg = torch.exp(S).sum(d); "
         "-torch.log(pos / neg)"),
        "a - logsumexp(S) is log(exp(a) / sum(exp(S))) for every input; the exps overflow above ~88 in float32 "
        "(inf / inf = NaN), and a max subtracted in one exp leaves the other overflowing"),
    "logcosh": Form(
        "log(cosh(x)), the log-cosh loss", "torch.logaddexp(x, -x) - log(2)", FixKind.LOGADDEXP, "logcosh",
        ("torch.log(torch.cosh(pred - y))", "(pred - y).cosh().log()"),
        "cosh(x) overflows float32 above |x| ≈ 89 while log(cosh(x)) ≈ |x| - log 2 is small; logaddexp(x, -x) "
        "subtracts the larger exponent first, exact for every x (a clamp of x caps the loss of an outlier)"),
    "log_softmax": Form(
        "log(softmax(x))", "torch.log_softmax(x, dim)", FixKind.LOG_SOFTMAX, "log_softmax",
        ("torch.log(torch.softmax(x, d))", "x.softmax(d).log()", "F.softmax(x, d).log_()"),
        "log_softmax computes x - logsumexp(x) directly, so it never takes log(0)"),
    "logsigmoid": Form(
        "log(sigmoid(x))", "F.logsigmoid(x)", FixKind.LOGSIGMOID, "logsigmoid",
        ("torch.log(torch.sigmoid(x))", "x.sigmoid().log()"),
        "logsigmoid(x) = -softplus(-x) is exact for any x"),
    "log1mexp": Form(
        "log(1 - exp(x)), x ≤ 0", "torch.log(-torch.expm1(x))", FixKind.LOG1MEXP, "log1mexp",
        ("torch.log1p(-torch.exp(x))", "torch.log(1 - torch.exp(x))", "(1 - x.exp()).log()"),
        "expm1(x) keeps every digit of exp(x) - 1 near x = 0, where exp(x) rounds to exactly 1 (below one "
        "rounding step of the dtype) and 1 - exp(x) to 0"),
    "xlogy": Form(
        "x * log(y) with x = 0 where y = 0", "torch.special.xlogy(x, y)", FixKind.XLOGY, "xlogy_at_zero",
        ("x * torch.log(y)", "torch.log(y) * x", "x * y.log()"),
        "xlogy(x, y) = x*log(y) with 0 where x == 0 (a Beta or Bernoulli log-density at the support's edge)"),
    "xlog1py": Form(
        "x * log1p(y) with x = 0 where y = -1", "torch.special.xlog1py(x, y)", FixKind.XLOGY, "xlogy_at_zero",
        ("x * torch.log1p(y)", "x * torch.log1p(-a)  # a Beta policy's (b - 1) * log(1 - a) at a = 1"),
        "xlog1py(x, y) = x*log1p(y) with 0 where x == 0"),
    "zero_times_inf": Form(
        "p * log p with log p = -inf where p = 0 (an entropy over masked logits)",
        "p * logp.clamp_min(torch.finfo(logp.dtype).min)", FixKind.FINITE_FACTOR, "zero_times_inf",
        ("(torch.exp(logp) * logp).sum(-1)", "(p * torch.log_softmax(masked_logits, -1)).sum(-1)",
         "logp.exp() * logp"),
        "p * log p is 0 at p = 0 by definition; a finite log there (the dtype's most negative value) gives 0 and a "
        "gradient of 0, and changes no other value. xlogy(p, p) and special.entr(p) give 0 too, but their gradient "
        "at p = 0 is 0/0 or inf, which reaches the logits whenever p carries a gradient"),
    "bce_with_logits": Form(
        "-(y log sigmoid(z) + (1 - y) log(1 - sigmoid(z)))", "F.binary_cross_entropy_with_logits(z, y)",
        FixKind.BCE_WITH_LOGITS, "bce_saturated",
        ("-(y * torch.log(p) + (1 - y) * torch.log(1 - p)) with p = torch.sigmoid(z)",
         "F.binary_cross_entropy(torch.sigmoid(z), y)"),
        "binary_cross_entropy_with_logits uses log(sigmoid(z)) = -softplus(-z), exact for any logit"),
    "segment_softmax": Form(
        "exp(x) / (sum of exp(x) per segment)[index]",
        "exp(x - m[index]) / ..., m = per-segment max (scatter_reduce 'amax'), as torch_geometric.utils.softmax",
        FixKind.MAX_SUBTRACTION, "segment_softmax",
        ("e = x.exp(); den = torch.zeros(n).index_add(0, index, e); e / den[index]",
         "den = torch.zeros(n).scatter_add(0, index, e)", "den = torch.zeros(n).scatter_reduce(0, index, e, 'sum')"),
        "subtracting each segment's own maximum keeps every exp ≤ 1 and each segment's sum ≥ 1; a maximum over "
        "dim=-1 (all edges) lets a segment far below it underflow to 0/0"),
    "finite_mask": Form(
        "masked_fill(mask, -inf) then softmax over a row with no allowed position", "masked_fill(mask, "
        "torch.finfo(dtype).min), where the mask is made", FixKind.FINITE_MASK_VALUE, "softmax_all_masked",
        ("scores.masked_fill(pad, float('-inf'))", "torch.zeros(shape).masked_fill(pad, -math.inf) added in every "
         "layer", "torch.where(mask, scores, float('-inf'))"),
        "finfo(dtype).min behaves like -inf for every row that has an allowed position, and keeps a fully masked "
        "row finite; fixed where the mask is made, every layer that uses it is fixed"),
    "ctc_infeasible": Form(
        "ctc_loss with a target that needs more frames than the input has", "F.ctc_loss(..., zero_infinity=True)",
        FixKind.ZERO_INFINITY, "ctc_infeasible",
        ("F.ctc_loss(log_probs, targets, input_lengths, target_lengths)", "nn.CTCLoss()(log_probs, targets, ...)"),
        "no alignment exists (target length plus its repeats > input length): the loss is +inf by definition; "
        "zero_infinity=True drops those samples' loss and gradient, or filter them from the batch"),
    "log_of_product": Form(
        "log(prod(p, d)), the likelihood of many independent events", "torch.log(p).sum(d)", FixKind.SUM_OF_LOGS,
        "log_of_product_underflow",
        ("torch.log(p.prod(d))", "likelihood = p.prod(dim=d); -torch.log(likelihood)", "torch.log(torch.prod(p, d))"),
        "log(p1 * ... * pn) = log(p1) + ... + log(pn) for positive p; the product of a hundred probabilities near "
        "1/3 is below float32's smallest number and rounds to 0 (log(0) = -inf), while each log is moderate. An "
        "ε inside the log caps that sample's loss at -log(ε), takes away its gradient, and moves every product "
        "that is small but not 0"),
    "ratio_to_zero_target": Form(
        "|pred - y| / |y| with y = 0 (MAPE, a relative error)", "", FixKind.MASK_ROWS, "ratio_to_zero_target",
        ("((pred - y).abs() / y.abs()).mean()", "torch.mean(torch.abs((y - pred) / y))"),
        "a relative error is undefined at a target of 0: no ε gives it a value; mask those rows (or use a loss "
        "defined there: MAE, sMAPE)"),
}


def row(name: str) -> Form:
    return TABLE[name]
