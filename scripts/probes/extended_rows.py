"""What r extra rows cost the base product at a CPU-sized batch (adapters issue probe).

    python scripts/probes/extended_rows.py   # 128 tokens x 2048 through a 6144 x 2048 float32 weight

DoRA's training product is [x; A^T] W^T: T + r rows instead of T. Rows 136 (r = 8),
144 (padded to a multiple of 16) and W A on its own, each a compiled product, median ms.
"""

import mlx.core as mx

from _steps import median_ms

T, IN, OUT, R = 128, 2048, 6144, 8
W = mx.random.normal((OUT, IN)) * IN ** -0.5
x = mx.random.normal((T, IN))
a = mx.random.normal((IN, R)) * 0.02
mx.eval(W, x, a)


cases = {
    "x W^T (128 rows)": lambda: x @ W.T,
    "[x; A^T] W^T (136 rows)": lambda: mx.concatenate([x, a.T]) @ W.T,
    "[x; A^T; 0] W^T (144 rows)": lambda: mx.concatenate([x, a.T, mx.zeros((8, IN))]) @ W.T,
    "x W^T and W A apart": lambda: [x @ W.T, W @ a],
}
for name, fn in cases.items():
    print(f"{name:<28}{median_ms(mx.compile(fn), 10):8.2f} ms", flush=True)
