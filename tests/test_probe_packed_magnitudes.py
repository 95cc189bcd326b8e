"""The probe optimizer that updates every DoRA magnitude as one packed vector
(scripts/probes/packed_magnitudes.py) makes plain Adam's updates, in meshtune's compiled step."""

from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from meshtune.adapters import apply_adapters
from meshtune.mesh import Mesh
from meshtune.train import build_step


def _trained(model_factory, optimizer):
    model = model_factory(layers=2, dim=32)
    apply_adapters(model, fine_tune_type="dora", num_layers=2, keys=["self_attn.q_proj", "self_attn.v_proj"],
                   rank=4, scale=2.0, dropout=0.0)
    model.train()
    step = build_step(model, optimizer, Mesh.single(), max_grad_norm=0.0, compile=True)
    tokens = mx.random.randint(0, 64, (2, 9), key=mx.random.key(1))
    lengths = mx.array([[0, 9], [0, 9]])
    for _ in range(3):
        ce, n, _, _ = step(tokens, lengths, None, None, True)
        mx.eval(ce, n, model.parameters(), optimizer.state)
    return dict(tree_flatten(model.trainable_parameters()))


def test_packed_magnitudes_make_adams_updates(model_factory, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts" / "probes"))
    from packed_magnitudes import PackedMagnitudesAdam

    packed = PackedMagnitudesAdam(learning_rate=1e-2)
    got = _trained(model_factory, packed)
    want = _trained(model_factory, optim.Adam(learning_rate=1e-2))
    assert got.keys() == want.keys() and sum(k.endswith(".m") for k in got) == 4
    for key in want:
        assert mx.allclose(got[key], want[key], rtol=1e-6, atol=1e-7).item(), key
    # The magnitudes moved, and their state is the packed vector's alone.
    assert not mx.array_equal(got["model.layers.0.self_attn.q_proj.m"],
                              model_factory(layers=2, dim=32).model.layers[0].self_attn.q_proj.weight.square()
                              .sum(-1).sqrt()).item()
    assert packed.state["packed_m"]["m"].shape == (2 * (32 + 16),)
    assert not any(k.endswith(".m.m") for k, _ in tree_flatten(packed.state))


def test_split_views_cut_the_packed_vector_in_few_graph_nodes(monkeypatch):
    """split_views: the layers' parts of the packed vector (values and sizes as slices give them), from Split
    nodes of at most kernels.SPLIT_PARTS parts and no Slice a layer (the 1B model's 112 magnitudes)."""
    import io
    import re
    from collections import Counter

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "scripts" / "probes"))
    from packed_magnitudes import split_views

    sizes = [2048, 1024, 1024, 2048, 6144, 6144, 2048] * 16
    x = mx.arange(sum(sizes)) + 0
    views = split_views(x, sizes)
    dot = io.StringIO()
    mx.export_to_dot(dot, *views)
    nodes = Counter(re.findall(r'label ="([^"]+)"', dot.getvalue()))
    assert nodes["Slice"] == 0 and 0 < nodes["Split"] <= 15  # 12 groups of 10, and 3 above them
    start = 0
    for view, size in zip(views, sizes, strict=True):
        assert mx.array_equal(view, x[start:start + size]).item()
        start += size
