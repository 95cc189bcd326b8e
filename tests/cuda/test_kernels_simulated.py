"""meshtune's CUDA kernels, run on the CPU through a fiber-per-CUDA-thread simulator.

CI has no GPU, so the kernel sources (adapters/kernels.py, parallel/pack_kernel.py)
would otherwise be checked only when someone runs the suite on a GPU. Here the
`mx.fast.cuda_kernel` objects are replaced by a stand-in that compiles the same kernel
body with g++ into a program where every CUDA thread is a fiber on one OS thread (blocks one
after another, barriers for __syncthreads, an exchange buffer for warp shuffles;
tests/cuda/sim/harness.hpp), with the launch geometry and template constants the
Python wrappers chose. float stands in for the element type. The wrappers then run
unchanged, and their results are compared with the MLX ops the CPU path uses.
Skipped where no C++20 compiler is found.
"""

import hashlib
import os
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

HARNESS = Path(__file__).parent / "sim"
CXX = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("clang++")
CXX_FLAGS = ["-std=c++20", "-O1", "-w"]


def _harness_runs(tmp: Path) -> bool:
    """Whether the harness builds and runs here: a block of 64 threads through a barrier and a shuffle."""
    if CXX is None:
        return False
    src = tmp / "probe.cpp"
    src.write_text('#include "harness.hpp"\nfloat out[64];\nint main() {\n'
                   '  sim_launch(128, 1, 64, [] { float v = threadIdx.x; __syncthreads();\n'
                   '    out[threadIdx.x] = __shfl_xor_sync(0xffffffff, v, 1); });\n'
                   '  return out[0] == 1.0f && out[33] == 32.0f ? 0 : 1;\n}\n')
    built = subprocess.run([CXX, *CXX_FLAGS, f"-I{HARNESS}", str(src), "-o", str(tmp / "probe")], capture_output=True)
    return built.returncode == 0 and subprocess.run([str(tmp / "probe")], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cuda_sim")
    if not _harness_runs(tmp):
        pytest.skip("no C++20 compiler with ucontext (g++ 10+ or clang++ 12+) to simulate the CUDA kernels")
    # The harness precompiled once, with the programs' own flags: a program then builds in ~0.7 s, not ~1.6 s
    # (the standard headers are most of it). Where the compiler makes none, the programs read the header itself.
    subprocess.run([CXX, *CXX_FLAGS, "-x", "c++-header", str(HARNESS / "harness.hpp"), "-o",
                    str(tmp / "harness.hpp.gch")], capture_output=True)
    return tmp


class SimulatedKernel:
    """Stands in for an mx.fast.cuda_kernel: same call, run by the CPU simulator."""

    def __init__(self, build_dir: Path, name: str, input_names: list, output_names: list, source: str):
        self.dir, self.name, self.inputs, self.outputs, self.source = build_dir, name, input_names, output_names, source
        self.calls = 0
        self.seen = {}

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes, **_):
        assert threadgroup[1:] == (1, 1) and grid[2] == 1, "the simulator takes x blocks and a y grid"
        # MLX caches a compiled kernel by name and template values only: two calls that share
        # them must share their inputs' dtypes, or the second runs the first one's kernel.
        key = (self.name, tuple((n, str(v)) for n, v in template))
        dtypes = tuple(a.dtype for a in inputs)
        assert self.seen.setdefault(key, dtypes) == dtypes, f"{self.name}: one cached kernel for inputs {dtypes}"
        consts = []
        for name, value in template:
            if isinstance(value, mx.Dtype):
                if name != "T":  # the harness's T; every element type is float here
                    consts.append(f"typedef float {name};")
            else:
                consts.append(f"constexpr int {name} = {int(value)};")
        ctypes = [{mx.int64: "long long", mx.int32: "int", mx.uint32: "unsigned"}.get(a.dtype, "float") for a in inputs]
        params = [f"const {c}* {n}" for c, n in zip(ctypes, self.inputs)] + [f"float* {n}" for n in self.outputs]
        sizes = [int(np.prod(s)) for s in output_shapes]
        reads = "\n".join(f"  auto i{k} = sim_read<{c}>(argv[{k + 1}], {a.size});"
                          for k, (c, a) in enumerate(zip(ctypes, inputs)))
        allocs = "\n".join(f"  std::vector<float> o{k}({n});" for k, n in enumerate(sizes))
        args = ", ".join([f"i{k}.data()" for k in range(len(inputs))] + [f"o{k}.data()" for k in range(len(sizes))])
        writes = "\n".join(f"  sim_write(argv[{len(inputs) + k + 1}], o{k});" for k in range(len(sizes)))
        program = (f'#include "harness.hpp"\n{chr(10).join(consts)}\n'
                   f"void body({', '.join(params)}) {{\n{self.source}\n}}\n"
                   f"int main(int argc, char** argv) {{\n{reads}\n{allocs}\n"
                   f"  sim_launch({grid[0]}, {grid[1]}, {threadgroup[0]}, [&] {{ body({args}); }});\n{writes}\n}}\n")
        tag = hashlib.sha1(program.encode()).hexdigest()[:16]
        exe = self.dir / f"{self.name}_{tag}"
        if not exe.exists():
            src = exe.with_suffix(".cpp")
            src.write_text(program)
            done = subprocess.run([CXX, *CXX_FLAGS, f"-I{self.dir}", f"-I{HARNESS}", str(src), "-o", str(exe)],
                                  capture_output=True, text=True)
            assert done.returncode == 0, done.stderr[-3000:]
        files_in = []
        for k, (c, a) in enumerate(zip(ctypes, inputs)):
            path = self.dir / f"{tag}_in{k}.bin"
            np.array(a.astype({"long long": mx.int64, "int": mx.int32, "unsigned": mx.uint32}.get(c, mx.float32))).tofile(path)
            files_in.append(str(path))
        files_out = [str(self.dir / f"{tag}_out{k}.bin") for k in range(len(sizes))]
        ran = subprocess.run([str(exe), *files_in, *files_out], capture_output=True, text=True, timeout=300)
        assert ran.returncode == 0, ran.stderr[-3000:]
        self.calls += 1
        return [mx.array(np.fromfile(f, dtype=np.float32).reshape(s)).astype(d)
                for f, s, d in zip(files_out, output_shapes, output_dtypes)]


# The folded backward's kernels for m's and B's gradients (kernels.B_PRODUCT_IN_SUMS, on): B's product summed in the
# column sums' pass, then the chunks added.
FOLDED_SUMS, FOLDED_GRAD = "meshtune_dora_column_and_b_sums", "meshtune_dora_magnitude_b_sums_grad"


@pytest.fixture
def simulated(build_dir, monkeypatch):
    """CUDA as far as meshtune can tell, with every kernel simulated; returns the kernels made."""
    from meshtune.adapters import kernels
    from meshtune.parallel import data_parallel, pack_kernel

    made = {}

    def kernel(name, inputs, outputs, source):
        made.setdefault(name, SimulatedKernel(build_dir, name, inputs, outputs, source))
        return made[name]

    monkeypatch.setattr(kernels, "_kernel", kernel)
    monkeypatch.setattr(pack_kernel, "kernel", kernel)
    monkeypatch.setattr(kernels, "on_cuda", lambda: True)
    monkeypatch.setattr(data_parallel, "on_cuda", lambda: True)
    return made


@pytest.mark.parametrize("r, inp, out", [(8, 2100, 45), (5, 70, 9), (16, 600, 17), (64, 200, 8)])  # A in 3, 1, 2, 4 tiles
def test_row_norm_kernel(simulated, r, inp, out):
    from meshtune.adapters import adapted_linear as AL, kernels

    k = mx.random.split(mx.random.key(r), 4)
    w = mx.random.normal((out, inp), key=k[0]) / 8
    a = mx.random.normal((inp, r), key=k[1]) / 8
    b = mx.random.normal((r, out), key=k[2]) / 8
    w_sq = (w * w).sum(-1)
    (norm,) = kernels.row_norms_cuda([w], [a], [b], [2.0])
    want_norm, _ = AL.dora_row_scale(a.T @ w.T, a, b, w_sq, mx.ones((out,)), 2.0, mx.float32)
    assert mx.allclose(norm, want_norm, rtol=1e-5).item()
    assert simulated["meshtune_dora_row_norm_1"].calls == 1


@pytest.mark.parametrize("most", [32, 2])  # one launch for the three layers; then two
def test_row_norms_of_several_layers_share_a_launch(simulated, monkeypatch, most):
    """Layers of one shape, each with its own W, A, B and scale: each gets its own norms."""
    from meshtune.adapters import adapted_linear as AL, kernels

    monkeypatch.setattr(kernels, "MAX_LAYERS_A_LAUNCH", most)
    r, inp, out = 4, 300, 21
    k = mx.random.split(mx.random.key(11), 9)
    ws = [mx.random.normal((out, inp), key=k[i]) / 8 for i in range(3)]
    as_ = [mx.random.normal((inp, r), key=k[3 + i]) / 8 for i in range(3)]
    bs = [mx.random.normal((r, out), key=k[6 + i]) / 8 for i in range(3)]
    scales = [2.0, 0.5, 7.0]
    got = kernels.row_norms_cuda(ws, as_, bs, scales)
    assert len(got) == 3
    for w, a, b, s, norm in zip(ws, as_, bs, scales, got):
        want, _ = AL.dora_row_scale(a.T @ w.T, a, b, (w * w).sum(-1), mx.ones((out,)), s, mx.float32)
        assert mx.allclose(norm, want, rtol=1e-5).item()
    launches = {n: kern.calls for n, kern in simulated.items() if n.startswith("meshtune_dora_row_norm")}
    assert launches == ({"meshtune_dora_row_norm_3": 1} if most == 32 else
                        {"meshtune_dora_row_norm_2": 1, "meshtune_dora_row_norm_1": 1})


def test_row_norms_take_layers_of_one_shape_only(simulated):
    from meshtune.adapters import kernels

    w, a, b = mx.zeros((8, 16)), mx.zeros((16, 2)), mx.zeros((2, 8))
    with pytest.raises(ValueError, match="one shape"):
        kernels.row_norms_cuda([w, mx.zeros((9, 16))], [a, a], [b, mx.zeros((2, 9))], [1.0, 1.0])


@pytest.mark.parametrize("warps, rows_per_warp", [(4, 1), (4, 2), (2, 1)])
def test_row_norm_kernel_block_layouts(simulated, monkeypatch, warps, rows_per_warp):
    """Fewer warps or rows a block (more blocks for a narrow layer, probes/dora_kernel_cost.py
    times them on a GPU) give the same norms: the block's rows, tile staging and last partial block."""
    from meshtune.adapters import adapted_linear as AL, kernels

    monkeypatch.setattr(kernels, "_WARPS", warps)
    monkeypatch.setattr(kernels, "_ROWS_PER_WARP", rows_per_warp)
    k = mx.random.split(mx.random.key(7), 3)
    r, inp, out = 8, 1100, 13  # 2 tiles of A, the last block part past the output
    w = mx.random.normal((out, inp), key=k[0]) / 8
    a = mx.random.normal((inp, r), key=k[1]) / 8
    b = mx.random.normal((r, out), key=k[2]) / 8
    (norm,) = kernels.row_norms_cuda([w], [a], [b], [2.0])
    want_norm, _ = AL.dora_row_scale(a.T @ w.T, a, b, (w * w).sum(-1), mx.ones((out,)), 2.0, mx.float32)
    assert mx.allclose(norm, want_norm, rtol=1e-5).item()


