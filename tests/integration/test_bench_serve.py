"""`meshtune bench serve` on the tiny preset: both servers answer on the same adapters and the table and JSON
hold a decode rate for each, in one invocation."""

from __future__ import annotations

from support import run_bench_json


def test_bench_serve_times_meshtune_and_mlx_lm_server_on_the_same_adapters():
    lines, result = run_bench_json("serve", "--preset", "tiny", "--bases", "4bit", "--tokens", "8",
                                   "--requests", "1")
    assert lines[0].startswith("serve bench: qwen3-shaped random model: 2 layers x 64 hidden")
    assert [(r["base"], r["kind"]) for r in result["rows"]] == [("4bit", "lora"), ("4bit", "dora")]
    for row in result["rows"]:
        assert row["meshtune_tps"] > 0 and row["mlx_lm_tps"] > 0
        assert row["vs_stock"] == row["meshtune_tps"] / row["mlx_lm_tps"]
    assert "| 4bit | dora |" in "\n".join(lines)
    assert set(result["dora_over_lora"]["4bit"]) == {"meshtune", "mlx_lm"}
    assert any(line.startswith("4bit: DoRA / LoRA decode, meshtune serve ") for line in lines)
