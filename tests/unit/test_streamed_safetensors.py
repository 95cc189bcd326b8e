"""A safetensors file written a tensor at a time reads back as mx.save_safetensors's does."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from meshtune.training.streamed_safetensors import StreamedSafetensors


def test_a_streamed_file_loads_as_the_arrays_written(tmp_path: Path) -> None:
    arrays = {"model.layers.1.w": mx.random.normal((3, 5)).astype(mx.bfloat16), "a": mx.arange(7, dtype=mx.int32),
              "m": mx.random.normal((2, 3, 4)), "h": mx.array([1.5, -2.0], dtype=mx.float16), "s": mx.array(3.0)}
    path = tmp_path / "adapters.safetensors"
    with StreamedSafetensors(path, [(k, v.shape, v.dtype) for k, v in arrays.items()]) as stream:
        for k, v in arrays.items():
            stream.write(k, v)
    back = mx.load(str(path))
    assert back.keys() == arrays.keys()
    for k, v in arrays.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and mx.array_equal(back[k], v).item(), k
    assert [p.name for p in tmp_path.iterdir()] == ["adapters.safetensors"]  # no temp file left


def test_an_unfinished_stream_leaves_the_earlier_file(tmp_path: Path) -> None:
    path = tmp_path / "adapters.safetensors"
    mx.save_safetensors(str(path), {"old": mx.ones((2,))})
    stream = StreamedSafetensors(path, [("a", (2,), mx.float32), ("b", (2,), mx.float32)])
    stream.write("a", mx.zeros((2,)))
    with pytest.raises(OSError, match="1 tensors were never written"):
        stream.close()
    assert list(mx.load(str(path))) == ["old"] and [p.name for p in tmp_path.iterdir()] == ["adapters.safetensors"]