def test_row_norms_by_groups_of_rows(simulated, monkeypatch):
    """A block on groups of rows (kernels._ROW_GROUPS, each staged tile of A serving them all):
    the same sums in the same order as one group, so the same bits."""
    from meshtune.adapters import kernels

    k = mx.random.split(mx.random.key(12), 6)
    ws = [mx.random.normal((37, 700), key=k[i]) / 8 for i in range(2)]  # 2 tiles of A; the last block part-filled
    as_ = [mx.random.normal((700, 8), key=k[2 + i]) / 8 for i in range(2)]
    bs = [mx.random.normal((8, 37), key=k[4 + i]) / 8 for i in range(2)]
    want = kernels.row_norms_cuda(ws, as_, bs, [2.0, 0.5])
    for groups in (1, 3):
        monkeypatch.setattr(kernels, "_ROW_GROUPS", groups)
        for got, ref in zip(kernels.row_norms_cuda(ws, as_, bs, [2.0, 0.5]), want):
            assert mx.array_equal(got, ref).item(), groups


def _one_layer(seed: int, r: int, inp: int, dtype=mx.bfloat16, out: int = 37) -> tuple[list, list, list, list]:
    """One layer's W (out, inp) in `dtype`, A, B and m for the row-norm kernels."""
    k = mx.random.split(mx.random.key(seed), 4)
    ws = [(mx.random.normal((out, inp), key=k[0]) / 8).astype(dtype)]
    as_, bs = [mx.random.normal((inp, r), key=k[1]) / 8], [mx.random.normal((r, out), key=k[2]) / 8]
    return ws, as_, bs, [mx.random.uniform(0.5, 2.0, (out,), key=k[3])]


def _both_kernels(ws, as_, bs, ms) -> tuple:
    """row_norms_and_scaled_cuda's (norms, W', rs) and row_norms_cuda's norms, scale 2."""
    from meshtune.adapters import kernels

    return kernels.row_norms_and_scaled_cuda(ws, as_, bs, [2.0], ms) + (kernels.row_norms_cuda(ws, as_, bs, [2.0]),)


def _assert_same_bits(got: tuple, want: tuple, label) -> None:
    for got_part, want_part in zip(got, want):
        for x, y in zip(got_part, want_part):
            assert mx.array_equal(x, y).item(), label


@pytest.mark.parametrize("r, inp, out, dtype", [
    (8, 2100, 45, mx.bfloat16),  # 9 segments, the last short; 45 rows: one block of rows, partly idle
    (5, 600, 130, mx.float32),  # r * n not a multiple of 4: A staged a float at a time; two blocks of rows
    (64, 200, 9, mx.bfloat16),  # A in 4 tiles of 64 rows a segment
    (3, 70, 19, mx.bfloat16),  # rows read element by element (70 is not a multiple of 8)
])
def test_two_pass_row_norms(simulated, monkeypatch, r, inp, out, dtype):
    """kernels._TWO_PASS: the norms by segments of columns, then W' row by row; two layers in one
    launch of each pass: the norms match the MLX ops', rs = m / norm and W' = rs W, and the
    norms with and without W' are the same bits (the segments added in the same order)."""
    from meshtune.adapters import adapted_linear as AL, kernels

    monkeypatch.setattr(kernels, "_TWO_PASS", True)
    layers = [_one_layer(seed, r, inp, dtype, out) for seed in (r, r + 1)]
    ws, as_, bs, ms = ([layer[j][0] for layer in layers] for j in range(4))
    norms, scaled, row_scales = kernels.row_norms_and_scaled_cuda(ws, as_, bs, [2.0, 0.5], ms)
    alone = kernels.row_norms_cuda(ws, as_, bs, [2.0, 0.5])
    for w, a, b, m, s, n, sw, rs, n_alone in zip(ws, as_, bs, ms, (2.0, 0.5), norms, scaled, row_scales, alone):
        wf = w.astype(mx.float32)
        want, _ = AL.dora_row_scale(a.T @ wf.T, a, b, (wf * wf).sum(-1), mx.ones((out,)), s, mx.float32)
        assert mx.allclose(n, want, rtol=1e-5).item()
        assert mx.array_equal(n, n_alone).item()
        # The simulator's WT is float: rs is not rounded to bf16 here (on a GPU it is, tests/*/test_adapted_linear.py).
        assert mx.allclose(rs, m / n, rtol=1e-6).item()
        assert sw.dtype == dtype and mx.array_equal(sw, (rs[:, None] * wf).astype(dtype)).item()
    calls = {"meshtune_dora_segment_sums_2": 2, "meshtune_dora_scale_rows_2": 1, "meshtune_dora_norms_from_sums_2": 1}
    assert {name: simulated[name].calls for name in calls} == calls


@pytest.mark.parametrize("r, inp", [(8, 2100), (5, 600), (3, 70)])  # A in 3, 1, 1 tiles; r * n not a multiple of 4
def test_row_norm_kernel_stages_a_by_quads_or_floats_alike(simulated, monkeypatch, r, inp):
    """A's tiles staged by float4 loads (kernels._STAGE_QUADS, the default; the simulator's arrays
    are 16-byte aligned, so that path runs here) or a float at a time: the same shared tile,
    so the same norms, W' and rs to the bit, with a tail of floats after the last whole float4."""
    from meshtune.adapters import kernels

    case = _one_layer(r, r, inp)
    results = {}
    for quads in (True, False):
        monkeypatch.setattr(kernels, "_STAGE_QUADS", quads)
        results[quads] = _both_kernels(*case)
    _assert_same_bits(results[True], results[False], (r, inp))


@pytest.mark.parametrize("tile_floats", [2048, 4096])
def test_smaller_tiles_of_a_give_the_same_bits(simulated, monkeypatch, tile_floats):
    """kernels._TILE_FLOATS: A staged 256 (or 512) rows at a time instead of 1024 leaves each lane
    the same columns in the same order (16-byte loads still), so the norms, W' and rs are the default's to the bit."""
    from meshtune.adapters import kernels

    case = _one_layer(9, 8, 2100)
    want = _both_kernels(*case)
    monkeypatch.setattr(kernels, "_TILE_FLOATS", tile_floats)
    assert kernels._row_scale_layout(8, 2100, 2)[2] == tile_floats // 8
    _assert_same_bits(_both_kernels(*case), want, tile_floats)


def test_folded_launch_stages_a_by_smaller_tiles(simulated, monkeypatch):
    """kernels.FOLDED_TILE_ROWS: the staged folded launch (norms and W') holds 256 rows of A a tile at rank 8
    (the norms-only kernel 1024), and gives what 1024-row tiles give, to the bit; a tile under a warp's
    16-byte loads of W is not taken."""
    from meshtune.adapters import kernels

    assert kernels._row_scale_layout(8, 6144, 2, folded=True)[1:] == (8, 256)  # the 1B model's down projection
    assert kernels._row_scale_layout(8, 6144, 2)[1:] == (8, 1024)
    assert kernels._row_scale_layout(64, 6144, 2, folded=True)[2] == kernels._row_scale_layout(64, 6144, 2)[2]
    monkeypatch.setattr(kernels, "FOLDED_TILE_ROWS", 128)
    assert kernels._row_scale_layout(8, 6144, 2, folded=True)[1:] == (8, 1024)  # 128 < 32 lanes x 8 columns
    case = _one_layer(9, 8, 2100)
    monkeypatch.setattr(kernels, "FOLDED_TILE_ROWS", 1024)
    want = _both_kernels(*case)
    monkeypatch.setattr(kernels, "FOLDED_TILE_ROWS", 256)
    _assert_same_bits(_both_kernels(*case), want, 256)


@pytest.mark.parametrize("inp, out, r, dtype, rows, batch", [
    (256, 45, 8, mx.bfloat16, 16, 3),  # 32 threads of 8 columns; 45 rows: blocks of 16, batches of 3, the last short
    (512, 70, 8, mx.bfloat16, 64, 2),  # 64 threads (two warps added through shared memory); one block, part-filled
    (384, 19, 5, mx.float32, 8, 2),  # 4 columns a thread (float32), rank 5, three warps
])
def test_resident_folded_kernel_matches_the_staged_one(simulated, monkeypatch, inp, out, r, dtype, rows, batch):
    """kernels._RESIDENT_A: the folded launch with A held in registers (a thread's columns of every row) gives the
    staged kernel's norms and rs (float32 sums in another order: within 1e-6), W' = rs W from those rs, and A and
    B' = B rs, two layers a launch, rows not a multiple of a block or a batch."""
    from meshtune.adapters import kernels

    monkeypatch.setattr(kernels, "RESIDENT_BATCH", batch)
    k = mx.random.split(mx.random.key(inp + out), 8)
    ws = [(mx.random.normal((out, inp), key=k[i]) / 8).astype(dtype) for i in (0, 1)]
    a = [mx.random.normal((inp, r), key=k[i]) / 8 for i in (2, 3)]
    b = [mx.random.normal((r, out), key=k[i]) / 8 for i in (4, 5)]
    ms = [mx.random.uniform(0.5, 2.0, (out,), key=k[i]) for i in (6, 7)]
    monkeypatch.setattr(kernels, "RESIDENT_ROWS", rows)
    got = kernels.row_norms_and_scaled_cuda(ws, a, b, [2.0, 0.5], ms, factors=True)
    assert simulated[kernels.row_norm_kernel_name(2, True, True, resident=True)].calls == 1
    monkeypatch.setattr(kernels, "_RESIDENT_A", False)
    want = kernels.row_norms_and_scaled_cuda(ws, a, b, [2.0, 0.5], ms, factors=True)
    assert simulated[kernels.row_norm_kernel_name(2, True, True)].calls == 1
    norms, scaled, row_scales, a_cast, b_scaled = got
    for n, want_n, rs, want_rs, m, w, sw, ac, a_l, bs, b_l in zip(norms, want[0], row_scales, want[2], ms, ws,
                                                                 scaled, a_cast, a, b_scaled, b):
        assert mx.allclose(n, want_n, rtol=1e-6).item() and mx.allclose(rs, want_rs, rtol=1e-6).item()
        assert mx.allclose(rs, m / n, rtol=1e-6).item()
        assert mx.array_equal(sw, (rs[:, None] * w.astype(mx.float32)).astype(dtype)).item()
        assert mx.array_equal(ac, a_l.astype(dtype)).item() and mx.array_equal(bs, (b_l * rs).astype(dtype)).item()


