"""train.grad_checkpoint through the step `meshtune train` runs: the same update, and one hidden state kept per block.

Each case runs in a child process: checkpointing patches the block class, which no other test
in this worker should inherit.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

PRELUDE = textwrap.dedent('''
    import json, sys
    import mlx.core as mx, mlx.optimizers as optim
    from mlx.utils import tree_flatten
    from meshtune.adapters import StepContext
    from meshtune.bench.models import Shape, build_model, add_adapters
    from meshtune.parallel.data_parallel_step import build_step
    from meshtune.runtime.mesh import Mesh
    from meshtune.training.grad_checkpoint import enable_grad_checkpoint

    def model(layers, kind, hidden=128):
        m = build_model(Shape("qwen3", layers=layers, hidden=hidden, intermediate=3 * hidden, heads=2, kv_heads=1,
                              vocab=512), mx.float32, quantized=False)
        if kind == "full":
            from meshtune.adapters import apply_adapters
            apply_adapters(m, fine_tune_type="full", num_layers=-1, keys=None, rank=4, scale=20.0, dropout=0.0)
        else:
            add_adapters(m, impl="meshtune", kind=kind, num_layers=-1, rank=4, scale=20.0)
        m.train()
        return m

    def step(m, tokens, lengths, clip=0.0, recomputed=()):
        opt = optim.AdamW(learning_rate=1e-3)
        s = build_step(m, opt, Mesh.single(), max_grad_norm=clip, compile=True,
                       step_context=StepContext.for_run(recomputed=recomputed))
        return s, opt
''')


def _run(body: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ["lora", "dora", "full"])
def test_checkpointed_steps_make_the_same_update(kind):
    out = _run(f'''
        tokens = mx.random.randint(0, 512, (2, 65), key=mx.random.key(1)); lengths = mx.array([[0, 65], [3, 50]])
        weights = []
        for checkpointed in (False, True):
            m = model(3, "{kind}")
            recomputed = (enable_grad_checkpoint(m.layers[0]),) if checkpointed else ()
            s, opt = step(m, tokens, lengths, clip=1.0, recomputed=recomputed)
            for _ in range(2):
                ce, n, verdict = s.finish(tokens, lengths, None, None)
                mx.eval(ce, m.state, opt.state)
            weights.append(dict(tree_flatten(m.trainable_parameters())))
        plain, ckpt = weights
        worst = max(mx.abs(plain[k] - ckpt[k]).max().item() / (mx.abs(plain[k]).max().item() + 1e-12) for k in plain)
        print(json.dumps({{"worst": worst, "count": len(plain)}}))
    ''')
    assert out["count"] > 0 and out["worst"] < 1e-4, out


def test_a_checkpointed_step_keeps_one_hidden_state_per_block():
    """Adding blocks adds about their input (L x hidden floats) to the step's peak, not their activations.

    On the previous step (backward and update one graph) MLX put off the weight gradients,
    which the gated update reads only through the global norm, and each added block kept its
    activations: about 6x a hidden state per block here."""
    out = _run('''
        L, hidden = 1024, 128
        tokens = mx.random.randint(0, 512, (1, L + 1), key=mx.random.key(1)); lengths = mx.array([[0, L + 1]])
        peaks = {}
        for layers in (4, 12):
            m = model(layers, "lora", hidden)
            s, opt = step(m, tokens, lengths, recomputed=(enable_grad_checkpoint(m.layers[0]),))
            run = lambda: mx.eval(s.finish(tokens, lengths, None, None)[0], m.state, opt.state)
            run(); run()
            mx.reset_peak_memory(); live = mx.get_active_memory()
            run()
            peaks[layers] = mx.get_peak_memory() - live
            del m, s, opt
        print(json.dumps({"per_block": (peaks[12] - peaks[4]) / 8, "hidden_state": L * hidden * 4}))
    ''')
    assert out["per_block"] <= 2 * out["hidden_state"], out
