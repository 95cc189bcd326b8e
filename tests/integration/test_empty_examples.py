"""Examples with nothing to learn, in real runs on the embedded model: one process and 2 ranks on
the ring backend (`meshtune launch -n 2`) stop before training, every rank with exit code 2 and the
one error line naming file:line and the cause, and nothing is written under --adapter-path;
`--data.skip_empty true` trains, exits 0 and warns once with the count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import ARITH_DATA, ROOT

STEPS = ["--iters", "2", "--batch-size", "4", "--steps-per-eval", "100", "--train.val_batches", "1",
         "--save-every", "1"]
WORDY = "What is " + " + ".join(["1"] * 40) + "?"  # 169 prompt tokens: past --max-seq-length 64
# Runs one rank's command and writes its exit code, so the test reads each rank's code (the launcher
# passes on one); then waits until every rank has written one.
RECORD = ("import glob, os, subprocess, sys, time; d, n = sys.argv[1], int(sys.argv[2]); "
          "code = subprocess.call(sys.argv[3:]); "
          "open(os.path.join(d, 'exit.' + os.environ['MLX_RANK']), 'w').write(str(code)); "
          "end = time.time() + 120\n"
          "while len(glob.glob(os.path.join(d, 'exit.*'))) < n and time.time() < end: time.sleep(0.1)\n"
          "sys.exit(code)")


def _data(folder: Path, bad: dict[int, dict], *, chat: bool = False) -> Path:
    """16 train and 4 valid arithmetic rows (as chats with `chat`), train line k replaced by bad[k]."""
    for split, n in (("train", 16), ("valid", 4)):
        rows = [json.loads(line) for line in (ARITH_DATA / f"{split}.jsonl").read_text().splitlines()[:n]]
        if chat:
            rows = [{"messages": [{"role": "user", "content": r["prompt"]},
                                  {"role": "assistant", "content": r["completion"]}]} for r in rows]
        if split == "train":
            for line, row in bad.items():
                rows[line - 1] = row
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _train(n: int, data: Path, out: Path, *args: str) -> tuple[subprocess.CompletedProcess, list[int]]:
    """`meshtune train` on n ranks (through `meshtune launch` when n > 1); the process and each rank's code."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "meshtune.cli"]
    train = [*cmd, "train", *STEPS, "--data", str(data), "--adapter-path", str(out), *args]
    codes = out.parent / "codes"
    codes.mkdir()
    full = [*cmd, "launch", "-n", str(n), "--", sys.executable, "-c", RECORD, str(codes), str(n), *train] \
        if n > 1 else train
    proc = subprocess.run(full, env=env, capture_output=True, text=True, timeout=300)
    ranks = [int((codes / f"exit.{r}").read_text()) for r in range(n)] if n > 1 else [proc.returncode]
    return proc, ranks


CASES = {
    "unknown_role": ({3: {"messages": [{"role": "wizard", "content": "hi"}]}}, True, [],
                     "train.jsonl:3: message 0 of 'messages' has role 'wizard', which this tokenizer's chat "
                     "template drops or rejects; use one of system, user, assistant, tool"),
    "unknown_role_with_skip_empty": ({3: {"messages": [{"role": "wizard", "content": "hi"}]}}, True,
                                     ["--data.skip_empty", "true"], "train.jsonl:3: message 0 of 'messages' has "
                                     "role 'wizard'"),
    "empty_completion": ({5: {"prompt": "What is 1 + 1?", "completion": ""}}, False, [],
                         "train.jsonl:5: 'completion' is empty, so the example has nothing to learn; fill it in "
                         "or remove the line, or set --data.skip_empty true to skip such rows"),
    "cut_off": ({7: {"prompt": WORDY, "completion": "40"}}, False,
                ["--mask-prompt", "--max-seq-length", "64"],
                "train.jsonl:7: its completion starts at token 169 of 172 but --max-seq-length 64 "
                "(data.max_seq_length) cuts it off there, so the example has nothing to learn; raise it with "
                "--max-seq-length 172 (at least 170), shorten the prompt, or set --data.skip_empty true to "
                "skip such rows"),
}


@pytest.mark.parametrize("case,n", [("unknown_role", 1), ("unknown_role", 2), ("unknown_role_with_skip_empty", 1),
                                    ("empty_completion", 2), ("cut_off", 1), ("cut_off", 2)])
def test_nothing_to_learn_stops_every_rank_before_training(tmp_path, case, n):
    bad, chat, args, expect = CASES[case]
    data = _data(tmp_path / "data", bad, chat=chat)
    proc, codes = _train(n, data, tmp_path / "run", *args)
    said = proc.stdout + proc.stderr
    assert codes == [2] * n and proc.returncode == 2, said[-3000:]
    assert "Traceback" not in said
    line = f"meshtune: error: {data}/{expect}"
    if n == 1:
        errors = [l for l in proc.stderr.splitlines() if "error" in l.lower()]
        assert errors == [line] or (len(errors) == 1 and errors[0].startswith(line)), errors
    else:
        for rank in range(n):
            errors = [l for l in proc.stdout.splitlines() if l.startswith(f"[rank {rank}] ") and "error" in l.lower()]
            assert len(errors) == 1 and errors[0].startswith(f"[rank {rank}] {line}"), said[-3000:]
        # Every rank said its own line; the launcher, seeing them all exit 2, adds none.
        assert "meshtune launch:" not in proc.stderr, proc.stderr[-2000:]
    out = tmp_path / "run"
    assert not (out / "adapters.safetensors").exists() and not (out / "checkpoints").exists()
    assert not out.exists() or not any(p.suffix in (".safetensors", ".jsonl") for p in out.rglob("*"))


def test_skip_empty_trains_and_warns_once_with_the_count(tmp_path):
    bad = {2: {"prompt": "What is 1 + 1?", "completion": " "}, 7: {"prompt": WORDY, "completion": "40"},
           11: {"prompt": "What is 2 + 2?", "completion": ""}}
    data = _data(tmp_path / "data", bad)
    proc, codes = _train(2, data, tmp_path / "run", "--mask-prompt", "--max-seq-length", "64",
                         "--data.skip_empty", "true")
    said = proc.stdout + proc.stderr
    assert codes == [0, 0] and proc.returncode == 0, said[-3000:]
    warned = [l for l in said.splitlines() if "skipped 3 of 16 examples with nothing to learn" in l]
    assert len(warned) == 1, said[-3000:]  # once, by the writer rank
    assert f"train: skipped 3 of 16 examples with nothing to learn (data.skip_empty): {data}/train.jsonl:2 " \
           "('completion' is empty)" in warned[0]
    assert f"{data}/train.jsonl:7 (its completion starts at token 169" in warned[0]
    assert (tmp_path / "run" / "adapters.safetensors").is_file()
    assert "finished at step 2" in said and "loss nan" not in said.lower() and "loss=nan" not in said.lower()


def test_the_launcher_lets_every_rank_say_its_bad_input_line(tmp_path):
    """Without a wrapper holding the ranks: the first rank to exit 2 does not cut the other short."""
    data = _data(tmp_path / "data", CASES["unknown_role"][0], chat=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "meshtune.cli", "launch", "-n", "2", "--", sys.executable, "-m",
                           "meshtune.cli", "train", *STEPS, "--data", str(data), "--adapter-path", str(tmp_path / "run")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    for rank in range(2):
        assert any(l.startswith(f"[rank {rank}] meshtune: error: {data}/train.jsonl:3: message 0")
                   for l in proc.stdout.splitlines()), proc.stdout[-2000:]
    assert "meshtune launch:" not in proc.stderr, proc.stderr[-2000:]