def test_resident_folded_kernel_reads_quantized_weights_packed(simulated, monkeypatch):
    """The resident-A launch on a 4-bit base read packed gives what it gives on the dequantized weight."""
    import mlx.nn as nn

    from meshtune.adapters import kernels

    k = mx.random.split(mx.random.key(5), 8)
    layers = [nn.QuantizedLinear.from_linear(nn.Linear(512, 37, bias=False), group_size=64, bits=4) for _ in range(2)]
    packed = [kernels.packed_weight(layer) for layer in layers]
    dense = [mx.dequantize(w.packed, w.scales, w.biases, group_size=64, bits=4) for w in packed]
    a = [mx.random.normal((512, 8), key=k[i]) / 8 for i in range(2)]
    b = [mx.random.normal((8, 37), key=k[2 + i]) for i in range(2)]
    ms = [mx.random.uniform(0.5, 2.0, (37,), key=k[4 + i]) for i in range(2)]
    monkeypatch.setattr(kernels, "RESIDENT_ROWS", 16)
    want = kernels.row_norms_and_scaled_cuda(dense, a, b, [2.0, 0.5], ms, factors=True)
    got = kernels.row_norms_and_scaled_cuda(packed, a, b, [2.0, 0.5], ms, factors=True)
    assert simulated[kernels.row_norm_kernel_name(2, True, True, packed=True, resident=True)].calls == 1
    assert simulated[kernels.row_norm_kernel_name(2, True, True, resident=True)].calls == 1
    for kind, gots, wants in zip(("norm", "W'", "rs", "A", "B'"), got, want):
        for g, w in zip(gots, wants):
            assert g.shape == w.shape and mx.allclose(g, w, rtol=1e-6, atol=1e-6).item(), kind


@pytest.mark.parametrize("loads", [4, 8])
@pytest.mark.parametrize("inp, dtype", [(2100, mx.bfloat16), (600, mx.float32), (70, mx.bfloat16)])
def test_scaled_weight_pass_with_loads_in_flight_writes_the_same_bits(simulated, monkeypatch, loads, inp, dtype):
    """kernels._SCALED_LOADS: W' = rs W written with several loads of the row in flight before their
    stores gives the one-at-a-time pass's bits, for rows whose length is not a multiple of a batch
    (2100 bf16: 8 columns a lane, 1024 or 2048 a batch) and rows read element by element (70)."""
    from meshtune.adapters import kernels

    ws, as_, bs, ms = _one_layer(inp, 8, inp, dtype)
    want = kernels.row_norms_and_scaled_cuda(ws, as_, bs, [2.0], ms)
    monkeypatch.setattr(kernels, "_SCALED_LOADS", loads)
    got = kernels.row_norms_and_scaled_cuda(ws, as_, bs, [2.0], ms)
    assert mx.allclose(want[1][0], (want[2][0][:, None] * ws[0].astype(mx.float32)).astype(dtype), rtol=1e-2).item()
    _assert_same_bits(got, want, loads)


@pytest.mark.parametrize("block", [(8, 2, 4), (8, 4, 2), (16, 2, 1), (4, 2, 4), (8, 1, 4)])
def test_scaled_row_norm_kernel_block_layouts(simulated, monkeypatch, block):
    """The folded step's kernel (norms, W' = rs W, rs) in the block layouts the GPU probe sweeps
    (scripts/probes/dora_kernel_cost.py) gives the default layout's bits."""
    from meshtune.adapters import kernels

    k = mx.random.split(mx.random.key(21), 7)
    ws = [(mx.random.normal((45, 528), key=k[i]) / 8).astype(mx.bfloat16) for i in range(2)]  # a part-filled block
    as_ = [mx.random.normal((528, 8), key=k[2 + i]) / 8 for i in range(2)]
    bs = [mx.random.normal((8, 45), key=k[4 + i]) / 8 for i in range(2)]
    ms = [mx.random.uniform(0.5, 2.0, (45,), key=k[6])] * 2
    want = kernels.row_norms_and_scaled_cuda(ws, as_, bs, [2.0, 0.5], ms)
    monkeypatch.setattr(kernels, "_WARPS", block[0])
    monkeypatch.setattr(kernels, "_ROWS_PER_WARP", block[1])
    monkeypatch.setattr(kernels, "_ROW_GROUPS", block[2])
    _assert_same_bits(kernels.row_norms_and_scaled_cuda(ws, as_, bs, [2.0, 0.5], ms), want, block)


def test_probe_kernel_variants(simulated, monkeypatch):
    """The candidate kernels the GPU probes time (scripts/probes/dora_variants.py: one launch
    each, the last block of a group adding the partials) give the current kernels' results."""
    import sys

    from meshtune.adapters import adapted_linear as AL, kernels

    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "scripts" / "probes"))
    sys.modules.pop("dora_variants", None)
    import dora_variants as V

    monkeypatch.setattr(kernels, "_COTANGENT_BLOCKS", 8)  # 3 chunks of rows: partials to add
    k = mx.random.split(mx.random.key(5), 4)
    g, y = mx.random.normal((100, 40), key=k[0]), mx.random.normal((100, 40), key=k[1])
    m = mx.random.uniform(0.5, 2, (40,), key=k[2]).at[3].multiply(0.0)
    norm = mx.random.uniform(0.5, 2, (40,), key=k[3])
    for got, want in zip(V.one_launch_cotangent(g, y, m, norm), AL.dora_cotangent(g, y, m / norm, norm)):
        assert mx.allclose(got, want, rtol=1e-4, atol=1e-6).item()


def test_probe_scaled_weight_product(simulated, monkeypatch):
    """The probes' DoRA product on W' = rs W made by an MLX multiply (scripts/probes/scaled_weight.py)
    gives the current product's output and gradients."""
    import sys

    from meshtune.adapters import kernels
    from meshtune.adapters.adapted_linear import adapted_linear

    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "scripts" / "probes"))
    sys.modules.pop("scaled_weight", None)
    import scaled_weight as SW

    monkeypatch.setattr(kernels, "_COTANGENT_BLOCKS", 8)  # chunks of rows: partials to add
    k = mx.random.split(mx.random.key(7), 5)
    x = mx.random.normal((2, 50, 24), key=k[0])
    w = mx.random.normal((40, 24), key=k[1]) * 0.2
    a, b = mx.random.normal((24, 4), key=k[2]) * 0.1, mx.random.normal((4, 40), key=k[3]) * 0.1
    m = mx.random.uniform(0.5, 2, (40,), key=k[4]).at[3].multiply(0.0)
    norm = mx.linalg.norm(w + 2.0 * (a @ b).T, axis=-1)
    w_sq = (w * w).sum(-1)

    def loss(fn):
        return lambda x, a, b, m: (fn(x, a, b, m) ** 2).sum()

    want = mx.value_and_grad(loss(lambda x, a, b, m: adapted_linear(x, w, a, b, 2.0, magnitude=m, w_sq=w_sq, norm=norm)),
                             argnums=(0, 1, 2, 3))(x, a, b, m)
    got = mx.value_and_grad(loss(lambda x, a, b, m: SW.scaled_weight_linear(x, w, a, b, 2.0, m, norm)),
                            argnums=(0, 1, 2, 3))(x, a, b, m)
    assert mx.allclose(got[0], want[0], rtol=1e-5).item()
    for g1, g2 in zip(got[1], want[1]):
        assert mx.allclose(g1, g2, rtol=1e-4, atol=1e-5).item()
    assert simulated[FOLDED_SUMS].calls == 1


def _probe_step_model(monkeypatch, hidden: int, intermediate: int):
    """(probe_dora_step, a 1-block DoRA model on the probe's adapters, loss-and-gradient of one batch under the
    step's norms): DoRALinear.__call__ is put back after the test."""
    import sys

    import mlx.nn as nn

    from meshtune.adapters import dora as D, step_norms
    from meshtune.bench.models import Shape, add_adapters, build_model, perturb_adapters

    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "scripts"))
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "scripts" / "probes"))
    sys.modules.pop("probe_dora_step", None)
    import probe_dora_step as P

    monkeypatch.setattr(D.DoRALinear, "__call__", D.DoRALinear.__call__)  # put back after the test
    model = build_model(Shape(arch="qwen3", layers=1, hidden=hidden, intermediate=intermediate, heads=2, kv_heads=1,
                              vocab=64), mx.float32, quantized=False, seed=0)
    add_adapters(model, impl="meshtune", kind="dora", num_layers=-1, rank=4, scale=2.0)
    perturb_adapters(model, seed=1)
    model.train()
    tok = mx.random.randint(0, 64, (2, 9), key=mx.random.key(3))

    def value_and_grad():
        with step_norms.step_row_norms(model, tok[:, :-1].size):
            return nn.value_and_grad(model, lambda m: nn.losses.cross_entropy(m(tok[:, :-1]), tok[:, 1:]).mean())(model)

    return P, model, value_and_grad


def _probe_variant_step(P, model, value_and_grad, variant: str):
    """(loss, gradients) of the probe model's step with probe_dora_step's `variant` (its prepare step run first),
    every setting the variant changed put back after."""
    from meshtune.adapters import dora as D

    step = P.VARIANTS[variant]
    try:
        if hasattr(step, "prepare"):
            step.prepare(model)
        D.DoRALinear.__call__ = step
        got_l, got_g = value_and_grad()
        mx.eval(got_l, got_g)
    finally:
        P._reset()
    return got_l, got_g


@pytest.mark.parametrize("variant, kernel", [
    ("m and B gradients in one launch (last block)", "probe_dora_magnitude_b_one_launch"),
    ("folded tiles of 1024 rows of A (before)", None),
])
def test_probe_step_variants_train_as_the_current_step(simulated, monkeypatch, variant, kernel):
    """probe_dora_step's variants of this session's kernels (m's and B's gradients in one launch, the staged
    launch's earlier tiles): the current step's loss and gradients, to the bit."""
    from mlx.utils import tree_flatten

    # 128 wide: float32 rows of 128 fit the resident layout (32 threads of 4 columns); the 256-wide down projection
    # does not (2 warps of 4 columns: fine) -- both layouts run.
    from meshtune.adapters import kernels

    if kernel == "probe_dora_magnitude_b_one_launch":  # a variant of the two launches after B's product by a matmul
        monkeypatch.setattr(kernels, "B_PRODUCT_IN_SUMS", False)
    P, model, value_and_grad = _probe_step_model(monkeypatch, hidden=128, intermediate=256)
    want_l, want_g = value_and_grad()
    mx.eval(want_l, want_g)
    got_l, got_g = _probe_variant_step(P, model, value_and_grad, variant)
    if kernel is not None:
        assert _calls(simulated, kernel) >= 1
    assert mx.array_equal(got_l, want_l).item()
    want = dict(tree_flatten(want_g))
    for key, value in tree_flatten(got_g):
        assert mx.array_equal(value, want[key]).item(), key


