"""The sweep's architectures beyond transformers/diffusers/torch.nn: torch_geometric, timm and torchaudio (each where
it imports), and the op families real models run that the others do not (issue 36): an STFT / log-power front-end,
an inverse STFT, FNet-style FFT mixing, view_as_complex rotary embeddings, torch.distributions policies with their
argument validation on.

* torch_geometric: every model of `torch_geometric.nn.models` that trains on a graph's nodes (GCN, GraphSAGE, GIN,
  GAT, PNA, EdgeCNN, with variants), a few whole-graph models (AttentiveFP, GraphUNet...), and every message-passing
  layer of `torch_geometric.nn.conv` that can be built from its channels alone, each under a linear head.
* timm: one model per timm module (the smallest registered variant), random weights, 64x64 images where it accepts
  that size.
* torchaudio: the models of `torchaudio.models` from tiny configs, and its spectral transforms under a linear head.

An architecture that cannot be built here is kept with the reason (`Skipped`), never hidden.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from arch_types import Arch, Built, Skipped

N_NODES, N_EDGES, D, CLASSES = 12, 40, 8, 3


# ---------------------------------------------------------------- the op families of issue 36


class LogPower(nn.Module):
    """torch.stft on the device, log power, a linear 'mel' projection (Whisper-style front-end)."""

    def __init__(self, n_fft=32, hop=8):
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        self.register_buffer("window", torch.hann_window(n_fft))
        self.mel = nn.Linear(n_fft // 2 + 1, 8, bias=False)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, wave):
        spec = torch.stft(wave, self.n_fft, self.hop, window=self.window, return_complex=True)
        logp = torch.log(spec.abs() ** 2 + 1e-6)
        return self.head(self.mel(logp.transpose(1, 2)).mean(1))


class ISTFT(nn.Module):
    """A spectral mask applied to an STFT and inverted (torch.istft: the c2r transform)."""

    def __init__(self, n_fft=32, hop=8):
        super().__init__()
        self.n_fft, self.hop = n_fft, hop
        self.register_buffer("window", torch.hann_window(n_fft))
        self.mask = nn.Linear(n_fft // 2 + 1, n_fft // 2 + 1)

    def forward(self, wave):
        spec = torch.stft(wave, self.n_fft, self.hop, window=self.window, return_complex=True)
        m = torch.sigmoid(self.mask(spec.abs().transpose(1, 2))).transpose(1, 2)
        return torch.istft(spec * m, self.n_fft, self.hop, window=self.window, length=wave.shape[-1])


class FNetMix(nn.Module):
    """FNet's token mixing: the real part of a 2-d FFT over (sequence, hidden), then a feed-forward layer."""

    def __init__(self, d=16):
        super().__init__()
        self.inp, self.ff, self.norm = nn.Linear(d, d), nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x):
        h = self.inp(x)
        return self.ff(self.norm(h + torch.fft.fftn(h, dim=(-2, -1)).real))


class Rotary(nn.Module):
    """Rotary position embeddings as llama's reference code writes them: view_as_complex, a complex product."""

    def __init__(self, d=16, t=6):
        super().__init__()
        self.q = nn.Linear(d, d)
        freqs = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        angles = torch.outer(torch.arange(t).float(), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles))

    def forward(self, x):
        q = torch.view_as_complex(self.q(x).float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(q * self.freqs_cis).flatten(-2)


class ComplexGate(nn.Module):
    """A complex-valued layer with a complex scalar in the step (`z * (0.5 + 1j)`): a literal the program stores."""

    def __init__(self, d=16):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        z = torch.view_as_complex(self.lin(x).reshape(*x.shape[:-1], -1, 2)) * (0.5 + 1j)
        return torch.view_as_real(z.conj().resolve_conj() * z.sgn()).flatten(-2)


class NormalPolicy(nn.Module):
    def __init__(self, obs=4, act=2):
        super().__init__()
        self.body, self.mu, self.log_std = nn.Linear(obs, 16), nn.Linear(16, act), nn.Linear(16, act)

    def forward(self, obs):
        h = torch.tanh(self.body(obs))
        return self.mu(h), self.log_std(h).clamp(-5, 2).exp()


class BetaPolicy(nn.Module):
    def __init__(self, obs=4, act=2):
        super().__init__()
        self.body, self.a, self.b = nn.Linear(obs, 16), nn.Linear(16, act), nn.Linear(16, act)

    def forward(self, obs):
        h = torch.tanh(self.body(obs))
        return F.softplus(self.a(h)) + 1, F.softplus(self.b(h)) + 1


def _normal_nll(out, actions):
    mu, std = out
    return -torch.distributions.Normal(mu, std, validate_args=True).log_prob(actions).mean()


def _beta_nll(out, actions):
    a, b = out
    return -torch.distributions.Beta(a, b, validate_args=True).log_prob(actions).mean()


def _regress(out, target=None):
    return F.mse_loss(out, torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape))


