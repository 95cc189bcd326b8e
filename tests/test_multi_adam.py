"""multi_adam on MLX's CUDA build: the grouped Adam update against mlx's Adam, eager and inside a compiled step.

The kernel's arithmetic is checked on the CPU by the simulator (test_kernels_simulated.py) and its text by
nvcc (test_kernels_nvcc.py); here the same on a GPU, where MLX compiles and launches it."""

import mlx.core as mx
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten, tree_map

from meshtune import multi_adam
from meshtune.cuda import on_cuda

cuda_only = pytest.mark.skipif(not on_cuda(), reason="MLX's CUDA build and an NVIDIA GPU")


def test_only_adam_on_cuda_takes_the_grouped_update_and_only_when_asked(monkeypatch):
    monkeypatch.setattr(multi_adam, "ENABLED", True)
    assert multi_adam.supports(optim.Adam(1e-3)) == on_cuda()
    assert multi_adam.supports(optim.AdamW(1e-3)) == on_cuda()
    assert not multi_adam.supports(optim.SGD(1e-3))
    assert not multi_adam.supports(optim.Lion(1e-3))
    monkeypatch.setattr(multi_adam, "on_cuda", lambda: True)
    assert multi_adam.supports(optim.Adam(1e-3))
    monkeypatch.setattr(multi_adam, "ENABLED", False)  # the default: mlx's own update
    assert not multi_adam.supports(optim.Adam(1e-3)) and not multi_adam.supports(optim.AdamW(1e-3))


def test_the_setting_takes_0_or_1_and_names_itself_otherwise():
    assert multi_adam._setting("1") and not multi_adam._setting("0")
    with pytest.raises(ValueError, match=r"MESHTUNE_MULTI_ADAM='yes': use 1 .* or 0 \(the default"):
        multi_adam._setting("yes")


@cuda_only
@pytest.mark.parametrize("compiled", [False, True])
def test_grouped_update_matches_mlx_adamw_on_cuda(compiled):
    """150 float32 leaves (three launches) and a bfloat16 one, three AdamW steps, eager or in mx.compile."""
    k = iter(mx.random.split(mx.random.key(3), 1000))
    shapes = [(2048, 8), (8, 1024), (6144,), (3, 5)] * 37 + [(1,), (4097,)]

    def tree(scale):
        return {"w": [scale * mx.random.normal(s, key=next(k)) for s in shapes],
                "half": (scale * mx.random.normal((9,), key=next(k))).astype(mx.bfloat16)}

    ours, theirs = (optim.AdamW(learning_rate=optim.cosine_decay(1e-2, 10), bias_correction=True) for _ in range(2))
    p_ours = p_theirs = tree(1.0)
    tokens = mx.array(4096, dtype=mx.int32)

    def fused(g, p):
        return multi_adam.apply_gradients(ours, g, p, tokens)

    def plain(g, p):
        return theirs.apply_gradients(tree_map(lambda x: x / tokens.astype(x.dtype), g), p)
    if compiled:
        ours.init(p_ours)
        theirs.init(p_theirs)
        fused = mx.compile(fused, inputs=ours.state, outputs=ours.state)
        plain = mx.compile(plain, inputs=theirs.state, outputs=theirs.state)
    for _ in range(3):
        grads = tree(50.0)
        p_ours, p_theirs = fused(grads, p_ours), plain(grads, p_theirs)
        mx.eval(p_ours, p_theirs, ours.state, theirs.state)
    for (name, got), (_, want) in zip(tree_flatten([p_ours, ours.state]), tree_flatten([p_theirs, theirs.state])):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert mx.allclose(got, want, rtol=1e-5, atol=1e-7).item(), (name, mx.abs(got - want).max().item())
