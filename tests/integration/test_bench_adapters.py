"""`meshtune bench adapters --preset tiny --json`: all eight step configurations and the
generation rows are printed, and the JSON's ratios are those of its own timings."""

from __future__ import annotations

import json
import math
import re
import statistics

import pytest

STEP_KEYS = [f"{impl}_{kind}_{base}" for impl in ("stock", "meshtune") for kind in ("lora", "dora")
             for base in ("bf16", "4bit")]
RATIO_KEYS = ["qlora_over_lora_step", "dora_over_lora_step_bf16", "dora_over_lora_step_4bit",
              "dora_over_lora_generate_4bit", "dora_over_lora_generate_bf16"]
KIND_LABEL = {"lora": "LoRA", "dora": "DoRA"}
NUMBER = r"(\d+(?:\.\d+)?)"


@pytest.fixture(scope="module")
def bench():
    from support import run_bench_json

    return run_bench_json("adapters", "--preset", "tiny", timeout=120)


def _section(table: list[str], title: str) -> list[str]:
    """The lines from the one starting with `title` to the next blank line."""
    start = next(i for i, line in enumerate(table) if line.startswith(title))
    end = next((i for i in range(start, len(table)) if not table[i].strip()), len(table))
    return table[start:end]


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_json_has_every_ratio_for_meshtune_and_stock(bench):
    _, out = bench
    for key in RATIO_KEYS + ["stock_" + k for k in RATIO_KEYS]:
        assert _positive(out[key]), key
    for group in ("step_ms", "step_tok_s", "generate_tok_s"):
        assert sorted(out[group]) == sorted(STEP_KEYS), group
        assert all(_positive(v) for v in out[group].values()), group


def test_ratios_are_those_of_the_reported_times(bench):
    _, out = bench
    ms, gen = out["step_ms"], out["generate_tok_s"]
    for impl, prefix in (("meshtune", ""), ("stock", "stock_")):
        expect = {
            "qlora_over_lora_step": ms[f"{impl}_lora_4bit"] / ms[f"{impl}_lora_bf16"],
            "dora_over_lora_step_bf16": ms[f"{impl}_dora_bf16"] / ms[f"{impl}_lora_bf16"],
            "dora_over_lora_step_4bit": ms[f"{impl}_dora_4bit"] / ms[f"{impl}_lora_4bit"],
            "dora_over_lora_generate_4bit": gen[f"{impl}_dora_4bit"] / gen[f"{impl}_lora_4bit"],
            "dora_over_lora_generate_bf16": gen[f"{impl}_dora_bf16"] / gen[f"{impl}_lora_bf16"],
        }
        for key, value in expect.items():
            assert out[prefix + key] == pytest.approx(value, rel=1e-9), prefix + key
    tokens = out["batch_size"] * out["seq_len"]
    for key in STEP_KEYS:
        assert out["step_tok_s"][key] == pytest.approx(tokens / (ms[key] / 1e3), rel=1e-9)
    # On a CPU the dense base is float32 (bf16 matmul bypasses BLAS there); the JSON says so.
    assert out["dense_dtype"] == "float32" and out["device"].startswith("cpu")


def test_step_ratios_are_also_given_round_by_round(bench):
    """Each step ratio once a round (from that round's medians), in the JSON and as a range in the table."""
    table, out = bench
    by_round = out["step_ratios_by_round"]
    step_ratios = RATIO_KEYS[:3]
    assert sorted(by_round) == sorted(step_ratios + ["stock_" + k for k in step_ratios])
    for key, values in by_round.items():
        assert len(values) == out["rounds"] and all(_positive(v) for v in values), key
    ratios = _section(table, "ratios")
    line = next(l for l in ratios if "DoRA / LoRA, 4-bit" in l and l.strip().startswith("step"))
    low, high = (float(x) for x in re.search(rf"{NUMBER}-{NUMBER}x", line).groups())
    values = by_round["dora_over_lora_step_4bit"]
    assert (low, high) == (pytest.approx(min(values), abs=0.0051), pytest.approx(max(values), abs=0.0051))


