"""The capture sweep's CI subset beyond transformers/diffusers/torch.nn (issue 36): torch_geometric models (their
scatter softmax and aggregations run scatter_reduce_ / scatter_add_ / index_select), the op families real models
emit (torch.stft and istft, FNet's FFT, view_as_complex rotary embeddings, torch.distributions with validation on),
and a few timm models where timm imports (it needs a torchvision that loads with this torch). Each trains one step
under NanGuard; the snapshot is loaded back as `nanreplay analyze` loads it (no model code), its step program
replayed, and the loss and every parameter gradient must be bitwise equal to eager (the same computation, replayed
the same way on the same machine).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import capture_sweep  # noqa: E402
import lib_archs  # noqa: E402

pytestmark = pytest.mark.zoo

OPS = ("ops:stft_log_power", "ops:istft_mask", "ops:fnet_mixing", "ops:rotary_complex", "ops:complex_scalar",
       "ops:normal_policy", "ops:beta_policy")
PYG = ("pyg:GCN", "pyg:GraphSAGE", "pyg:GIN", "pyg:GAT", "pyg:GAT_edge", "pyg:PNA", "pyg:EdgeCNN", "pyg:AttentiveFP",
       "pyg:SGFormer",  # torch_geometric's cumsum(out=a slice): recorded as cumsum, then copy_ into the slice
       "pyg-conv:TransformerConv", "pyg-conv:GATv2Conv", "pyg-conv:GENConv")
HF = ("hf:fnet", "hf:llama4_text")  # complex-valued steps: FNet's FFT mixing, llama4's view_as_complex rotary
TIMM = ("timm:resnet:resnet18", "timm:convnext:convnext_atto", "timm:deit:deit_tiny_patch16_224")


def _sweep(arch, tmp_path) -> None:
    row = capture_sweep.sweep_one(arch, str(tmp_path))
    assert row.status == "recorded", f"{arch.name}: {row.status}: {row.op or row.reason}"
    assert row.nodes >= 3 and row.bitwise, f"{arch.name}: not bitwise equal to eager ({row.reason})"


@pytest.mark.parametrize("name", OPS)
def test_op_family_records_and_replays_bitwise(name, tmp_path):
    (arch,) = [a for a in lib_archs.op_archs() if a.name == name]
    _sweep(arch, tmp_path)


@pytest.fixture(scope="module")
def pyg():
    pytest.importorskip("torch_geometric")
    return {a.name: a for a in lib_archs.pyg_archs()}


@pytest.mark.parametrize("name", PYG)
def test_torch_geometric_model_records_and_replays_bitwise(name, pyg, tmp_path):
    _sweep(pyg[name], tmp_path)


def test_spectral_norm_out_division_records_and_replays_bitwise(tmp_path):
    """nn.utils.spectral_norm normalises its power-iteration vectors with `F.normalize(..., out=u)`: the `out=`
    division is recorded as div then copy_ into u."""
    import archs

    (arch,) = [a for a in archs.nn_layer_archs() if a.name == "nn:spectral_norm"]
    _sweep(arch, tmp_path)


@pytest.mark.parametrize("name", HF)
def test_complex_valued_transformers_step_records_and_replays_bitwise(name, tmp_path):
    pytest.importorskip("transformers")
    import hf_archs

    (arch,) = [a for a in hf_archs.hf_archs() if a.name == name]
    _sweep(arch, tmp_path)


@pytest.mark.parametrize("name", TIMM)
def test_timm_model_records_and_replays_bitwise(name, tmp_path):
    try:
        import timm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - timm imports torchvision; its build must load with this torch
        pytest.skip(f"timm does not import here: {type(e).__name__}")
    module, model = name.split(":")[1:]
    _sweep(lib_archs.Arch(name, "vision", lib_archs._timm_make(model), "image_cls"), tmp_path)