def test_probe_unmerged_variant_takes_the_unmerged_launch(simulated, monkeypatch):
    """probe_dora_step's "folded not merged (before)": the step's launches write W' = rs W (not the merged weight)
    and the step's loss and gradients are the current (merged) step's to float32 rounding."""
    from mlx.utils import tree_flatten

    from meshtune.adapters import kernels

    P, model, value_and_grad = _probe_step_model(monkeypatch, hidden=128, intermediate=256)
    want_l, want_g = value_and_grad()
    mx.eval(want_l, want_g)
    unmerged = [name for name in simulated if name.startswith("meshtune_dora_row_norm") and "merged" not in name]
    assert not unmerged and any("merged" in name for name in simulated)
    got_l, got_g = _probe_variant_step(P, model, value_and_grad, "folded not merged (before)")
    assert kernels.MERGED_FOLD  # put back
    assert any(name.startswith("meshtune_dora_row_norm") and "merged" not in name for name in simulated)
    assert mx.allclose(got_l, want_l, rtol=1e-5).item()
    want = dict(tree_flatten(want_g))
    for key, value in tree_flatten(got_g):
        assert mx.allclose(value, want[key], rtol=1e-4, atol=1e-6).item(), key


@pytest.mark.parametrize("variant, launches_in_step", [("bound: folded with W' held (no norm launches)", 0),
                                                       ("bound: folded with W' held in the products (norms launched)", 1)])
def test_probe_held_fold_bound_starts_as_the_current_step(simulated, monkeypatch, variant, launches_in_step):
    """probe_dora_step's "bound: folded with W' held" variants: the norms, W' and rs taken once before the step
    give, at those parameters, the current folded step's loss and gradients, with no norm launch in the step
    or with the step's own launches still made (their W' a dependency of the held one)."""
    from mlx.utils import tree_flatten

    from meshtune.adapters import dora as D

    P, model, value_and_grad = _probe_step_model(monkeypatch, hidden=32, intermediate=64)
    want_l, want_g = value_and_grad()
    step_kernel = _step_norm_kernel(fold=True, layers=1)
    launches = _calls(simulated, step_kernel)
    held_kernel = "meshtune_dora_row_norm_scaled_1"  # the preparation's, without A and B'
    before = _calls(simulated, held_kernel)
    variant = P.VARIANTS[variant]
    try:
        variant.prepare(model)
        assert _calls(simulated, held_kernel) == before + 7  # one a layer (q, k, v, o, gate, up, down)
        D.DoRALinear.__call__ = variant
        got_l, got_g = value_and_grad()
        # the down projection's launch (the only layer of its shape) in the step, or none
        held = 7 if held_kernel == step_kernel else 0
        assert _calls(simulated, step_kernel) == launches + held + launches_in_step
    finally:
        P._reset()
    assert mx.allclose(got_l, want_l, rtol=1e-6).item()
    want = dict(tree_flatten(want_g))
    for key, value in tree_flatten(got_g):
        assert mx.allclose(value, want[key], rtol=1e-5, atol=1e-7).item(), key


@pytest.mark.parametrize("inp, out", [(64, 40), (24, 19)])  # 16-byte accesses; 24 x 19: ragged rows, one a lane
def test_row_norm_kernel_writing_scaled_weights(simulated, inp, out):
    """row_norms_and_scaled_cuda: row_norms_cuda's norms, W' = rs W and rs, two layers in one launch."""
    from meshtune.adapters import kernels

    k = mx.random.split(mx.random.key(inp + out), 8)
    ws = [mx.random.normal((out, inp), key=k[i]) * 0.2 for i in (0, 1)]
    a = [mx.random.normal((inp, 4), key=k[i]) * 0.1 for i in (2, 3)]
    b = [mx.random.normal((4, out), key=k[i]) * 0.1 for i in (4, 5)]
    ms = [mx.random.uniform(0.5, 2, (out,), key=k[i]) for i in (6, 7)]
    norms, scaled, row_scales = kernels.row_norms_and_scaled_cuda(ws, a, b, [2.0, 0.5], ms)
    want = kernels.row_norms_cuda(ws, a, b, [2.0, 0.5])
    for n, want_n, w, m, sw, rs in zip(norms, want, ws, ms, scaled, row_scales):
        assert mx.allclose(n, want_n, rtol=1e-5).item()
        assert mx.allclose(rs, m / n, rtol=1e-6).item()
        assert mx.allclose(sw, (m / n)[:, None] * w, rtol=1e-5, atol=1e-7).item()
    assert simulated["meshtune_dora_row_norm_scaled_2"].calls == 1


@pytest.mark.parametrize("resident", [True, False])
@pytest.mark.parametrize("inp, out, r, dtype, quantized", [
    (256, 45, 8, mx.bfloat16, False),  # bf16: 8 columns a lane or a thread
    (384, 19, 5, mx.float32, False),  # rank 5, 4 columns a lane
    (512, 37, 8, mx.bfloat16, True),  # a 4-bit base read packed
])
def test_merged_folded_launch_writes_the_whole_adapted_weight(simulated, monkeypatch, resident, inp, out, r, dtype,
                                                               quantized):
    """kernels.MERGED_FOLD: with `merged` the folded launch (A resident or staged, dense or packed base) writes
    W' = rs (W + s (A B)^T), each element the one its norm was taken of; norms, rs, A and B' are the unmerged
    launch's, bit for bit."""
    import mlx.nn as nn

    from meshtune.adapters import kernels

    monkeypatch.setattr(kernels, "_RESIDENT_A", resident)
    monkeypatch.setattr(kernels, "RESIDENT_ROWS", 16)
    k = mx.random.split(mx.random.key(inp + out + r), 8)
    if quantized:
        layers = [nn.QuantizedLinear.from_linear(nn.Linear(inp, out, bias=False), group_size=64, bits=4)
                  for _ in range(2)]
        ws = [kernels.packed_weight(layer) for layer in layers]
        dense = [mx.dequantize(w.packed, w.scales, w.biases, group_size=64, bits=4) for w in ws]
    else:
        ws = dense = [(mx.random.normal((out, inp), key=k[i]) / 8).astype(dtype) for i in (0, 1)]
    a = [mx.random.normal((inp, r), key=k[i]) / 8 for i in (2, 3)]
    b = [mx.random.normal((r, out), key=k[i]) / 2 for i in (4, 5)]
    ms = [mx.random.uniform(0.5, 2.0, (out,), key=k[i]) for i in (6, 7)]
    scales = [2.0, 0.5]
    got = kernels.row_norms_and_scaled_cuda(ws, a, b, scales, ms, factors=True, merged=True)
    want = kernels.row_norms_and_scaled_cuda(ws, a, b, scales, ms, factors=True)
    vec = 16 // dense[0].dtype.size if not quantized else kernels._packed_layout(r, ws[0])[1]
    on_resident = resident and kernels._resident_layout(r, inp, vec)
    assert on_resident == resident  # each case takes the layout it names
    assert simulated[kernels.row_norm_kernel_name(2, True, True, packed=quantized, resident=resident,
                                                  merged=True)].calls == 1
    for kind, gots, wants in zip(("norm", "rs", "A", "B'"), (got[0], *got[2:]), (want[0], *want[2:])):
        for g, w in zip(gots, wants):
            assert mx.array_equal(g, w).item(), kind
    for w, a_l, b_l, s, rs, sw in zip(dense, a, b, scales, got[2], got[1]):
        adapted = w.astype(mx.float32) + s * (a_l @ b_l).T
        assert sw.dtype == w.dtype
        reference = (rs[:, None] * adapted).astype(w.dtype).astype(mx.float32)
        # float32 sums of r products in another order: within an ulp of W's dtype
        assert mx.allclose(sw.astype(mx.float32), reference, rtol=2 ** -7 if w.dtype == mx.bfloat16 else 1e-6,
                           atol=1e-6).item()
        assert not mx.allclose(sw.astype(mx.float32), (rs[:, None] * w.astype(mx.float32)), atol=1e-3).item()


def test_only_the_folded_one_pass_launch_merges(simulated, monkeypatch):
    """A merged W' is the folded launch's: the norms-only launch and the two-pass kernels refuse it."""
    from meshtune.adapters import kernels

    w, a, b, m = mx.ones((8, 32)), mx.ones((32, 4)), mx.ones((4, 8)), mx.ones((8,))
    with pytest.raises(ValueError, match="folded launch"):
        kernels._row_norms([w], [a], [b], [1.0], None, merged=True)
    monkeypatch.setattr(kernels, "_TWO_PASS", True)
    with pytest.raises(ValueError, match="merged W'"):
        kernels.row_norms_and_scaled_cuda([w], [a], [b], [1.0], [m], merged=True)


def test_a_launch_of_twelve_layers_gives_each_layer_its_own_outputs(simulated):
    """A folded launch of more than kernels.SPLIT_PARTS layers (its outputs' views from nested splits): each
    layer's norms, W', rs, A and B' are the ones a launch of that layer alone writes, bit for bit."""
    from meshtune.adapters import kernels

    n, inp, out, r = 12, 24, 19, 3
    k = mx.random.split(mx.random.key(12), 4 * n)
    ws = [mx.random.normal((out, inp), key=k[i]) * 0.2 for i in range(n)]
    a = [mx.random.normal((inp, r), key=k[n + i]) * 0.1 for i in range(n)]
    b = [mx.random.normal((r, out), key=k[2 * n + i]) * 0.1 for i in range(n)]
    ms = [mx.random.uniform(0.5, 2, (out,), key=k[3 * n + i]) for i in range(n)]
    scales = [0.5 + i for i in range(n)]
    together = kernels.row_norms_and_scaled_cuda(ws, a, b, scales, ms, factors=True)
    assert [len(part) for part in together] == [n] * 5
    for i in range(n):
        alone = kernels.row_norms_and_scaled_cuda(ws[i:i + 1], a[i:i + 1], b[i:i + 1], scales[i:i + 1], ms[i:i + 1],
                                                  factors=True)
        for got, want in zip((part[i] for part in together), (part[0] for part in alone)):
            assert got.shape == want.shape and mx.array_equal(got, want).item(), i
    assert simulated[f"meshtune_dora_row_norm_scaled_factors_{n}"].calls == 1


