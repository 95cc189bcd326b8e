"""Does the order MLX walks a graph decide when a side stream's work may start? (data-parallel probe)

    python scripts/probes/chain_order.py      # CPU here; on a GPU: python3 scripts/probes/chain_order.py

One process: a chain of K matmuls on the default stream (the backward), and four side
jobs on a second stream (the bucket sums), job j needing only link (j + 1) K / 4 of the
chain. "plain": the side jobs are outputs listed after the chain's end. "chained": each
side job's input starts with an empty marker depending on the previous side job, the
form data_parallel._chained_sum gives the bucket sums, so the walk reaches job j right
after link (j + 1) K / 4. Side by side, both take about the chain's time; if the side
stream may start only where the walk issued it, plain takes chain + side jobs.
"""
import os
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import mlx.core as mx  # noqa: E402

side_stream = mx.new_stream(mx.default_device())
a = mx.random.normal((768, 768)) / 28
mx.eval(a)
K = 24
JOBS = 4


def chain(x, n):
    for _ in range(n):
        x = mx.tanh(x @ a)
    return x


def links():
    out, x = [], a
    for _ in range(JOBS):
        x = chain(x, K // JOBS)
        out.append(x)
    return out


def plain():
    parts = links()
    with mx.stream(side_stream):
        jobs = [chain(p, K // (2 * JOBS)) for p in parts]
    return jobs[::-1] + [parts[-1]]  # the last job first, as the embedding's update comes first


def chained():
    parts = links()
    jobs, prev = [], None
    with mx.stream(side_stream):
        for p in parts:
            x = p if prev is None else mx.concatenate([mx.depends(mx.zeros((0, 768)), prev), p])
            prev = chain(x, K // (2 * JOBS))
            jobs.append(prev)
    return jobs[::-1] + [parts[-1]]


def timed(fn, n=7):
    f = mx.compile(fn)
    for _ in range(2):
        mx.eval(f())
    t = []
    for _ in range(n):
        tic = time.perf_counter()
        mx.eval(f())
        t.append(time.perf_counter() - tic)
    return sorted(t)[n // 2] * 1e3


alone = timed(lambda: [chain(a, K)])
for name, fn in (("plain", plain), ("chained", chained)):
    print(f"{name:<8} {timed(fn):7.1f} ms   (one chain alone {alone:.1f} ms)", flush=True)
