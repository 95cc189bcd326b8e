"""Every case of the bad-input corpus fails cleanly: exit 2, one error line naming the file or
option, no traceback, the earlier run in the output folder untouched."""

from __future__ import annotations

import json

import pytest

from support import run_cli
from meshtune.bench import bad_input as bi


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("badinput")
    return root, bi.make_template(root)


@pytest.mark.parametrize("case", bi.CASES, ids=lambda c: c.name)
def test_case_fails_cleanly(corpus, case):
    root, template = corpus
    result = bi.run_case(case, root, template)
    assert result.clean, f"{case.name}: " + "; ".join(result.problems)


def test_corpus_is_broad_and_partly_real_processes():
    names = {c.name for c in bi.CASES}
    assert len(names) == len(bi.CASES) >= 25
    assert sum(c.subprocess for c in bi.CASES) >= 3
    for required in ("malformed_json", "mixed_formats", "missing_field", "empty_file", "non_utf8",
                     "empty_completion", "too_long_strict", "yaml_unknown_key", "cli_mistyped_option",
                     "yaml_wrong_type", "batch_not_divisible_by_ranks", "more_stages_than_layers",
                     "model_without_weights", "model_without_tokenizer", "dora_on_norm", "resume_mismatch",
                     "adapters_of_another_model", "no_data_dir", "negative_lr", "zero_steps", "yaml_syntax"):
        assert required in names


@pytest.mark.parametrize("code,stderr,after,why", [
    (1, "meshtune: error: x.jsonl:2: bad\n", None, "exit code 1"),
    (2, "Traceback (most recent call last):\nmeshtune: error: x.jsonl:2: bad\n", None, "traceback"),
    (2, "meshtune: error: something else\n", None, "lacks"),
    (2, "meshtune: error: first\nmeshtune: error: x.jsonl:2: bad\n", None, "mention an error"),
    (2, "note: loading\nmeshtune: error: x.jsonl:2: bad\nmore\n", None, "does not start"),
    (2, "meshtune: error: x.jsonl:2: bad\n", {"a": (2, "h")}, "output folder changed: a"),
])
def test_judge_flags_each_broken_rule(code, stderr, after, why):
    before = {"a": (1, "h")}
    problems = bi.judge(code, stderr, "x.jsonl:2", before, after or before)
    assert any(why in p for p in problems), problems
    assert bi.judge(2, "note: loading\nmeshtune: error: x.jsonl:2: bad\n", "x.jsonl:2", before, before) == []


def test_bench_command_prints_table_and_summary():
    proc = run_cli("bench", "badinput", "--case", "non_utf8", "--case", "zero_lr")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("model: the embedded tiny model") and lines[1].startswith("rule: exit 2")
    assert "case" in lines[2] and "| exit | clean | seconds" in lines[2]
    assert any(l.startswith("non_utf8 ") and "|    2 |   yes |" in l for l in lines)
    assert lines[-1] == "cases tried 2, clean errors 2"


def test_bench_json_is_one_object_last_on_stdout():
    """--json: the table, then one JSON object; mlx_lm.convert's progress (the quantized case) stays off stdout."""
    proc = run_cli("bench", "badinput", "--case", "full_on_quantized", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["cases_tried"] == result["clean_errors"] == 1 and result["ok"]
    assert [c["name"] for c in result["cases"]] == ["full_on_quantized"]
    assert "[INFO]" not in proc.stdout
