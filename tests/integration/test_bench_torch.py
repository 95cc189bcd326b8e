"""`meshtune bench torch`: the table and the JSON say the same, both frameworks count the same
parameters, and without PyTorch the suite says what to install in one line (exit 2)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from support import ROOT, run_cli

KINDS = {"lora": "LoRA", "dora": "DoRA", "qlora": "4-bit LoRA", "full": "full"}
NUMBER = r"([\d,]+(?:\.\d+)?%?|n/a)"


@pytest.fixture(scope="module")
def bench():
    for name in ("torch", "transformers", "peft"):
        pytest.importorskip(name)
    proc = run_cli("bench", "torch", "--preset", "tiny", "--json", timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    return lines[:-1], json.loads(lines[-1])


def _rows(table: list[str]) -> dict[str, list[str]]:
    """Kind -> the cells of its row (numbers as printed)."""
    rows = {}
    for kind, label in KINDS.items():
        line = next(line for line in table if line.startswith(f"  {label} ") and re.match(r"\s+\d", line[14:]))
        rows[kind] = re.findall(NUMBER, line[len(label) + 2:])
    return rows


def _num(cell: str) -> float:
    return float(cell.replace(",", "").rstrip("%").rstrip("x"))


def test_both_frameworks_count_the_same_parameters(bench):
    table, out = bench
    assert out["params"]["meshtune"] == out["params"]["torch"] > 0
    for kind in ("lora", "dora", "full"):
        assert out["runs"][kind]["meshtune"]["trainable"] == out["runs"][kind]["torch"]["trainable"], kind
    assert out["runs"]["full"]["meshtune"]["trainable"] == out["params"]["meshtune"]  # every parameter trains
    # LoRA: rank x (in + out) per adapted linear; DoRA adds a magnitude per output (the tiny shape's 7 linears).
    s, r = out["shape"], out["rank"]
    kv = s["kv_heads"] * s["hidden"] // s["heads"]
    ins_outs = [(s["hidden"], s["hidden"]), (s["hidden"], kv), (s["hidden"], kv), (s["hidden"], s["hidden"]),
                (s["hidden"], s["intermediate"]), (s["hidden"], s["intermediate"]), (s["intermediate"], s["hidden"])]
    lora = s["layers"] * sum(r * (i + o) for i, o in ins_outs)
    assert out["runs"]["lora"]["torch"]["trainable"] == lora == out["runs"]["qlora"]["meshtune"]["trainable"]
    assert out["runs"]["dora"]["torch"]["trainable"] == lora + s["layers"] * sum(o for _, o in ins_outs)
    assert out["lora_alpha"] == out["scale"] * out["rank"]
    assert f"N = {out['params']['meshtune']:,} parameters in both" in table[1]


def test_the_figures_follow_from_the_step_times(bench):
    _, out = bench
    tokens = out["batch_size"] * out["seq_len"]
    assert out["tokens_per_step"] == tokens
    for kind, sides in out["runs"].items():
        for side, run in sides.items():
            step_s = run["step_ms"] / 1e3
            assert run["tok_s"] == pytest.approx(tokens / step_s)
            flops = out["flops_per_param_token"][kind] * out["params"]["meshtune"] * tokens
            assert run["tflops"] == pytest.approx(flops / step_s / 1e12)
            assert run["peak_fraction"] == pytest.approx(run["tflops"] / out["matmul_tflops"][side])
    assert out["flops_per_param_token"] == {"lora": 4, "dora": 4, "qlora": 4, "full": 6}
    assert set(out["runs"]["qlora"]) == {"meshtune"}  # 4-bit LoRA has no torch peer
    assert out["ratios"] == {f"{k}_tok_s": pytest.approx(out["runs"][k]["meshtune"]["tok_s"] /
                                                         out["runs"][k]["torch"]["tok_s"])
                             for k in ("lora", "dora", "full")}


def test_the_table_prints_the_json_figures(bench):
    table, out = bench
    rows = _rows(table)
    for kind, cells in rows.items():
        runs = out["runs"][kind]
        sides = ["meshtune", "torch"] if "torch" in runs else ["meshtune"]
        assert _num(cells[0]) == runs["meshtune"]["trainable"], kind
        for i, side in enumerate(sides):
            tok_s, peak, tflops, frac = cells[1 + 4 * i: 5 + 4 * i]
            run = runs[side]
            assert _num(tok_s) == pytest.approx(run["tok_s"], abs=0.5), (kind, side)
            assert _num(tflops) == pytest.approx(run["tflops"], rel=0.01), (kind, side)
            assert _num(frac) == pytest.approx(100 * run["peak_fraction"], abs=0.05), (kind, side)
            assert peak == "n/a" if run["peak_gb"] is None else _num(peak) == pytest.approx(run["peak_gb"], rel=0.01)
        if len(sides) == 2:  # the last cell: meshtune/torch tokens/s
            assert _num(cells[9]) == pytest.approx(out["ratios"][f"{kind}_tok_s"], abs=0.005), kind
    text = "\n".join(table)
    for words in ("eager (no torch.compile)", "SDPA attention", "AdamW", "4 x N x tokens", "6 x N x tokens",
                  "lora_alpha 160", "(meshtune only)"):
        assert words in text, words


def test_without_torch_it_says_what_to_install_in_one_line(tmp_path):
    """A `torch` package that fails to import stands in for a machine without PyTorch."""
    shim = tmp_path / "torch"
    shim.mkdir()
    (shim / "__init__.py").write_text("raise ImportError('No module named torch (test shim)')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-m", "meshtune.cli", "bench", "torch", "--preset", "tiny"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "torch (No module named torch" in proc.stderr and "pip install torch transformers peft" in proc.stderr
