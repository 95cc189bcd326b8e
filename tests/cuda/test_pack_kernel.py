"""The CUDA bucket-packing kernel equals mx.concatenate of the flattened, cast arrays."""

import mlx.core as mx
import pytest

from meshtune.runtime.cuda import on_cuda

pytestmark = pytest.mark.skipif(not on_cuda(), reason="CUDA kernel")


@pytest.mark.parametrize("count", [2, 300])  # one kernel, then several (MAX_ARRAYS each) and a concatenate
def test_pack_matches_concatenate(count):
    from meshtune.parallel.pack_kernel import pack_cuda

    keys = mx.random.split(mx.random.key(0), count)
    sizes = [1, 0, 70_000, (3, 5), (256, 33)]
    arrays = []
    for i in range(count):
        shape = sizes[i % len(sizes)]
        shape = shape if isinstance(shape, tuple) else (shape,)
        a = mx.random.normal(shape, key=keys[i])
        arrays.append(a.astype(mx.bfloat16) if i % 3 == 0 else a)
    for dtype in (mx.float32, mx.bfloat16):
        got = pack_cuda(arrays, dtype)
        want = mx.concatenate([a.reshape(-1).astype(dtype) for a in arrays])
        assert got.dtype == dtype and got.shape == want.shape
        assert mx.array_equal(got, want).item()


def test_pack_in_a_compiled_function():
    from meshtune.parallel.pack_kernel import pack_cuda

    arrays = [mx.arange(n, dtype=mx.float32) for n in (5, 1, 9)]
    f = mx.compile(lambda *a: pack_cuda(list(a), mx.float32) * 2)
    assert mx.array_equal(f(*arrays), 2 * mx.concatenate(arrays)).item()


def test_same_count_from_another_dtype_gets_its_own_kernel():
    """MLX caches a compiled kernel by name and template values; the inputs' dtypes must be in the name."""
    from meshtune.parallel.pack_kernel import pack_cuda

    arrays = [mx.arange(5, dtype=mx.float32) + 0.5, mx.arange(3, dtype=mx.float32) - 7.25]
    for dtype in (mx.float32, mx.bfloat16, mx.float16):
        inputs = [a.astype(dtype) for a in arrays]
        assert mx.array_equal(pack_cuda(inputs, mx.float32), mx.concatenate(inputs).astype(mx.float32)).item(), dtype