@pytest.mark.parametrize("n", [1, 2, 10, 11, 28, 32, 100])  # a launch takes 32 layers at most
def test_layer_views_are_split_parts_in_few_graph_nodes(n):
    """kernels.layer_views: mx.split's n parts (same values and shapes, no copies), and as Split nodes of at
    most SPLIT_PARTS parts, not MLX's Slice a part beyond 10 (a node a layer for the host on every step)."""
    import io
    import re

    from meshtune.adapters import kernels

    x = mx.arange(n * 6).reshape(n * 3, 2) + 0
    views = kernels.layer_views(x, n)
    dot = io.StringIO()
    mx.export_to_dot(dot, *views)
    nodes = Counter(re.findall(r'label ="([^"]+)"', dot.getvalue()))
    assert nodes["Slice"] == 0
    assert nodes["Split"] <= (0 if n == 1 else 1 + -(-n // kernels.SPLIT_PARTS))
    want = mx.split(x, n) if n > 1 else [x]
    assert len(views) == n
    for got, ref in zip(views, want):
        assert got.shape == ref.shape and mx.array_equal(got, ref).item()


@pytest.mark.parametrize("inp, out, r, dtype", [(64, 40, 4, mx.bfloat16), (24, 19, 3, mx.float32),
                                                (40, 70, 40, mx.bfloat16)])  # rank 40: B' a lane past 32
def test_row_norm_kernel_writing_factors(simulated, inp, out, r, dtype):
    """row_norms_and_scaled_cuda(factors=True) (kernels._WRITE_FACTORS): the same norms, W' and rs as without,
    and each layer's A and B' = B rs in W's dtype as the layers would cast them, to the bit, two layers a launch."""
    from meshtune.adapters import kernels

    k = mx.random.split(mx.random.key(inp + r), 8)
    ws = [(mx.random.normal((out, inp), key=k[i]) * 0.2).astype(dtype) for i in (0, 1)]
    a = [mx.random.normal((inp, r), key=k[i]) * 0.1 for i in (2, 3)]
    b = [mx.random.normal((r, out), key=k[i]) * 0.1 for i in (4, 5)]
    ms = [mx.random.uniform(0.5, 2, (out,), key=k[i]) for i in (6, 7)]
    want = kernels.row_norms_and_scaled_cuda(ws, a, b, [2.0, 0.5], ms)
    got = kernels.row_norms_and_scaled_cuda(ws, a, b, [2.0, 0.5], ms, factors=True)
    _assert_same_bits(got[:3], want, "norms, W' and rs")
    for a_cast, b_scaled, a_l, b_l, rs in zip(*got[3:], a, b, want[2]):
        assert a_cast.dtype == dtype and b_scaled.dtype == dtype
        assert mx.array_equal(a_cast, a_l.astype(dtype)).item()
        assert mx.array_equal(b_scaled, (b_l * rs).astype(dtype)).item()
    assert simulated["meshtune_dora_row_norm_scaled_factors_2"].calls == 1


def test_magnitude_gradient_kernel_alone(simulated, monkeypatch):
    """magnitude_grad_cuda: cotangent_cuda's m gradient without its g * rs (chunks of rows added in order)."""
    from meshtune.adapters import kernels

    monkeypatch.setattr(kernels, "_COTANGENT_BLOCKS", 8)
    k = mx.random.split(mx.random.key(11), 3)
    g, y = mx.random.normal((100, 40), key=k[0]), mx.random.normal((100, 40), key=k[1])
    m = mx.random.uniform(1.0, 4.0, (40,), key=k[2]).at[3].multiply(0.0)
    norm = mx.full((40,), 2.0)
    assert mx.array_equal(kernels.magnitude_grad_cuda(g, y, m, norm), kernels.cotangent_cuda(g, y, m, norm)[1]).item()
    assert simulated["meshtune_dora_column_sums"].calls == 1


@pytest.mark.parametrize("rows, cols, dtype", [
    (1000, 70, mx.float32),    # 31 chunks of rows: the last block of each strip adds them
    (333, 48, mx.bfloat16),    # 8 columns a thread, 10 chunks, the last one short
    (64, 4096, mx.bfloat16),   # 16 strips of 2 chunks: a ticket counter each
])
def test_probe_one_launch_magnitude_gradient_is_the_two_launches(simulated, monkeypatch, rows, cols, dtype):
    """scripts/probes/dora_variants.py's one-launch m and B gradients (column sums by chunks, the last block of a
    strip adding them in the second launch's order) give kernels.magnitude_grad_cuda's to the bit. Blocks run one
    after another here: that only the last block finishes a strip is for a GPU to show (the probe checks it there)."""
    from pathlib import Path

    from meshtune.adapters import kernels

    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "scripts" / "probes"))
    import dora_variants

    k = mx.random.split(mx.random.key(cols), 5)
    g = mx.random.normal((rows, cols), key=k[0]).astype(dtype)
    y = mx.random.normal((rows, cols), key=k[1]).astype(dtype)
    m = mx.random.uniform(1.0, 4.0, (cols,), key=k[2]).at[5].multiply(0.0)
    stacked = kernels.StackedNorm(mx.random.uniform(0.5, 3.0, (3 * cols,), key=k[3]), cols, cols)
    product = mx.random.normal((12, cols), key=k[4]).astype(dtype)
    got = dora_variants.one_launch_magnitude_b_grad(g, y, m, stacked, product, 1.5, rs_dtype=dtype)
    want = kernels.magnitude_grad_cuda(g, y, m, stacked, b_product=product, b_scale=1.5, rs_dtype=dtype)
    assert mx.array_equal(got[0], want[0]).item() and mx.array_equal(got[1], want[1]).item()
    assert got[0][5].item() == 0.0 and simulated["probe_dora_magnitude_b_one_launch"].calls == 1


@pytest.mark.parametrize("bits, group_size, inp", [(4, 64, 2112), (8, 32, 320), (2, 64, 1088)])
def test_folded_launch_reads_quantized_weights_packed(simulated, bits, group_size, inp):
    """row_norms_and_scaled_cuda on PackedWeight (affine, 2/4/8 bits; A in more than one tile for 4 bits): the
    norms, W', rs, A and B' it gives from the dequantized weight, two layers in one launch."""
    import mlx.nn as nn

    from meshtune.adapters import kernels

    k = mx.random.split(mx.random.key(21), 8)
    layers = [nn.QuantizedLinear.from_linear(nn.Linear(inp, 45, bias=False), group_size=group_size, bits=bits)
              for _ in range(2)]
    packed = [kernels.packed_weight(layer) for layer in layers]
    assert all(w is not None and kernels.reads_packed(w, 8) for w in packed)
    dense = [mx.dequantize(w.packed, w.scales, w.biases, group_size=group_size, bits=bits) for w in packed]
    a = [mx.random.normal((inp, 8), key=k[i]) / 8 for i in range(2)]
    b = [mx.random.normal((8, 45), key=k[2 + i]) for i in range(2)]
    ms = [mx.random.uniform(0.5, 2.0, (45,), key=k[4 + i]) for i in range(2)]
    want = kernels.row_norms_and_scaled_cuda(dense, a, b, [2.0, 0.5], ms, factors=True)
    got = kernels.row_norms_and_scaled_cuda(packed, a, b, [2.0, 0.5], ms, factors=True)
    for kind, gots, wants in zip(("norm", "W'", "rs", "A", "B'"), got, want):
        for g, w in zip(gots, wants):
            assert g.shape == w.shape and mx.allclose(g, w, rtol=1e-6, atol=1e-6).item(), kind
    assert simulated["meshtune_dora_row_norm_packed_scaled_factors_2"].calls == 1


def test_packed_weights_only_where_the_launch_reads_them(simulated):
    """kernels.packed_weight: affine QuantizedLinear of 2, 4 or 8 bits only (3 bits straddle words, the fp modes
    have no biases); the launch refuses a packed weight it cannot lay out a word a lane, or unfolded."""
    import mlx.nn as nn

    from meshtune.adapters import kernels

    base = nn.Linear(256, 16, bias=False)
    assert kernels.packed_weight(base) is None
    assert kernels.packed_weight(nn.QuantizedLinear.from_linear(base, group_size=64, bits=3)) is None
    assert kernels.packed_weight(nn.QuantizedLinear.from_linear(base, group_size=32, bits=4, mode="mxfp4")) is None
    packed = kernels.packed_weight(nn.QuantizedLinear.from_linear(base, group_size=64, bits=4))
    assert packed.shape == (16, 256) and not kernels.reads_packed(packed, 64)  # a tile of A under a warp's columns
    a, b = [mx.zeros((256, 4))], [mx.zeros((4, 16))]
    with pytest.raises(ValueError, match="folded launch only"):
        kernels.row_norms_cuda([packed], a, b, [1.0])


def test_magnitude_and_b_gradient_from_a_launchs_stacked_norms(simulated):
    """magnitude_grad_cuda with a StackedNorm (the layer's norms inside a launch's array, read at its offset) and
    B's product: m's gradient as from a view of those norms, and d B = (s p) rs with rs = m / norm as MLX forms it."""
    from meshtune.adapters import kernels

    k = mx.random.split(mx.random.key(12), 5)
    g, y = mx.random.normal((100, 40), key=k[0]), mx.random.normal((100, 40), key=k[1])
    m = mx.random.uniform(1.0, 4.0, (40,), key=k[2]).at[3].multiply(0.0)
    launch = mx.random.uniform(0.5, 3.0, (120,), key=k[3])  # three layers' norms; this layer's are the second
    stacked = kernels.StackedNorm(launch, 40, 40)
    product = mx.random.normal((4, 40), key=k[4])
    dm, gb = kernels.magnitude_grad_cuda(g, y, m, stacked, b_product=product, b_scale=2.5)
    norm = launch[40:80]
    assert mx.array_equal(stacked.view(), norm).item()
    assert mx.array_equal(dm, kernels.magnitude_grad_cuda(g, y, m, norm)).item()
    assert mx.allclose(gb, 2.5 * product * (m / norm), rtol=1e-6, atol=0).item()
    assert simulated["meshtune_dora_magnitude_b_grad"].calls == 1


def test_magnitude_and_b_gradient_over_many_chunks_and_rows_of_b(simulated):
    """The sums' second kernel (a block's 8 warps each add every 8th chunk, then each column the 8 sums in
    order) over 31 chunks, 70 columns (a block of 32 part-filled) and B with 12 rows (more rows than warps):
    m's gradient as sum_t g y / (rs norm) and d B = (s p) rs, with a zero m giving 0."""
    from meshtune.adapters import kernels

    k = mx.random.split(mx.random.key(13), 5)
    rows, cols = 1000, 70
    g, y = mx.random.normal((rows, cols), key=k[0]), mx.random.normal((rows, cols), key=k[1])
    m = mx.random.uniform(1.0, 4.0, (cols,), key=k[2]).at[5].multiply(0.0)
    norm = mx.random.uniform(0.5, 3.0, (cols,), key=k[3])
    product = mx.random.normal((12, cols), key=k[4])
    assert kernels.cotangent_grid(rows, cols, g.dtype)[3] == 31
    dm, gb = kernels.magnitude_grad_cuda(g, y, m, norm, b_product=product, b_scale=1.5)
    rs = m / norm
    want = mx.where(rs == 0, 0.0, (g * y).sum(0) / mx.where(rs == 0, 1.0, rs * norm))
    assert mx.allclose(dm, want, rtol=1e-5, atol=1e-5).item() and dm[5].item() == 0.0
    assert mx.allclose(gb, 1.5 * product * rs, rtol=1e-6, atol=0).item()
    assert mx.array_equal(dm, kernels.magnitude_grad_cuda(g, y, m, norm)).item()


