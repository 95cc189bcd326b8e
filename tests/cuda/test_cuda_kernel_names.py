"""meshtune.runtime.cuda.kernel: the name MLX compiles a kernel under changes with its text.

MLX's CUDA build keeps compiled kernels on disk by name (and template values) only, so a kernel
whose source or header (its .cuh file) changed between meshtune versions would otherwise run the old binary.
"""

import mlx.core as mx
import pytest

from meshtune.runtime import cuda


@pytest.fixture(autouse=True)
def _no_kernel_built_before_or_after():
    """The memo starts empty, and the stand-ins recorded here serve no later test."""
    cuda._built.cache_clear()
    yield
    cuda._built.cache_clear()


def _recording(monkeypatch):
    made = []

    def cuda_kernel(*, name, input_names, output_names, source, header=""):
        made.append(name)
        return (name, tuple(input_names), tuple(output_names), source, header)

    monkeypatch.setattr(mx.fast, "cuda_kernel", cuda_kernel)
    return made


def test_a_kernel_is_built_once_for_its_text(monkeypatch):
    made = _recording(monkeypatch)
    first = cuda.kernel("meshtune_k", ["a"], ["o"], "o[0] = a[0];")
    again = cuda.kernel("meshtune_k", ["a"], ["o"], "o[0] = a[0];")
    assert first is again and len(made) == 1
    assert made[0].startswith("meshtune_k_") and len(made[0]) == len("meshtune_k_") + 12


def test_a_changed_text_header_or_signature_gets_a_name_of_its_own(monkeypatch):
    made = _recording(monkeypatch)
    base = cuda.kernel("meshtune_k", ["a"], ["o"], "o[0] = a[0];")
    texts = [cuda.kernel("meshtune_k", ["a"], ["o"], "o[0] = 2 * a[0];"),
             cuda.kernel("meshtune_k", ["b"], ["o"], "o[0] = a[0];"),
             cuda.kernel("meshtune_k", ["a"], ["o", "p"], "o[0] = a[0];"),
             cuda.kernel("meshtune_k", ["a"], ["o"], "o[0] = a[0];", "__device__ int f() { return 1; }")]
    assert all(t is not base for t in texts)
    assert len(set(made)) == 5 and all(n.startswith("meshtune_k_") for n in made)