def _op_make(model_fn, shape, loss_fn, target=None) -> Callable[[], Built]:
    def make() -> Built:
        torch.manual_seed(0)
        m = model_fn()

        def batch(step):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(*shape, generator=g)
            return x, (target(g) if target is not None else None)
        return Built(m, batch, loss_fn)
    return make


def op_archs() -> list[Arch]:
    actions = lambda g: torch.randn(8, 2, generator=g)  # noqa: E731
    unit = lambda g: torch.rand(8, 2, generator=g) * 0.9 + 0.05  # noqa: E731
    labels = lambda g: torch.randint(0, CLASSES, (2,), generator=g)  # noqa: E731
    return [
        Arch("ops:stft_log_power", "spectral", _op_make(LogPower, (2, 256), F.cross_entropy, labels), "audio_cls"),
        Arch("ops:istft_mask", "spectral", _op_make(ISTFT, (2, 256), _regress), "denoise"),
        Arch("ops:fnet_mixing", "spectral", _op_make(FNetMix, (2, 6, 16), _regress), "layer"),
        Arch("ops:rotary_complex", "complex", _op_make(Rotary, (2, 6, 16), _regress), "layer"),
        Arch("ops:complex_scalar", "complex", _op_make(ComplexGate, (2, 6, 16), _regress), "layer"),
        Arch("ops:normal_policy", "distributions", _op_make(NormalPolicy, (8, 4), _normal_nll, actions), "policy"),
        Arch("ops:beta_policy", "distributions", _op_make(BetaPolicy, (8, 4), _beta_nll, unit), "policy"),
    ]


# ---------------------------------------------------------------- torch_geometric


def _graph(g: torch.Generator, edge_dim: int | None = None):
    x = torch.randn(N_NODES, D, generator=g)
    src = torch.randint(0, N_NODES, (N_EDGES,), generator=g)
    dst = (src + torch.randint(1, N_NODES, (N_EDGES,), generator=g)) % N_NODES  # no self loops
    edge_index = torch.stack([src, dst])
    y = torch.randint(0, CLASSES, (N_NODES,), generator=g)
    return x, edge_index, y


class _Head(nn.Module):
    """A graph layer or model under a linear classifier: (x, edge_index[, edge_attr]) -> node logits."""

    def __init__(self, body: nn.Module, out_dim: int, call: Callable):
        super().__init__()
        self.body, self.head, self._call = body, nn.Linear(out_dim, CLASSES), call

    def forward(self, x, edge_index, edge_attr=None):
        out = self._call(self.body, x, edge_index, edge_attr)
        if isinstance(out, tuple):
            out = out[0]
        return self.head(out.reshape(out.shape[0], -1))


def _node_model(build: Callable[[], nn.Module], call: Callable, edge_dim: int | None = None) -> Callable[[], Built]:
    def make() -> Built:
        torch.manual_seed(0)
        try:
            body = build()
        except Skipped:
            raise
        except Exception as e:  # noqa: BLE001 - a layer that needs more than its channels
            raise Skipped(f"needs more than its channels: {type(e).__name__}: {str(e)[:120]}") from None
        g0 = torch.Generator().manual_seed(0)
        x, ei, _ = _graph(g0)
        ea = torch.randn(ei.shape[1], edge_dim, generator=g0) if edge_dim else None
        with torch.no_grad():
            out = call(body, x, ei, ea)
        out = out[0] if isinstance(out, tuple) else out
        if not isinstance(out, torch.Tensor) or out.dim() < 2 or not out.is_floating_point():
            raise Skipped("does not return floating rows (one per node or per graph)")
        model, rows = _Head(body, out[0].numel(), call), out.shape[0]  # rows: nodes, or graphs (AttentiveFP)

        def batch(step):
            g = torch.Generator().manual_seed(step)
            x, ei, y = _graph(g)
            y = y[:rows]
            inputs = (x, ei) if not edge_dim else (x, ei, torch.randn(ei.shape[1], edge_dim, generator=g))
            return inputs, y
        return Built(model, batch, F.cross_entropy)
    return make