def test_no_kernel_reads_an_array_of_8_bytes_or_less(simulated, monkeypatch):
    """MLX's CUDA allocator keeps arrays of 8 bytes or less in a managed pool the GPU reads across the bus
    (cuda.kernel_constant): the folded launch's scales with one layer, m's gradient's offset into a launch's
    norms and B's scale are all handed to the kernels padded past it, the kernels' results unchanged."""
    from meshtune.adapters import kernels

    smallest = {}
    made = kernels._kernel

    def recording(name, inputs, outputs, source):
        inner = made(name, inputs, outputs, source)

        def call(*, inputs, **kw):
            smallest[name] = min(smallest.get(name, 1 << 30), *(a.nbytes for a in inputs))
            return inner(inputs=inputs, **kw)
        return call

    monkeypatch.setattr(kernels, "_kernel", recording)
    k = mx.random.split(mx.random.key(14), 6)
    w, a, b = mx.random.normal((24, 64), key=k[0]), mx.random.normal((64, 4), key=k[1]), mx.random.normal((4, 24), key=k[2])
    m = mx.random.uniform(1.0, 2.0, (24,), key=k[3])
    norms, _, _ = kernels.row_norms_and_scaled_cuda([w], [a], [b], [2.0], [m], stacked=True)
    g, y = mx.random.normal((40, 24), key=k[4]), mx.random.normal((40, 24), key=k[5])
    dm, gb = kernels.magnitude_grad_cuda(g, y, m, norms[0], b_product=b, b_scale=2.0)
    assert mx.allclose(gb, 2.0 * b * (m / norms[0].view()), rtol=1e-6, atol=0).item()
    assert set(smallest) >= {"meshtune_dora_column_sums", "meshtune_dora_magnitude_b_grad"}, smallest
    assert min(smallest.values()) > 8, smallest


def test_probe_keeps_the_earlier_magnitude_kernel_equal_to_the_current(simulated, monkeypatch):
    """scripts/probes/dora_variants.py keeps the second sums kernel as it was (a thread a column) for
    dora_kernel_cost.py to time beside the current one: the same gradients, to float32 rounding."""
    from pathlib import Path

    from meshtune.adapters import kernels

    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "scripts" / "probes"))
    import dora_variants

    k = mx.random.split(mx.random.key(14), 5)
    g, y = mx.random.normal((400, 70), key=k[0]), mx.random.normal((400, 70), key=k[1])
    m, norm = mx.random.uniform(1.0, 4.0, (70,), key=k[2]), mx.random.uniform(0.5, 3.0, (70,), key=k[3])
    product = mx.random.normal((12, 70), key=k[4])
    got = dora_variants.magnitude_b_grad_a_thread_a_column(g, y, m, norm, product, 1.5)
    want = kernels.magnitude_grad_cuda(g, y, m, norm, b_product=product, b_scale=1.5)
    assert mx.allclose(got[0], want[0], rtol=1e-5, atol=1e-6).item() and mx.array_equal(got[1], want[1]).item()


@pytest.mark.parametrize("rows, cols", [(100, 40), (7, 16), (300, 18)])  # 16-byte accesses; 18: one column a thread
def test_cotangent_kernel(simulated, rows, cols):
    from meshtune.adapters import kernels

    k = mx.random.split(mx.random.key(rows), 3)
    g = mx.random.normal((rows, cols), key=k[0])
    y = mx.random.normal((rows, cols), key=k[1])
    m = mx.random.uniform(1.0, 4.0, (cols,), key=k[2]).at[3].multiply(0.0)
    norm = mx.full((cols,), 2.0)
    rs = m / norm
    gz, dm = kernels.cotangent_cuda(g, y, m, norm)
    want_dm = mx.where(rs == 0, 0.0, (g * y).sum(0) / mx.where(rs == 0, 1.0, rs * norm))
    assert mx.allclose(gz, g * rs, rtol=1e-6).item()
    assert mx.allclose(dm, want_dm, rtol=1e-5, atol=1e-6).item() and dm[3].item() == 0.0
    assert simulated["meshtune_dora_cotangent"].calls == simulated["meshtune_dora_magnitude_grad"].calls == 1


def test_pack_kernel(simulated):
    from meshtune.parallel.pack_kernel import pack_cuda

    keys = mx.random.split(mx.random.key(0), 4)
    arrays = [mx.random.normal(s, key=k) for s, k in zip([(3, 5), (1,), (0,), (300,)], keys)]
    got = pack_cuda(arrays, mx.float32)
    assert mx.array_equal(got, mx.concatenate([a.reshape(-1) for a in arrays])).item()
    # The same count and output dtype from bfloat16 arrays: a kernel of its own (the stand-in checks).
    half = [a.astype(mx.bfloat16) for a in arrays]
    assert mx.array_equal(pack_cuda(half, mx.float32), mx.concatenate([a.reshape(-1) for a in half])).item()


def test_row_norm_kernel_per_weight_dtype(simulated):
    from meshtune.adapters import kernels

    k = mx.random.split(mx.random.key(1), 3)
    w = mx.random.normal((9, 40), key=k[0]) / 8
    a, b = mx.random.normal((40, 4), key=k[1]) / 8, mx.random.normal((4, 9), key=k[2]) / 8
    for weight in (w, w.astype(mx.bfloat16)):
        kernels.row_norms_cuda([weight], [a], [b], [2.0])
    assert simulated["meshtune_dora_row_norm_1"].calls == 2


def test_dora_layer_gradients_on_the_cuda_path(simulated):
    """adapted_linear with both DoRA kernels simulated: value and every gradient as autodiff of the dense reference."""
    from meshtune.adapters.adapted_linear import adapted_linear

    k = mx.random.split(mx.random.key(7), 6)
    x = mx.random.normal((2, 6, 24), key=k[0])
    w = mx.random.normal((20, 24), key=k[1]) / 4
    a = mx.random.normal((24, 4), key=k[2]) / 4
    b = mx.random.normal((4, 20), key=k[3]) / 4
    m = mx.random.uniform(0.5, 2.0, (20,), key=k[4])
    probe = mx.random.normal((2, 6, 20), key=k[5])

    def ours(x, a, b, m):
        return (adapted_linear(x, w, a, b, 2.0, magnitude=m, w_sq=(w * w).sum(-1)) * probe).sum()

    def reference(x, a, b, m):
        dense = w + 2.0 * (a @ b).T
        z = x @ w.T + 2.0 * ((x @ a) @ b)
        return (m / mx.stop_gradient(mx.sqrt((dense * dense).sum(-1))) * z * probe).sum()

    got_v, got = mx.value_and_grad(ours, argnums=(0, 1, 2, 3))(x, a, b, m)
    want_v, want = mx.value_and_grad(reference, argnums=(0, 1, 2, 3))(x, a, b, m)
    assert abs(got_v.item() - want_v.item()) <= 1e-4 * abs(want_v.item())
    for name, g, h in zip("x a b m".split(), got, want):
        assert mx.allclose(g, h, rtol=1e-4, atol=1e-5).item(), name
    assert simulated["meshtune_dora_row_norm_1"].calls == 1 and simulated["meshtune_dora_cotangent"].calls == 1


def _dora_step_graph_products(layer, x) -> Counter:
    """The matrix products (Matmul, AddMM) of a DoRA layer's training forward and its input's gradient as one
    step takes them (step_row_norms), counted in their graph."""
    import re
    import tempfile

    from meshtune.adapters.step_norms import step_row_norms

    with step_row_norms(layer, x.size // x.shape[-1]):
        (y,), (dx,) = mx.vjp(layer, [x], [mx.ones(x.shape[:-1] + (layer.m.size,))])
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "g.dot")
        mx.export_to_dot(path, y, dx)
        names = re.findall(r'label\s*=\s*"([A-Za-z]+)', open(path).read())
    return Counter(n for n in names if n in ("Matmul", "AddMM"))


@pytest.mark.parametrize("quantized", [False, True])
def test_merged_fold_layer_matches_the_dense_reference(simulated, monkeypatch, quantized):
    """kernels.MERGED_FOLD in a training step: a DoRA layer without dropout runs one product on the launch's
    merged W' = rs (W + s (A B)^T); its output and its gradients (x, A, B, m) are autodiff's of the dense
    reference m / ||W + s (A B)^T||_row (W + s (A B)^T) x, and its graph has fewer products than the unmerged
    fold's (LoRA's branch on W' = rs W)."""
    import mlx.nn as nn

    from meshtune.adapters import DoRALinear, base_path, kernels
    from meshtune.adapters.base_path import dequantized_weight
    from meshtune.adapters.step_norms import lookup_merged, step_row_norms

    monkeypatch.setattr(base_path, "_mode", "dequantized")
    monkeypatch.setattr(kernels, "FOLD_ROW_SCALE", True)
    k = mx.random.split(mx.random.key(11), 4)
    base = nn.Linear(64, 24, bias=False)
    if quantized:
        base = nn.QuantizedLinear.from_linear(base, group_size=32, bits=4)
    layer = DoRALinear.from_base(base, r=4, scale=2.0)
    layer.lora_b = mx.random.normal(layer.lora_b.shape, key=k[0]) / 4
    layer.m = layer.m * mx.random.uniform(0.5, 1.5, layer.m.shape, key=k[1])
    layer.train()
    x = mx.random.normal((2, 5, 64), key=k[2])
    probe = mx.random.normal((2, 5, 24), key=k[3])
    w = dequantized_weight(base).astype(mx.float32)

    def ours(x, a, b, m):
        layer.lora_a, layer.lora_b, layer.m = a, b, m
        with step_row_norms(layer, 10):
            assert lookup_merged(layer, 10)
            return (layer(x) * probe).sum()

    def reference(x, a, b, m):
        dense = w + 2.0 * (a @ b).T
        norm = mx.stop_gradient(mx.sqrt((dense * dense).sum(-1)))
        return ((m / norm) * (x @ dense.T) * probe).sum()

    args = (x, layer.lora_a, layer.lora_b, layer.m)
    got_v, got = mx.value_and_grad(ours, argnums=(0, 1, 2, 3))(*args)
    want_v, want = mx.value_and_grad(reference, argnums=(0, 1, 2, 3))(*args)
    assert abs(got_v.item() - want_v.item()) <= 1e-4 * abs(want_v.item())
    for name, g, h in zip("x a b m".split(), got, want):
        assert mx.allclose(g, h, rtol=1e-4, atol=1e-5).item(), name
    assert _calls(simulated, _step_norm_kernel(True, 1, quantized=quantized, merged=True)) >= 1
    layer.lora_a, layer.lora_b, layer.m = args[1:]
    merged = _dora_step_graph_products(layer, x)
    monkeypatch.setattr(kernels, "MERGED_FOLD", False)
    unmerged = _dora_step_graph_products(layer, x)
    assert sum(merged.values()) <= sum(unmerged.values()) - 3, (merged, unmerged)


