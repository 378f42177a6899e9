"""The closed vocabularies of the analysis, as string enums.

Each member *is* its string (`Phase.FORWARD == "forward"`), so JSON, templates and
comparisons with plain strings keep working; what the enum adds is one place that
lists the values and a loud failure on a typo (`Phase("fwd")` raises).
Values are part of the JSON contract: members are only ever added, never renamed.
"""

from __future__ import annotations

from enum import Enum

try:
    from enum import StrEnum
except ImportError:  # Python 3.10
    class StrEnum(str, Enum):  # type: ignore[no-redef]
        def __str__(self) -> str:
            return str(self.value)


class Phase(StrEnum):
    FORWARD = "forward"  # the model's forward and the loss
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"  # inside optimizer.step()


class Role(StrEnum):
    LITERAL = "literal"  # the non-finite value came from a constant argument
    ORIGIN = "origin"  # finite inputs, non-finite output
    CONVERSION = "conversion"  # Inf in, NaN out
    PROPAGATION = "propagation"


class Kind(StrEnum):
    NAN = "nan"
    INF = "inf"


class Verdict(StrEnum):
    CULPRIT_FOUND = "culprit_found"
    NONFINITE_INPUT = "nonfinite_input"
    NONFINITE_PARAMETERS = "nonfinite_parameters"
    NOT_REPRODUCED = "not_reproduced"
    GRADIENT_CUT = "gradient_cut"  # no backward path from the loss to a parameter whose value reaches it
    GRADIENT_ZERO = "gradient_zero"  # a backward node turns a non-zero gradient into exact zeros
    GRADIENT_VANISHED = "gradient_vanished"  # a module's share of the gradient norm collapsed (not to zero)


class Trigger(StrEnum):
    """What made the guard write a snapshot."""

    LOSS = "loss"  # the loss was NaN/Inf
    GRADIENT = "gradient"  # a gradient was NaN/Inf with a finite loss
    GRAD_NORM_OVERFLOW = "grad_norm_overflow"  # every gradient finite, their float32 norm is not
    GRAD_SPIKE = "grad_spike"  # a finite gradient-norm spike
    UPDATE = "update"  # optimizer.step() made the weights NaN/Inf
    NO_GRADIENT = "no_gradient"  # a trained parameter's value reaches the loss, its gradient never came (None/zero)
    GRADIENT_DIED = "gradient_died"  # the same for a parameter that had gradients on earlier steps
    GRADIENT_VANISHED = "gradient_vanished"  # a module's share of the gradient norm collapsed (not to zero)


class FixKind(StrEnum):
    EPSILON = "epsilon"
    CLAMP = "clamp"
    LOG_SOFTMAX = "log_softmax"
    LOGSIGMOID = "logsigmoid"
    XLOGY = "xlogy"
    BCE_WITH_LOGITS = "bce_with_logits"
    MAX_SUBTRACTION = "max_subtraction"
    FINITE_MASK_VALUE = "finite_mask_value"
    DOUBLE_WHERE = "double_where"
    CORRECTION = "correction"
    BF16_OR_GRAD_SCALER = "bf16_or_grad_scaler"
    LOWER_LR_CLIP_GRADS = "lower_lr_clip_grads"
    CLEAN_INPUT = "clean_input"
    RESTORE_PARAMETERS = "restore_parameters"
    GUARD_EMPTY_REDUCTION = "guard_empty_reduction"
    REMOVE_CUT = "remove_cut"  # a detach / no_grad / .data copy on a parameter's path to the loss (diagnose/flow.py)
    STRAIGHT_THROUGH = "straight_through"
    UNFREEZE = "unfreeze"
    LEAKY_RELU = "leaky_relu"
    LOGITS = "logits"
    CHECK_MULTIPLIER = "check_multiplier"
    SOFTMAX_DIM = "softmax_dim"
    USE_REENTRANT_FALSE = "use_reentrant_false"
    OPTIMIZER_EPS = "optimizer_eps"  # an eps the dtype can represent, or float32 master weights
    NORMALIZE_INPUT = "normalize_input"
    STABLE_VARIANCE = "stable_variance"  # torch.var instead of E[x²] − E[x]²
    RESTORE_OPTIMIZER_STATE = "restore_optimizer_state"  # the optimizer state itself is NaN/Inf
    LR_SCHEDULE = "lr_schedule"  # the learning rate (a scheduler's) is NaN/Inf
    OPTIMIZER_IMPLEMENTATION = "optimizer_implementation"  # foreach/fused path differs from the single-tensor one
    COMPILER = "compiler"  # a compiled region changed (wider dtype, compiler.disable, backend): differential/compiler.py
    REFERENCE_BACKEND = "reference_backend"  # a fused kernel forced to its reference composition (differential/kernel.py)
    SOFTPLUS = "softplus"  # log(1 + exp(x)) -> F.softplus(x) (diagnose/forms.py)
    LOG1MEXP = "log1mexp"  # log(1 - exp(x)) -> log(-expm1(x))
    ZERO_INFINITY = "zero_infinity"  # ctc_loss(..., zero_infinity=True), or filter infeasible samples
    FINITE_FACTOR = "finite_factor"  # 0 * inf: the infinite factor (log p at p = 0) kept at finfo's range
    MASK_ROWS = "mask_rows"  # the remedy is in the data: leave out the rows where the quantity is undefined
    LOGADDEXP = "logaddexp"  # log(cosh(x)) -> logaddexp(x, -x) - log(2) (diagnose/forms.py)
    EIGENSPACE = "eigenspace"  # a loss on eigenvectors of a repeated eigenvalue: make it a function of the eigenspace
    LOG_TARGET = "log_target"  # kl_div(input, softmax(z)) -> kl_div(input, log_softmax(z), log_target=True)
    SUM_OF_LOGS = "sum_of_logs"  # log(prod(p, d)) -> log(p).sum(d): a product of probabilities that underflowed
    POSITIVE_DEFINITE = "positive_definite"  # logdet of a matrix that is not positive definite: build it as L Lᵀ
    FLOAT32_SOFTMAX = "float32_softmax"  # a float16 product in float32 up to its softmax (diagnose/edits/upcast.py)
    POSITIVE_PARAMETRISATION = "positive_parametrisation"  # relu(z) -> softplus(z) where a positive value is made
    NON_SATURATING = "non_saturating"  # a gradient vanishing from the first step: ReLU/GELU + Kaiming init, or norms
    NONE = "none"
