"""The whole report as one view model: `build_view()` puts every section's view together.

Compute first, render second (coverage.py's `html.py` is the model): `build_view()`
turns an analysis into view-model dataclasses (every number formatted, every highlight
decided, every chart's geometry computed) and the template only lays them out. It reads
no file: the source lines it quotes come in already read (`nanreplay.report.sources`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from nanreplay.analysis.result import Analysis
from nanreplay.report.sources import Sources
from nanreplay.report.views.anomaly import AnomalyView, anomaly_view
from nanreplay.report.views.banner import Banner, banner
from nanreplay.report.views.chain import ChainView, chain_view
from nanreplay.report.views.charts import ActivationView, HistoryView, activation_view, history_view
from nanreplay.report.views.compiler import CompilerView, compiler_view
from nanreplay.report.views.environment import (
    EnvironmentView,
    PrecisionView,
    ReproduceView,
    environment_view,
    precision_view,
    reproduce_view,
)
from nanreplay.report.views.kernel import KernelView, kernel_view
from nanreplay.report.views.machine import MachineView, machine_view
from nanreplay.report.views.source import SourceView, source_view
from nanreplay.report.views.tables import (
    GradTable,
    LeavesTable,
    ShapeTable,
    StatsView,
    gradient_table,
    leaves_table,
    shape_table,
    stats_view,
)


@dataclass
class Section:
    id: str
    title: str


@dataclass
class ReportView:
    title: str
    verdict: str
    banner: Banner
    warnings: list[str]
    anomaly: AnomalyView
    source: SourceView | None
    chain: ChainView | None
    stats: StatsView | None
    leaves: LeavesTable | None
    activations: ActivationView | None
    gradients: GradTable | None
    shapes: ShapeTable | None
    history: HistoryView | None
    precision: PrecisionView | None
    environment: EnvironmentView
    reproduce: ReproduceView
    compiler: CompilerView | None = None  # differential.compiler: the step replayed compiled
    machine: MachineView | None = None  # the guard's re-run beside the training step (differential/machine.py)
    kernel: KernelView | None = None  # the kernel differential: under the verdict where it decides the diagnosis
    sections: list[Section] = field(default_factory=list)
    index: str = ""  # a link back to the triage index this report belongs to ("" when it stands alone)


def build_view(a: Analysis | dict, sources: Sources, *, index: str = "") -> ReportView:
    """Everything the page shows, computed: the template only lays this out.

    `sources` is what `gather_sources()` read for this analysis; a source it lacks is
    shown as the line recorded at replay time. `index` links the page back to a triage
    index (a relative URL).
    """
    d = a.to_json() if isinstance(a, Analysis) else a
    v = ReportView(
        title=f"nanreplay: {Path(str(d.get('snapshot') or 'snapshot')).name}",
        verdict=d["verdict"],
        banner=banner(d),
        warnings=[str(w) for w in d.get("warnings") or []],
        anomaly=anomaly_view(d),
        source=source_view(d, sources),
        chain=chain_view(d),
        stats=stats_view(d),
        leaves=leaves_table(d),
        activations=activation_view(d),
        gradients=gradient_table(d),
        shapes=shape_table(d),
        history=history_view(d),
        precision=precision_view(d),
        environment=environment_view(d),
        reproduce=reproduce_view(d),
        compiler=compiler_view(d),
        machine=machine_view(d),
        kernel=kernel_view(d),
        index=index,
    )
    kernel = [("kernel", "Kernel vs reference", True)] if v.kernel else []
    present = [("verdict", "Verdict", True), *(kernel if v.kernel and v.kernel.decides else []),
               ("anomaly", "Anomaly detection", True), ("source", "Source", v.source),
               ("chain", "Causal chain", v.chain), ("culprit-stats", "Culprit inputs", v.stats),
               ("leaves", "Non-finite leaves", v.leaves), ("activations", "Activations", v.activations),
               ("gradients", "Gradients", v.gradients), ("shapes", "Gradient shapes", v.shapes),
               ("history", "History", v.history), ("precision", "Precision", v.precision),
               ("compiler", "Compiled replay", v.compiler),
               ("machine", "Machine", v.machine),
               *(kernel if v.kernel and not v.kernel.decides else []),
               ("environment", "Environment", True), ("reproduce", "Reproduce", True)]
    v.sections = [Section(i, t) for i, t, on in present if on]
    return v
