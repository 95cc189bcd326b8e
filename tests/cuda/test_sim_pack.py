"""The gradient-bucket packing kernel (meshtune/parallel/pack_kernel.cuh) run by the CPU simulator (cuda_sim.py)."""

import mlx.core as mx


def test_pack_kernel(simulated):
    from meshtune.parallel.pack_kernel import pack_cuda

    keys = mx.random.split(mx.random.key(0), 4)
    arrays = [mx.random.normal(s, key=k) for s, k in zip([(3, 5), (1,), (0,), (300,)], keys)]
    got = pack_cuda(arrays, mx.float32)
    assert mx.array_equal(got, mx.concatenate([a.reshape(-1) for a in arrays])).item()
    # The same count and output dtype from bfloat16 arrays: a kernel of its own (the stand-in checks).
    half = [a.astype(mx.bfloat16) for a in arrays]
    assert mx.array_equal(pack_cuda(half, mx.float32), mx.concatenate([a.reshape(-1) for a in half])).item()


def test_more_arrays_than_a_launch_takes_are_packed_a_launch_per_group(simulated):
    import meshtune.parallel.pack_kernel as pack_kernel

    arrays = [mx.arange(k * 10, k * 10 + 3 + k, dtype=mx.float32) for k in range(5)]
    got = pack_kernel.pack_cuda(arrays, mx.float32, max_arrays=2)
    assert mx.array_equal(got, mx.concatenate(arrays)).item()
    # 5 arrays at 2 a launch: two launches of 2 and the last array alone, which needs no kernel.
    assert sum(k.calls for name, k in simulated.items() if name.startswith("meshtune_pack_2_")) == 2


def test_gradient_buckets_packed_by_the_kernel(simulated, monkeypatch):
    """sum_gradients on a one-process group that claims two ranks: the kernel packs, the summed buffer comes back
    as the whole tree."""
    from mlx.utils import tree_flatten

    from meshtune.parallel.gradient_sums import sum_gradients
    from meshtune.runtime.mesh import Mesh

    # The two ranks the group claims, both holding these gradients: each bucket's sum is twice its values, so a
    # tree unpacked from the summed buffer differs from the one handed in.
    monkeypatch.setattr(mx.distributed, "all_sum", lambda x, *a, **k: x * 2)
    grads = {"layers": [{"a": mx.arange(6.0).reshape(2, 3), "b": mx.ones((4,))}, {"a": mx.full((2, 3), 5.0)}]}
    mesh = Mesh(group=mx.distributed.init(), world_size=2, rank=0, dp=2, pp=1)
    summed = sum_gradients(grads, mesh)
    got, want = tree_flatten(summed), tree_flatten(grads)
    assert [k for k, _ in got] == [k for k, _ in want]
    for (k, v), (_, v2) in zip(got, want):
        assert v.shape == v2.shape and mx.array_equal(v, 2 * v2).item(), k
    assert [k.calls for name, k in simulated.items() if name.startswith("meshtune_pack_3_")] == [1]