def _plain(body, x, ei, ea):
    return body(x, ei) if ea is None else body(x, ei, ea)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D))


# constructor arguments a layer may need beyond its channels (those without a default)
_FILL: dict[str, Callable[[], object]] = {
    "in_channels": lambda: D, "out_channels": lambda: D, "channels": lambda: D, "hidden_channels": lambda: D,
    "K": lambda: 2, "num_layers": lambda: 2, "num_relations": lambda: 2, "num_stacks": lambda: 1,
    "dim": lambda: 2, "kernel_size": lambda: 2, "heads": lambda: 2, "alpha": lambda: 0.1,
    "nn": _mlp, "local_nn": _mlp, "global_nn": None, "aggregators": lambda: ["mean", "max"],
    "scalers": lambda: ["identity"], "deg": lambda: torch.tensor([0, 4, 6, 2]), "space_dimensions": lambda: 2,
    "propagate_dimensions": lambda: D, "k": lambda: 3, "num_bases": lambda: 2, "groups": lambda: 1,
    "in_features": lambda: D, "out_features": lambda: D, "num_nodes": lambda: N_NODES,
    "powers": lambda: [0, 1, 2], "mlp": _mlp, "edge_dim": lambda: 2,
}
_EDGE_ATTR_LAYERS = {"GINEConv": D, "NNConv": 2, "GMMConv": 2, "SplineConv": 2, "PDNConv": 2}
_WITH_X0 = {"GCN2Conv", "FAConv"}  # forward(x, x_0, edge_index): the initial features again
_NOT_NODE_LAYERS = {  # layers whose inputs are not (x, edge_index): the reason, listed in the sweep's table
    "MessagePassing": "the abstract base class", "HeteroConv": "takes dicts of node types (heterogeneous graphs)",
    "HGTConv": "takes dicts of node types (heterogeneous graphs)", "HANConv": "takes dicts of node types",
    "HEATConv": "needs node and edge types", "RGATConv": "needs edge types",
    "RGCNConv": "needs edge types", "FastRGCNConv": "needs edge types", "SignedConv": "needs positive and negative edges",
    "PointNetConv": "needs point positions", "XConv": "needs point positions (and torch_cluster)",
    "PPFConv": "needs point positions and normals", "PointTransformerConv": "needs point positions",
    "PointGNNConv": "needs point positions", "DynamicEdgeConv": "needs torch_cluster's knn",
    "GravNetConv": "needs torch_cluster's knn", "WLConv": "integer colours, no gradient",
    "MeshCNNConv": "needs a mesh", "DNAConv": "needs a stack of layer outputs",
    "CuGraphSAGEConv": "needs CUDA (cugraph)", "CuGraphGATConv": "needs CUDA (cugraph)",
    "CuGraphRGCNConv": "needs CUDA (cugraph)", "FusedGATConv": "needs dgNN (CUDA)",
}


def _conv_build(cls) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        kw = {}
        for p in list(inspect.signature(cls.__init__).parameters.values())[1:]:
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is not p.empty:
                continue
            fill = _FILL.get(p.name)
            if fill is None:
                raise Skipped(f"needs a value for {p.name}")
            kw[p.name] = fill()
        name = cls.__name__
        if name in ("GINEConv",):
            kw["edge_dim"] = None
        if name in ("NNConv",):
            kw["nn"] = nn.Sequential(nn.Linear(2, D * D))
        if name in ("EdgeConv",):
            kw["nn"] = nn.Sequential(nn.Linear(2 * D, D), nn.ReLU(), nn.Linear(D, D))
        if name in ("GATConv", "GATv2Conv", "TransformerConv") and "heads" not in kw:
            kw["heads"] = 2
        return cls(**kw)
    return build


