"""bench/fit.py: the size a bench picks for a device, from fake devices; needs follow the presets' shapes."""

from __future__ import annotations

import pytest

from meshtune.bench.fit import GB, Load, Machine, ORDER, choose_preset, describe_fixed, preset_need, preset_shape
from meshtune.bench.models import PRESETS

ADAPTERS_CPU = Load(dense=5, quantized=4, dtype_bytes=4)  # what bench adapters holds on a CPU (float32)
ADAPTERS_GPU = Load(dense=5, quantized=4, dtype_bytes=2)  # and on a GPU (bfloat16)
CI = Machine("CPU", "AMD EPYC", int(24 * GB))
H200 = Machine("GPU", "NVIDIA H200", int(140 * GB))


def test_a_24gb_cpu_gets_small_and_is_told_what_1b_needs():
    preset, line = choose_preset(None, ADAPTERS_CPU, CI)
    assert preset == "small"
    need_1b = preset_need("1b", ADAPTERS_CPU) / GB
    assert line.startswith("preset: small (CPU AMD EPYC, 24.0 GB RAM")
    assert f"1b needs ~{need_1b:.1f} GB and a GPU: pass --preset 1b to force" in line


def test_an_h200_gets_1b():
    preset, line = choose_preset(None, ADAPTERS_GPU, H200)
    assert preset == "1b"
    assert line.startswith("preset: 1b (GPU NVIDIA H200, 140.0 GB memory, 1b needs ~")


def test_a_cpu_never_gets_1b_however_much_ram_it_has():
    assert choose_preset(None, ADAPTERS_CPU, Machine("CPU", "", int(4096 * GB)))[0] == "small"


def test_a_small_gpu_gets_the_largest_preset_it_fits():
    need_1b, need_small = preset_need("1b", ADAPTERS_GPU), preset_need("small", ADAPTERS_GPU)
    between = Machine("GPU", "small GPU", int((need_small + need_1b) / 2 / 0.8))
    assert choose_preset(None, ADAPTERS_GPU, between)[0] == "small"


def test_too_little_memory_for_anything_runs_the_smallest_and_says_so():
    preset, line = choose_preset(None, ADAPTERS_CPU, Machine("CPU", "", 1000))
    assert preset == "tiny" and "small needs" in line


def test_an_explicit_preset_wins_and_warns_when_it_will_not_fit(capsys):
    preset, line = choose_preset("1b", ADAPTERS_CPU, CI)
    assert preset == "1b" and "--preset" in line
    assert "warning: --preset 1b needs" in capsys.readouterr().err
    assert choose_preset("tiny", ADAPTERS_CPU, CI)[0] == "tiny"
    assert capsys.readouterr().err == ""


def test_needs_grow_with_the_shapes_the_batch_and_the_ranks():
    needs = [preset_need(name, ADAPTERS_CPU) for name in ORDER]
    assert needs == sorted(needs) and len(set(needs)) == 3
    one = Load()
    # Weights alone: parameters x bytes (activations of one token are small next to a 1B model's weights).
    params = preset_shape("1b").params()
    assert params * 4 < preset_need("1b", one, batch=1, seq=1) < params * 4 * 1.01
    assert preset_need("1b", one, batch=8) > preset_need("1b", one, batch=4)
    assert preset_need("1b", Load(full=True)) > preset_need("1b", one)
    assert preset_need("small", Load(processes=3)) == pytest.approx(3 * preset_need("small", one), rel=1e-6)
    assert preset_need("small", Load(dtype_bytes=2)) < preset_need("small", one)
    # The batch and sequence length that override a preset's are the ones costed.
    assert preset_need("1b", one) == preset_need("1b", one, PRESETS["1b"]["batch_size"], PRESETS["1b"]["seq_len"])


def test_batch_flags_can_bring_1b_within_a_gpu_that_its_own_batch_overflows():
    need_small_batch = preset_need("1b", ADAPTERS_GPU, batch=1, seq=128)
    gpu = Machine("GPU", "", int(need_small_batch / 0.8) + 1)
    assert choose_preset(None, ADAPTERS_GPU, gpu)[0] != "1b"
    assert choose_preset(None, ADAPTERS_GPU, gpu, batch=1, seq=128)[0] == "1b"


def test_a_fixed_model_line_names_the_machine_and_the_need():
    line = describe_fixed("the embedded tiny model", preset_shape("tiny"), 2, 32, Load(processes=2), CI)
    assert line.startswith("model: the embedded tiny model (CPU AMD EPYC, 24.0 GB RAM available, needs ~")
    assert "for 2 ranks" in line and "may run out" not in line
    assert "may run out of memory" in describe_fixed("x", preset_shape("1b"), 4, 1024, Load(), CI)