def test_a_dora_layer_with_dropout_is_not_merged(simulated, monkeypatch):
    """Dropout gives LoRA's branch another input than the base's, so that layer's W' stays rs W (the launch of
    its own shape unmerged) and it trains as with kernels.MERGED_FOLD off, to the bit."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from meshtune.adapters import DoRALinear, kernels
    from meshtune.adapters.step_norms import lookup_merged, step_row_norms

    monkeypatch.setattr(kernels, "FOLD_ROW_SCALE", True)
    layer = DoRALinear.from_base(nn.Linear(64, 24, bias=False), r=4, dropout=0.25, scale=2.0)
    layer.lora_b = mx.random.normal(layer.lora_b.shape, key=mx.random.key(1)) / 4
    layer.train()
    x = mx.random.normal((2, 5, 64), key=mx.random.key(2))
    loss_and_grad = nn.value_and_grad(layer, lambda x: layer(x).sum())

    def step():
        mx.random.seed(5)  # the same dropout mask both times
        with step_row_norms(layer, 10):
            assert not lookup_merged(layer, 10)
            value, grads = loss_and_grad(x)
            mx.eval(value, grads)
        return value, grads

    got_v, got = step()
    assert _calls(simulated, _step_norm_kernel(True, 1, merged=False)) == 1
    assert _step_norm_kernel(True, 1, merged=True) not in simulated
    monkeypatch.setattr(kernels, "MERGED_FOLD", False)
    want_v, want = step()
    assert got_v.item() == want_v.item()
    for (name, g), (_, h) in zip(tree_flatten(got), tree_flatten(want)):
        assert mx.array_equal(g, h).item(), name


def test_gradient_buckets_packed_by_the_kernel(simulated):
    """sum_gradients on a one-process group that claims two ranks: the kernel packs, the tree comes back whole."""
    from mlx.utils import tree_flatten

    from meshtune.parallel.mesh import Mesh
    from meshtune.parallel.data_parallel import sum_gradients

    grads = {"layers": [{"a": mx.arange(6.0).reshape(2, 3), "b": mx.ones((4,))}, {"a": mx.full((2, 3), 5.0)}]}
    mesh = Mesh(group=mx.distributed.init(), world_size=2, rank=0, dp=2, pp=1)
    summed = sum_gradients(grads, mesh)
    for (k, v), (k2, v2) in zip(tree_flatten(summed), tree_flatten(grads)):
        assert k == k2 and mx.array_equal(v, v2).item(), k
    assert [k.calls for name, k in simulated.items() if name.startswith("meshtune_pack_3_")] == [1]


def _step_norm_kernel(fold: bool, layers: int, quantized: bool = False, merged: bool | None = None) -> str:
    """The name of the norm kernel a training step launches for `layers` layers of one shape: folded, with the
    layers' A and B' where kernels.writes_factors() (the default), reading a quantized base packed, writing the
    merged W' where `merged` (default: folded layers without dropout, kernels.MERGED_FOLD)."""
    from meshtune.adapters import kernels

    merged = fold and kernels.MERGED_FOLD if merged is None else merged
    return kernels.row_norm_kernel_name(layers, scaled=fold, factors=fold and kernels.writes_factors(),
                                        packed=fold and quantized, merged=merged)


def _calls(simulated, kernel: str) -> int:
    """How often the simulated `kernel` ran (0 if never)."""
    return simulated[kernel].calls if kernel in simulated else 0


def _dora_layers(quantize: bool):
    """DoRA layers of three shapes (two share one), one on a 4-bit base, with nonzero B."""
    import mlx.nn as nn

    from meshtune.adapters import DoRALinear

    mx.random.seed(3)
    bases = [nn.Linear(64, out, bias=False) for out in (16, 16, 24, 32)]
    if quantize:
        bases[3] = nn.QuantizedLinear.from_linear(bases[3], group_size=32, bits=4)
    layers = [DoRALinear.from_base(base, r=4, scale=s) for base, s in zip(bases, (2.0, 0.5, 2.0, 1.0))]
    for layer in layers:
        layer.lora_b = mx.random.normal(layer.lora_b.shape) / 4
    mx.eval([layer.parameters() for layer in layers])
    return layers


def _fan(layers):
    """A module that sums its layers' outputs on one input, each weighted by its place."""
    import mlx.nn as nn

    class Fan(nn.Module):
        def __init__(self, layers):
            super().__init__()
            self.layers = layers

        def __call__(self, x):
            return sum((layer(x) * (i + 1)).sum() for i, layer in enumerate(self.layers))

    return Fan(layers)


@pytest.mark.parametrize("fold", [True, False])
def test_step_row_norms_take_every_layer_at_once(simulated, monkeypatch, fold):
    """Under step_row_norms a training step launches one norm kernel per shape of layer, not
    one per layer, and gets the loss and gradients it gets layer by layer; folded (the
    default, W' = rs W written by the same launch) or not (MESHTUNE_DORA_FOLD=0)."""
    import mlx.nn as nn

    from meshtune.adapters import base_path, kernels
    from meshtune.adapters.step_norms import lookup, step_row_norms

    monkeypatch.setattr(kernels, "FOLD_ROW_SCALE", fold)

    base_path.set_base_path("dequantized")  # the 4-bit base takes the dense path, as at training sizes
    try:
        model = _fan(_dora_layers(quantize=True))
        model.train()
        x = mx.random.normal((2, 5, 64), key=mx.random.key(4))
        loss_and_grad = nn.value_and_grad(model, lambda x: model(x))
        want_v, want = loss_and_grad(x)
        mx.eval(want_v, want)
        assert simulated["meshtune_dora_row_norm_1"].calls == 4  # a launch a layer
        with step_row_norms(model, 10):
            assert lookup(model.layers[0], 10) is not None and lookup(model.layers[0], 11) is None
            got_v, got = loss_and_grad(x)
            mx.eval(got_v, got)
        assert lookup(model.layers[0], 10) is None  # nothing left behind
        assert simulated[_step_norm_kernel(fold, layers=2)].calls == 1  # the two 16-row layers together
        # The 24-row layer and the 4-bit 32-row one: folded, the 4-bit weight is read packed by a launch of its
        # own (no dequantized copy); unfolded it is dequantized, then the same kernel as a dense base's.
        assert simulated[_step_norm_kernel(fold, layers=1)].calls == (1 if fold else 4 + 2)
        if fold:
            assert simulated[_step_norm_kernel(fold, layers=1, quantized=True)].calls == 1
            assert simulated["meshtune_dora_row_norm_1"].calls == 4  # none unfolded in the step
            # m's and B's gradients from the sums a layer, each reading its norms in its launch's array.
            assert simulated[FOLDED_GRAD].calls == 4
    finally:
        base_path.set_base_path("auto")
    # Folded, W' = rs W is rounded once per element (the sum of the fan's outputs cancels: ~1e-5 of it).
    assert mx.allclose(got_v, want_v, rtol=1e-4 if fold else 1e-6).item()
    from mlx.utils import tree_flatten
    for (name, g), (_, h) in zip(tree_flatten(got), tree_flatten(want)):
        assert mx.allclose(g, h, rtol=1e-5, atol=1e-6).item(), name


@pytest.mark.parametrize("memory, setting, dense_folded", [(None, "auto", True), (1 << 40, "auto", True),
                                                          (1000, "auto", False), (1000, True, True)])
def test_auto_fold_leaves_dense_bases_unfolded_where_copies_would_not_fit(simulated, monkeypatch, capsys,
                                                                           memory, setting, dense_folded):
    """kernels.FOLD_ROW_SCALE "auto" (the default): a dense base's W' is a second copy held through the
    step, so those are folded only while the copies take at most FOLD_MEMORY_SHARE of the GPU's memory
    (folded where the GPU does not report it); a quantized base is folded either way (W' replaces its
    dequantized copy). Declining says so once on stderr, naming the setting that forces it."""
    import mlx.nn as nn

    from meshtune.adapters import base_path, kernels, step_norms
    from meshtune.adapters.step_norms import lookup_scaled, step_row_norms

    monkeypatch.setattr(kernels, "FOLD_ROW_SCALE", setting)
    monkeypatch.setattr(step_norms, "_gpu_memory", lambda: memory)
    monkeypatch.setattr(step_norms, "_declined", [])
    base_path.set_base_path("dequantized")
    try:
        model = _fan(_dora_layers(quantize=True))
        model.train()
        x = mx.random.normal((2, 5, 64), key=mx.random.key(4))
        loss_and_grad = nn.value_and_grad(model, lambda x: model(x))
        for _ in range(2):
            with step_row_norms(model, 10):
                assert (lookup_scaled(model.layers[0], 10) is not None) == dense_folded  # a dense base
                assert lookup_scaled(model.layers[3], 10) is not None  # the 4-bit base
                mx.eval(loss_and_grad(x))
    finally:
        base_path.set_base_path("auto")
    err = capsys.readouterr().err
    if dense_folded:
        assert "folded step is off" not in err
    else:
        assert err.count("folded step is off for dense bases") == 1 and "MESHTUNE_DORA_FOLD=1" in err


@pytest.mark.parametrize("fold", [True, False])
def test_training_step_takes_dora_norms_before_the_forward(simulated, model_factory, monkeypatch, fold):
    """meshtune's step (train.build_step) on a model with DoRA: one norm launch per shape; folded
    (the default) m's gradient by the sums-only kernel, else by the cotangent kernel."""
    import mlx.optimizers as optim

    from meshtune.adapters import apply_adapters, kernels
    from meshtune.parallel.mesh import Mesh
    from meshtune.training.loop import build_step

    monkeypatch.setattr(kernels, "FOLD_ROW_SCALE", fold)

    model = model_factory(layers=2, dim=32)
    apply_adapters(model, fine_tune_type="dora", num_layers=2, keys=["self_attn.q_proj", "self_attn.v_proj"],
                   rank=4, scale=2.0, dropout=0.0)
    model.train()
    step = build_step(model, optim.SGD(learning_rate=0.1), Mesh.single(), max_grad_norm=0.0, compile=False)
    tokens = mx.random.randint(0, 64, (2, 9), key=mx.random.key(1))
    lengths = mx.array([[0, 9], [0, 9]])
    ce, n, _, _ = step(tokens, lengths, None, None, True)
    mx.eval(ce, n, model.parameters())
    # q (32 rows) in both blocks in one launch, v (16 rows: 2 kv heads) in both in another.
    assert {k: v.calls for k, v in simulated.items() if "row_norm" in k} == {_step_norm_kernel(fold, layers=2): 2}
    assert simulated[FOLDED_SUMS if fold else "meshtune_dora_cotangent"].calls == 4
    assert ("meshtune_dora_cotangent" if fold else FOLDED_SUMS) not in simulated