def test_round_ratios_divide_each_rounds_medians():
    from meshtune.bench import adapters as B

    rounds = {f"{impl}_{kind}_{base}": [[1.0, 2.0, 9.0], [4.0, 4.0, 4.0]] for impl in B.IMPLS for kind in B.KINDS
              for base in B.BASES}
    rounds["meshtune_dora_bf16"] = [[3.0, 3.0, 0.1], [2.0, 2.0, 2.0]]  # medians 3 and 2 over 2 and 4
    got = B.round_ratios(rounds)
    assert got["dora_over_lora_step_bf16"] == [1.5, 0.5]
    assert got["stock_dora_over_lora_step_bf16"] == [1.0, 1.0]
    assert B.median_steps(rounds)["meshtune_dora_bf16"] == 2.0  # over all six steps


def test_table_shows_all_eight_step_configurations_and_generation_rows(bench):
    table, out = bench
    dense = out["dense_dtype"]
    steps = _section(table, "training step:")
    assert "stock mlx-lm" in steps[1] and "meshtune" in steps[1]
    gen = _section(table, "generation:")
    assert "stock mlx-lm" in gen[1] and "meshtune" in gen[1]
    for kind in ("lora", "dora"):
        for base, label in (("bf16", dense), ("4bit", "4-bit")):
            row = f"{KIND_LABEL[kind]} {label}"
            # Step row: stock ms (tok/s), meshtune ms (tok/s), as in the JSON to the printed digit.
            line = next(l for l in steps if l.strip().startswith(row + " "))
            found = re.findall(rf"{NUMBER} \(\s*{NUMBER}\)", line)
            assert len(found) == 2, line
            for (printed_ms, _), impl in zip(found, ("stock", "meshtune")):
                assert float(printed_ms) == pytest.approx(out["step_ms"][f"{impl}_{kind}_{base}"], abs=0.051)
            line = next(l for l in gen if l.strip().startswith(row + " "))
            values = [float(x) for x in re.findall(NUMBER, line[len(row) + 2:])]
            assert values[:2] == [pytest.approx(out["generate_tok_s"][f"{i}_{kind}_{base}"], abs=0.051)
                                  for i in ("stock", "meshtune")], line
    ratios = _section(table, "ratios")
    assert any("4-bit LoRA" in l for l in ratios) and sum("DoRA / LoRA" in l for l in ratios) == 4
    assert any(l.startswith("BLAS:") for l in table)


def test_generation_is_timed_in_interleaved_rounds(monkeypatch):
    """Each round decodes once with each of the base's four models, all loaded at once, and
    the median of the rounds is reported: drift in the host's speed falls on all four."""
    from meshtune.bench import adapters as B

    calls: list[str] = []
    rates = iter(range(1, 1000))

    def fake_model(impl, kind, base, a, shape, dtype, paths):
        name = f"{impl}_{kind}_{base}"
        calls.append("load " + name)

        def decode():
            calls.append(name)
            return float(next(rates))
        return decode

    monkeypatch.setattr(B, "generation_model", fake_model)
    a = B._settings(["--preset", "tiny", "--rounds", "4"])
    got = B.time_generate("4bit", a, B.shape_of(a), None, None)
    names = [f"{i}_{k}_4bit" for k in B.KINDS for i in B.IMPLS]
    assert calls == ["load " + n for n in names] + names * 4
    # Decode calls return 1, 2, 3, ... in call order: model j's rounds return j+1, j+5, j+9, j+13.
    assert got == {n: statistics.median([j + 1, j + 5, j + 9, j + 13]) for j, n in enumerate(names)}


def _saved(path, table, out, **ratios):
    """One invocation's saved output (its table, then its JSON line) with some ratios replaced."""
    path.write_text("\n".join(table) + "\n" + json.dumps({**out, **ratios}) + "\n")
    return str(path)