def pyg_archs() -> list[Arch]:
    try:
        import torch_geometric.nn as gnn
        from torch_geometric.nn import models as gm
    except Exception:  # noqa: BLE001 - not installed, or not importable with this torch
        return []
    out: list[Arch] = []
    basic = {  # models of torch_geometric.nn.models (BasicGNN) with the variants users pick
        "GCN": {}, "GCN_jk_cat": {"jk": "cat"}, "GraphSAGE": {}, "GraphSAGE_max": {"aggr": "max"},
        "GIN": {}, "GAT": {"heads": 2}, "GAT_v2": {"v2": True, "heads": 2}, "GAT_edge": {"edge_dim": 2, "heads": 2},
        "PNA": {"aggregators": ["mean", "min", "max", "std"], "scalers": ["identity", "amplification"],
                "deg": torch.tensor([0, 4, 6, 2])},
        "EdgeCNN": {}, "GCN_batchnorm": {"norm": "batch_norm"}, "GIN_layernorm": {"norm": "layer_norm"},
    }
    for name, extra in basic.items():
        cls = getattr(gm, name.split("_")[0])
        edge = extra.get("edge_dim")

        def build(cls=cls, extra=extra):
            return cls(D, D, num_layers=2, **extra)
        out.append(Arch(f"pyg:{name}", "graph", _node_model(build, _plain, edge), "node_cls"))
    others = {
        "MLP": (lambda: gm.MLP([D, D, D]), lambda b, x, ei, ea: b(x)),
        "GraphUNet": (lambda: gm.GraphUNet(D, D, D, depth=2), _plain),
        "LINKX": (lambda: gm.LINKX(N_NODES, D, D, D, num_layers=2), _plain),
        "RECT_L": (lambda: gm.RECT_L(D, D), _plain),
        "PMLP": (lambda: gm.PMLP(D, D, D, num_layers=2), _plain),
        "DeepGCNLayer": (lambda: gm.DeepGCNLayer(gnn.GENConv(D, D), nn.LayerNorm(D), nn.ReLU(), block="res+"),
                         _plain),
        "AttentiveFP": (lambda: gm.AttentiveFP(D, D, D, edge_dim=2, num_layers=2, num_timesteps=2),
                        lambda b, x, ei, ea: b(x, ei, ea, torch.arange(x.shape[0]) % 3)),
        "GroupAddRev": (lambda: gm.GroupAddRev(gnn.GCNConv(D // 2, D // 2), num_groups=2), _plain),
        "SGFormer": (lambda: gm.SGFormer(D, D, D), lambda b, x, ei, ea: b(x, ei, torch.zeros(x.shape[0], dtype=torch.long))),
        "Polynormer": (lambda: gm.Polynormer(D, D, D, local_layers=1, global_layers=1),
                       lambda b, x, ei, ea: b(x, ei, torch.zeros(x.shape[0], dtype=torch.long))),
    }
    for name, (build, call) in others.items():
        if not hasattr(gm, name):
            continue
        edge = 2 if name == "AttentiveFP" else None
        out.append(Arch(f"pyg:{name}", "graph", _node_model(build, call, edge), "node_cls"))
    wrappers = {"GPSConv": lambda: gnn.GPSConv(D, gnn.GINConv(_mlp()), heads=2),  # layers that wrap a conv layer
                "DirGNNConv": lambda: gnn.DirGNNConv(gnn.GCNConv(D, D))}
    for name in gnn.conv.__all__:
        cls = getattr(gnn.conv, name, None)
        if cls is None:
            continue
        if name in wrappers:
            out.append(Arch(f"pyg-conv:{name}", "graph", _node_model(wrappers[name], _plain), "node_cls"))
            continue
        if name in _NOT_NODE_LAYERS:
            out.append(Arch(f"pyg-conv:{name}", "graph", _skip(_NOT_NODE_LAYERS[name]), "node_cls"))
            continue
        call = (lambda b, x, ei, ea: b(x, x, ei)) if name in _WITH_X0 else _plain
        out.append(Arch(f"pyg-conv:{name}", "graph", _node_model(_conv_build(cls), call,
                                                                 _EDGE_ATTR_LAYERS.get(name)), "node_cls"))
    return out


def _skip(why: str) -> Callable[[], Built]:
    def make() -> Built:
        raise Skipped(why)
    return make


# ---------------------------------------------------------------- timm


_SMALL = re.compile(r"atto|femto|pico|nano|tiny|small|mobile|xxs|xs|_s\b|18|b0|lite|micro|light")
MAX_TIMM_PARAMS = 40_000_000


def _timm_pick(names: list[str]) -> str:
    """The smallest-looking variant of one timm module: a size word, then the shortest name."""
    return min(names, key=lambda n: (0 if _SMALL.search(n) else 1, len(n), n))


def _timm_make(name: str) -> Callable[[], Built]:
    def make() -> Built:
        import timm
        torch.manual_seed(0)
        model, size = None, 64
        for kw, s in (({"img_size": 64}, 64), ({}, 64), ({}, 224)):
            try:
                model = timm.create_model(name, pretrained=False, num_classes=CLASSES, **kw)
                with torch.no_grad():
                    model.eval()(torch.randn(1, 3, s, s))
                size = s
                break
            except Exception as e:  # noqa: BLE001 - a size or argument this model does not take
                model, err = None, e
        if model is None:
            raise Skipped(f"{type(err).__name__}: {str(err)[:120]}")
        if sum(p.numel() for p in model.parameters()) > MAX_TIMM_PARAMS:
            raise Skipped(f"more than {MAX_TIMM_PARAMS // 10**6}M parameters at its smallest")
        model.train()

        def batch(step):
            g = torch.Generator().manual_seed(step)
            return torch.randn(2, 3, size, size, generator=g), torch.randint(0, CLASSES, (2,), generator=g)
        return Built(model, batch, F.cross_entropy)
    return make


def timm_archs() -> list[Arch]:
    try:
        import timm
    except Exception as e:  # noqa: BLE001 - timm imports torchvision, whose build must load with this torch
        return [Arch("timm:*", "vision", _skip(f"timm does not import here: {type(e).__name__}: {str(e)[:100]}"),
                     "image_cls")]
    out = []
    for module in sorted(timm.list_modules()):
        names = timm.list_models(module=module)
        if names:
            pick = _timm_pick(names)
            out.append(Arch(f"timm:{module}:{pick}", "vision", _timm_make(pick), "image_cls"))
    return out


# ---------------------------------------------------------------- torchaudio


def audio_archs() -> list[Arch]:
    try:
        import torchaudio
        import torchaudio.models as am
        import torchaudio.transforms as at
    except Exception:  # noqa: BLE001 - torchaudio needs the torch it was built for
        return []
    wave = (2, 800)
    feats = (2, 20, 16)  # (batch, frames, features)

    def seq(model, shape, loss=_regress, target=None, pool=None):
        def build():
            m = model()
            return nn.Sequential(m, pool) if pool is not None else m
        return _op_make(build, shape, loss, target)

    class First(nn.Module):
        def forward(self, out):
            return out[0] if isinstance(out, tuple) else out

    class Spec(nn.Module):
        def __init__(self, t, n):
            super().__init__()
            self.t, self.head = t, nn.Linear(n, CLASSES)

        def forward(self, x):
            s = self.t(x)
            return self.head(torch.log(s.abs() + 1e-6).transpose(-1, -2)).mean(-2)

    labels = lambda g: torch.randint(0, CLASSES, (2,), generator=g)  # noqa: E731
    out = [
        ("Spectrogram", seq(lambda: Spec(at.Spectrogram(n_fft=64), 33), wave, F.cross_entropy, labels)),
        ("MelSpectrogram", seq(lambda: Spec(at.MelSpectrogram(n_fft=64, n_mels=16), 16), wave, F.cross_entropy, labels)),
        ("MFCC", seq(lambda: Spec(at.MFCC(n_mfcc=13, melkwargs={"n_fft": 64, "n_mels": 16}), 13), wave,
                     F.cross_entropy, labels)),
        ("LFCC", seq(lambda: Spec(at.LFCC(n_lfcc=13, speckwargs={"n_fft": 64}), 13), wave, F.cross_entropy, labels)),
        ("Wav2Letter", seq(lambda: am.Wav2Letter(num_classes=4, input_type="mfcc", num_features=13), (2, 13, 40))),
        ("ConvTasNet", seq(lambda: am.ConvTasNet(num_sources=2, enc_kernel_size=8, enc_num_feats=16, msk_kernel_size=3,
                                                  msk_num_feats=8, msk_num_hidden_feats=16, msk_num_layers=2,
                                                  msk_num_stacks=1), (2, 1, 400))),
        ("DeepSpeech", seq(lambda: am.DeepSpeech(n_feature=16, n_hidden=16, n_class=5), (2, 1, 10, 16))),
        ("Conformer", seq(lambda: am.Conformer(input_dim=16, num_heads=2, ffn_dim=32, num_layers=2,
                                               depthwise_conv_kernel_size=3), feats, pool=None)),
        ("Emformer", seq(lambda: am.Emformer(input_dim=16, num_heads=2, ffn_dim=32, num_layers=2,
                                             segment_length=4), feats)),
        ("wav2vec2", seq(lambda: am.wav2vec2_model(
            extractor_mode="group_norm", extractor_conv_layer_config=[(8, 10, 5), (8, 3, 2)], extractor_conv_bias=False,
            encoder_embed_dim=16, encoder_projection_dropout=0.0, encoder_pos_conv_kernel=4, encoder_pos_conv_groups=2,
            encoder_num_layers=2, encoder_num_heads=2, encoder_attention_dropout=0.0, encoder_ff_interm_features=32,
            encoder_ff_interm_dropout=0.0, encoder_dropout=0.0, encoder_layer_norm_first=False,
            encoder_layer_drop=0.0, aux_num_out=5), wave, pool=First())),
        ("HDemucs", seq(lambda: am.HDemucs(sources=["a", "b"], channels=4, depth=2), (1, 2, 1024))),
        ("WaveRNN", seq(lambda: am.WaveRNN(upsample_scales=[2, 2], n_classes=16, hop_length=4, n_res_block=1,
                                           n_rnn=16, n_fc=16, n_freq=8, n_hidden=8, n_output=8), (2, 1, 24))),
        ("Tacotron2", None),
    ]
    archs = []
    for name, make in out:
        if make is None:
            archs.append(Arch(f"torchaudio:{name}", "audio", _skip("needs token and mel inputs together (not a "
                                                                    "one-tensor batch)"), "audio"))
            continue
        if name == "Conformer":
            make = _op_make(lambda: _Lengths(am.Conformer(input_dim=16, num_heads=2, ffn_dim=32, num_layers=2,
                                                          depthwise_conv_kernel_size=3)), feats, _regress)
        if name == "Emformer":
            make = _op_make(lambda: _Lengths(am.Emformer(input_dim=16, num_heads=2, ffn_dim=32, num_layers=2,
                                                         segment_length=4)), feats, _regress)
        if name == "WaveRNN":
            make = _op_make(lambda: _WaveRNN(am.WaveRNN(upsample_scales=[2, 2], n_classes=16, hop_length=4,
                                                        n_res_block=1, n_rnn=16, n_fc=16, n_freq=8, n_hidden=8,
                                                        n_output=8)), (2, 1, 24), _regress)
        archs.append(Arch(f"torchaudio:{name}", "audio", make, "audio"))
    del torchaudio
    return archs


class _Lengths(nn.Module):
    """Conformer / Emformer take (input, lengths): every sequence full length."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        return self.m(x, torch.full((x.shape[0],), x.shape[1], dtype=torch.long))[0]


class _WaveRNN(nn.Module):
    """WaveRNN takes (waveform, specgram): a waveform of hop_length x frames samples and an 8-bin specgram."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        spec = x.new_ones(x.shape[0], 1, 8, 10)
        return self.m(x[..., :24], spec)


def lib_archs() -> list[Arch]:
    return op_archs() + pyg_archs() + timm_archs() + audio_archs()
