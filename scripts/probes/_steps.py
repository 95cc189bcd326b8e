"""What the step probes share: meshtune's compiled step on the bench's random model and one fixed batch,
and timing several configurations in interleaved rounds."""
import time

import mlx.core as mx
import mlx.optimizers as optim

from meshtune.bench.models import add_adapters, build_model
from meshtune.mesh import Mesh
from meshtune.train import build_step


def meshtune_step(kind, a, shape, dtype, *, quantized=False, mesh=None, optimizer=optim.Adam, frozen=()):
    """(step, state, tokens, lengths): `step(tokens, lengths, None, None, True)` is one optimizer step
    (`optimizer`: the class, optim.Adam or a probe's; `frozen`: adapter parameter names left untrained, e.g. ["m"])."""
    model = build_model(shape, dtype, quantized=quantized, seed=0)
    add_adapters(model, impl="meshtune", kind=kind, num_layers=-1, rank=8, scale=20.0)
    if frozen:
        model.freeze(keys=list(frozen), strict=False)
    model.train()
    opt = optimizer(learning_rate=1e-5)
    step = build_step(model, opt, mesh or Mesh.single(), max_grad_norm=0.0, compile=True)
    state = [model.state, opt.state, mx.random.state]
    tokens = mx.random.randint(0, shape.vocab, (a.batch_size, a.seq_len + 1), key=mx.random.key(0))
    lengths = mx.array([[0, a.seq_len + 1]] * a.batch_size, dtype=mx.int32)
    mx.eval(tokens, lengths)
    return step, state, tokens, lengths


def interleaved(runs, steps, *, warmup=3, rounds=2):
    """{name: [what run() returned, per timed call]}: each run warmed up (compiled), then
    timed in `rounds` rounds over all of them, so drift spreads over every configuration."""
    for run in runs.values():
        for _ in range(warmup):
            run()
    results = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            results[name] += [run() for _ in range(steps // rounds)]
    return results


def median_ms(fn, reps, warmup=3):
    """Median milliseconds of mx.eval(fn()) over `reps` calls, after `warmup` calls."""
    for _ in range(warmup):
        mx.eval(fn())
    times = []
    for _ in range(reps):
        tic = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - tic)
    return sorted(times)[reps // 2] * 1e3