def _two_dora_sgd_steps(model_factory, *, quantized: bool, built=None):
    """Two steps of meshtune's step (train.build_step, uncompiled, SGD: the update is the gradient,
    which Adam's per-element normalisation would blow up at ~0) on a 2-block model, 4-bit where
    `quantized`, with DoRA on q_proj and down_proj and non-zero B (the row scale moves off 1):
    (the two losses, the trainable parameters after). `built(model)` runs before the steps."""
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten

    from meshtune.adapters import apply_adapters
    from meshtune.parallel.mesh import Mesh
    from meshtune.training.loop import build_step

    model = model_factory(layers=2, dim=64)
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
    apply_adapters(model, fine_tune_type="dora", num_layers=2, keys=["self_attn.q_proj", "mlp.down_proj"],
                   rank=4, scale=2.0, dropout=0.0)
    for _, layer in model.named_modules():
        if hasattr(layer, "lora_b"):
            layer.lora_b = mx.random.normal(layer.lora_b.shape, key=mx.random.key(2)) * 0.05
    model.train()
    if built is not None:
        built(model)
    step = build_step(model, optim.SGD(learning_rate=0.1), Mesh.single(), max_grad_norm=0.0, compile=False)
    tokens = mx.random.randint(0, 64, (2, 9), key=mx.random.key(1))
    lengths = mx.array([[0, 9], [0, 9]])
    losses = []
    for _ in range(2):
        ce, n, _, _ = step(tokens, lengths, None, None, True)
        mx.eval(ce, n, model.parameters())
        losses.append((ce / n).item())
    return losses, dict(tree_flatten(model.trainable_parameters()))


@pytest.mark.parametrize("quantized, b_in_sums", [(False, True), (True, True), (False, False)])
def test_folded_training_step_trains_as_the_current_one(simulated, model_factory, monkeypatch, quantized, b_in_sums):
    """kernels.FOLD_ROW_SCALE: the step writes W' = rs W beside the norms and every DoRA layer runs
    LoRA's product on W' and B' = B rs, m's gradient by the sums-only kernel; the loss and the
    parameters after two steps are the current step's, on a dense and on a quantized base (SGD:
    the update is the gradient, which Adam's per-element normalisation would blow up at ~0). B's product
    summed with m's sums (kernels.B_PRODUCT_IN_SUMS, the default) or by a matmul."""
    from meshtune.adapters import base_path, kernels

    monkeypatch.setattr(kernels, "B_PRODUCT_IN_SUMS", b_in_sums)
    monkeypatch.setattr(base_path, "_mode", "dequantized")  # a quantized base takes the dense path at 16 tokens too
    dequantized = []  # the bases dequantize_weight was asked for, by id
    original_dequantized = base_path.dequantized_weight
    monkeypatch.setattr(base_path, "dequantized_weight", lambda layer: dequantized.append(id(layer))
                        or original_dequantized(layer))
    dora_bases = set()

    def built(model):
        dora_bases.clear()
        dora_bases.update(id(layer.linear) for _, layer in model.named_modules() if hasattr(layer, "lora_b"))
        dequantized.clear()  # from here on, the steps'

    def trained(fold):
        monkeypatch.setattr(kernels, "FOLD_ROW_SCALE", fold)
        return _two_dora_sgd_steps(model_factory, quantized=quantized, built=built)

    base_losses, base = trained(False)
    assert _step_norm_kernel(fold=True, layers=2, quantized=quantized) not in simulated
    losses, folded = trained(True)
    assert _calls(simulated, _step_norm_kernel(fold=True, layers=2, quantized=quantized)) >= 1
    assert simulated[FOLDED_SUMS if b_in_sums else "meshtune_dora_column_sums"].calls == 8
    # A 4-bit DoRA base is read packed by the step's launch, which writes W': it is never dequantized (unfolded,
    # each step dequantizes it once, in step_norms, for the norm kernel and the layer's products).
    assert Counter(i for i in dequantized if i in dora_bases) == {}
    assert losses == pytest.approx(base_losses, rel=1e-5)
    for key, value in base.items():
        assert mx.allclose(folded[key], value, rtol=1e-5, atol=1e-6).item(), key


@pytest.mark.parametrize("quantized", [False, True])
def test_factors_from_the_norm_kernel_train_as_the_layers_casts(simulated, model_factory, monkeypatch, quantized):
    """kernels._WRITE_FACTORS: the folded step's norm launches write every DoRA layer's A and B' = B rs, and
    the layers use them in place of their own casts; two steps give the same losses and parameters, to the bit."""
    from meshtune.adapters import adapted_linear as AL, base_path, dora, kernels

    monkeypatch.setattr(base_path, "_mode", "dequantized")
    monkeypatch.setattr(kernels, "FOLD_ROW_SCALE", True)
    monkeypatch.setattr(kernels, "MERGED_FOLD", False)  # the factors against the casts; merged: its own test
    monkeypatch.setattr(kernels, "_WRITE_FACTORS", False)
    want_losses, want = _two_dora_sgd_steps(model_factory, quantized=quantized)
    with_factors = kernels.row_norm_kernel_name(2, scaled=True, factors=True, packed=quantized)
    assert with_factors not in simulated
    monkeypatch.setattr(kernels, "_WRITE_FACTORS", True)
    seen = []
    original = AL.adapted_linear

    def recording(*args, factors=None, **kw):
        seen.append(factors is not None)
        return original(*args, factors=factors, **kw)

    monkeypatch.setattr(dora, "adapted_linear", recording)
    losses, got = _two_dora_sgd_steps(model_factory, quantized=quantized)
    assert simulated[with_factors].calls >= 1
    assert seen and all(seen)  # every DoRA layer call was handed its factors
    assert losses == want_losses
    for key, value in want.items():
        assert mx.array_equal(got[key], value).item(), key


def test_step_row_norms_leave_dequantizing_to_recomputed_blocks(simulated, monkeypatch):
    """Where blocks are recomputed in the backward (gradient checkpointing), a 4-bit layer is
    handed its norm but dequantizes its own weight (one handed over would live for the whole
    step); a dense layer is handed its own weight either way; the loss and gradients do not change.
    Nor is the row scale folded into a weight there (W' = rs W would live for the whole step too)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from meshtune.adapters import base_path, kernels
    from meshtune.adapters.step_norms import lookup, lookup_scaled, step_row_norms

    base_path.set_base_path("dequantized")
    try:
        model = _fan(_dora_layers(quantize=True))
        model.train()
        for recomputed in (False, True):
            monkeypatch.setattr(type(model).__call__, "recomputes_in_backward", recomputed, raising=False)
            monkeypatch.setattr(kernels, "FOLD_ROW_SCALE", True)
            with step_row_norms(model, 10):
                assert (lookup_scaled(model.layers[0], 10) is None) == recomputed
        monkeypatch.setattr(kernels, "FOLD_ROW_SCALE", False)  # the same product both ways, to the bit
        x = mx.random.normal((2, 5, 64), key=mx.random.key(4))
        loss_and_grad = nn.value_and_grad(model, lambda x: model(x))
        results = {}
        for recomputed in (False, True):
            monkeypatch.setattr(type(model).__call__, "recomputes_in_backward", recomputed, raising=False)
            with step_row_norms(model, 10):
                dense_q, _ = lookup(model.layers[3], 10)  # the 4-bit layer
                dense_d, _ = lookup(model.layers[0], 10)
                assert (dense_q is None) == recomputed
                assert dense_d is model.layers[0].linear.weight
                results[recomputed] = loss_and_grad(x)
                mx.eval(results[recomputed])
    finally:
        base_path.set_base_path("auto")
    (v0, g0), (v1, g1) = results[False], results[True]
    assert mx.allclose(v0, v1, rtol=1e-6).item()
    for (name, a), (_, b) in zip(tree_flatten(g0), tree_flatten(g1)):
        assert mx.allclose(a, b, rtol=1e-5, atol=1e-6).item(), name


@pytest.mark.parametrize("rows, cols, r, dtype", [(100, 40, 4, mx.bfloat16), (1000, 70, 12, mx.float32),
                                                  (37, 24, 8, mx.bfloat16), (300, 18, 3, mx.float16)])
def test_b_product_summed_with_the_magnitude_sums(simulated, rows, cols, r, dtype):
    """magnitude_and_b_grad_cuda (B_PRODUCT_IN_SUMS): the column sums' pass also sums (x A)^T g by chunks, the
    second kernel adds the chunks in order: m's gradient as magnitude_grad_cuda's (the same column sums), and
    B's as magnitude_grad_cuda's from the matmul's product, to float32 rounding of the product's sum. 1000 rows:
    several chunks; 70 and 18 columns: blocks part-filled, one column a thread; rank 12: more rows of B than warps."""
    from meshtune.adapters import kernels

    k = mx.random.split(mx.random.key(21), 5)
    g, y = mx.random.normal((rows, cols), key=k[0]).astype(dtype), mx.random.normal((rows, cols), key=k[1]).astype(dtype)
    u = mx.random.normal((rows, r), key=k[2]).astype(dtype)
    m = mx.random.uniform(1.0, 4.0, (cols,), key=k[3]).at[5].multiply(0.0)
    norm = mx.random.uniform(0.5, 3.0, (cols,), key=k[4])
    dm, gb = kernels.magnitude_and_b_grad_cuda(g, y, u, m, norm, 1.5, rs_dtype=dtype)
    product = (u.astype(mx.float32).T @ g.astype(mx.float32))
    want_dm, want_gb = kernels.magnitude_grad_cuda(g, y, m, norm, b_product=product, b_scale=1.5, rs_dtype=dtype)
    assert dm.shape == (cols,) and gb.shape == (r, cols) and dm.dtype == gb.dtype == mx.float32
    assert mx.allclose(dm, want_dm, rtol=1e-5, atol=1e-5).item() and dm[5].item() == 0.0
    assert mx.allclose(gb, want_gb, rtol=1e-4, atol=1e-4).item()
    assert simulated["meshtune_dora_column_and_b_sums"].calls == 1
    assert simulated["meshtune_dora_magnitude_b_sums_grad"].calls == 1


@pytest.mark.parametrize("rows, cols, r", [(1000, 70, 12), (300, 48, 8)])
def test_probe_one_launch_b_sums_match_the_two_launches(simulated, monkeypatch, rows, cols, r):
    """scripts/probes/dora_variants.py's one-launch form of magnitude_and_b_grad_cuda (the last block of each strip
    adds its chunks, a ticket a block): the two launches' m and B gradients to float32 rounding, norms read at a
    launch's offset. (The simulator hands a kernel copies of its inputs, so the counters' reset shows on a GPU only.)"""
    from meshtune.adapters import kernels

    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "scripts" / "probes"))
    import dora_variants

    k = mx.random.split(mx.random.key(22), 5)
    g, y = mx.random.normal((rows, cols), key=k[0]), mx.random.normal((rows, cols), key=k[1])
    u = mx.random.normal((rows, r), key=k[2])
    m = mx.random.uniform(1.0, 4.0, (cols,), key=k[3]).at[5].multiply(0.0)
    stacked = kernels.StackedNorm(mx.random.uniform(0.5, 3.0, (3 * cols,), key=k[4]), cols, cols)
    want = kernels.magnitude_and_b_grad_cuda(g, y, u, m, stacked, 1.5)
    got = dora_variants.one_launch_magnitude_and_b_sums(g, y, u, m, stacked, 1.5)
    assert mx.allclose(got[0], want[0], rtol=1e-5, atol=1e-5).item() and got[0][5].item() == 0.0
    assert mx.allclose(got[1], want[1], rtol=1e-5, atol=1e-5).item()
    assert simulated["probe_dora_magnitude_b_sums_one_launch"].calls == 1
