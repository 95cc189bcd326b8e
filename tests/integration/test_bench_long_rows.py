"""`meshtune bench long-rows`: `meshtune train` on rows of each length, every kind asked, beside its step
alone (--step), table and JSON alike."""

from __future__ import annotations

import pytest

from support import run_bench_json


@pytest.fixture(scope="module")
def bench():
    return run_bench_json("long-rows", "--preset", "tiny", "--no-torch", "--step", "--kinds", "lora", "dora", "qlora",
                          "--seq-lens", "64", "256", timeout=600)


def test_each_length_has_a_row_per_kind_from_meshtune_train(bench):
    out, result = bench
    assert [(r["seq_len"], r["kind"]) for r in result["rows"]] == [
        (n, k) for n in (64, 256) for k in ("lora", "dora", "qlora")]
    for r in result["rows"]:
        mine = r["meshtune"]
        assert r["torch"] is None and mine["tok_s"] > 0 and mine["peak_gb"] > 0 and mine["steps"] == 2, r
        assert any(f"{mine['tok_s']:.0f}" in line for line in out), r  # the table prints what the JSON holds
    assert result["batch_size"] == 1 and result["grad_checkpoint"] is True and result["preset"] == "tiny"


def test_step_puts_the_step_alone_beside_the_command(bench):
    """--step: the compiled step on the same model and row length, and the command's tokens/s over its."""
    out, result = bench
    assert result["step"] is True and any("train/step" in line for line in out)
    for r in result["rows"]:
        step = r["step"]
        assert step["tok_s"] > 0 and step["peak_gb"] > 0 and step["steps"] == 2, r
        ratio = f"{r['meshtune']['tok_s'] / step['tok_s']:.2f}x"
        assert any(f"{step['tok_s']:.0f}" in line and ratio in line for line in out), (ratio, r)


def test_a_longer_row_holds_more_memory(bench):
    _, result = bench
    peak = {(r["seq_len"], r["kind"]): r["meshtune"]["peak_gb"] for r in result["rows"]}
    assert all(peak[(256, k)] > peak[(64, k)] for k in ("lora", "dora", "qlora")), peak


def test_a_checkpointed_runs_peak_grows_at_most_linearly_with_the_row():
    """`meshtune train --grad-checkpoint` at 4,096 and 8,192 tokens: twice the row, about twice the peak
    (2.29x measured; whole attention scores would be 4x). Each block keeps its input, one block is
    recomputed at a time, and attention and the head's loss take their rows a chunk at a time, so nothing
    of rows x rows or rows x vocabulary is formed whole. A chunk's arrays are heads x 512 x L: on this
    model attention alone grows 2.6x, 2.2x, 2.0x from 2,048 to 16,384 tokens (a fixed part fades)."""
    _, result = run_bench_json("long-rows", "--preset", "tiny", "--no-torch", "--seq-lens", "4096", "8192",
                               "--warmup", "0", "--steps", "1", timeout=900)
    peak = {r["seq_len"]: r["meshtune"]["peak_gb"] for r in result["rows"]}
    assert peak[8192] <= 2.4 * peak[4096], peak