def test_combine_judges_the_median_of_each_ratio_over_invocations(bench, tmp_path):
    """--combine reads each saved invocation's last JSON line, prints every ratio per invocation beside the
    median, and judges the targets on the medians (stock's medians beside them)."""
    from support import run_cli

    from meshtune.bench.adapters_targets import CPU_QLORA_NOTE

    table, out = bench
    values = {"dora_over_lora_step_bf16": (1.31, 1.02, 1.08), "dora_over_lora_step_4bit": (1.04, 1.17, 1.21),
              "stock_dora_over_lora_step_bf16": (1.5, 1.4, 1.6)}
    files = [_saved(tmp_path / f"run{i}.txt", table, out, **{k: v[i] for k, v in values.items()}) for i in range(3)]
    proc = run_cli("bench", "adapters", "--combine", *files, "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    got = json.loads(lines[-1])
    assert got["invocations"] == 3 and [r["file"] for r in got["runs"]] == files
    assert got["dora_over_lora_step_bf16"] == pytest.approx(1.08) and got["targets_met"]["dora_over_lora_step_bf16"]
    assert got["dora_over_lora_step_4bit"] == pytest.approx(1.17) and not got["targets_met"]["dora_over_lora_step_4bit"]
    assert got["stock_dora_over_lora_step_bf16"] == pytest.approx(1.5)
    assert got["qlora_over_lora_step"] == pytest.approx(out["qlora_over_lora_step"])
    row = next(line for line in lines if line.strip().startswith("step, DoRA / LoRA, 4-bit"))
    assert re.findall(NUMBER + "x", row)[:4] == ["1.04", "1.17", "1.21", "1.17"] and row.endswith("missed")
    # The 4-bit / dense LoRA target is the GPU's: a CPU measurement's row says so, as one invocation's table does.
    qlora_row = next(line for line in lines if line.strip().startswith("step, 4-bit LoRA"))
    assert out["device"].startswith("cpu") and qlora_row.endswith(CPU_QLORA_NOTE), qlora_row
    gpu_files = [_saved(tmp_path / f"gpu{i}.txt", table, {**out, "device": "cuda (NVIDIA H200)"}) for i in range(2)]
    proc = run_cli("bench", "adapters", "--combine", *gpu_files, timeout=120)
    assert proc.returncode == 0 and CPU_QLORA_NOTE not in proc.stdout, proc.stderr[-2000:]


def test_combine_refuses_what_is_not_one_measurement(bench, tmp_path):
    """Each bad set of files is refused with one message naming the file (and line) and the fix; on the command
    line that is exit 2 and one stderr line."""
    from support import run_cli

    from meshtune.bench import adapters_runs

    table, out = bench
    good = _saved(tmp_path / "good.txt", table, out)
    other = _saved(tmp_path / "other.txt", table, {**out, "seq_len": out["seq_len"] * 2})
    no_json = tmp_path / "table_only.txt"
    no_json.write_text("\n".join(table) + "\n")
    broken = tmp_path / "broken.txt"
    broken.write_text("training step\n{\"dora_over_lora_step_bf16\": 1.0,\n")
    foreign = tmp_path / "foreign.txt"
    foreign.write_text('{"tokens_per_s": 3}\n')
    cases = [([good, str(tmp_path / "missing.txt")], "missing.txt: cannot read it"),
             ([good, str(no_json)], "table_only.txt: no JSON line"),
             ([good, str(broken)], "broken.txt:2: its JSON line does not parse"),
             ([good, str(foreign)], "foreign.txt:1: no 'qlora_over_lora_step'"),
             ([good, other], "other.txt: seq_len is"),
             ([good], "two or more")]
    for files, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            adapters_runs.main(files, as_json=False)
    proc = run_cli("bench", "adapters", "--combine", good, other, timeout=120)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and "other.txt: seq_len is" in err[0], proc.stderr
    assert "combine invocations of the same settings" in err[0] and not proc.stdout.strip()
