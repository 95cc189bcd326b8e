"""`meshtune plan --data`: the row length it plans for is the widest batch the data makes, as train tokenizes it."""

from __future__ import annotations

import json

from meshtune.config import Config
from meshtune.data.batches import padded_width
from meshtune.plan import plan
from meshtune.plan.data_lengths import data_row_length
from support import ARITH_DATA, TINY_MODEL


def test_plan_with_data_takes_the_longest_example_padded(tmp_path):
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(TINY_MODEL)
    rows = [json.loads(line) for line in (ARITH_DATA / "train.jsonl").read_text().splitlines()]
    longest = max(len(tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]},
                                                     {"role": "assistant", "content": r["completion"]}],
                                                    return_dict=False)) for r in rows)
    cfg = Config.from_dict({"data": {"path": str(ARITH_DATA), "max_seq_length": 2048}})
    width, why = data_row_length(cfg)
    assert width == padded_width(longest, pad_to=cfg.data.pad_to, max_seq_length=2048) < 2048
    assert why == f"--data: the longest of 2000 examples, {longest} tokens, padded"
    planned = plan(cfg, 1, 16.0, "10gbit", seq_len=width, seq_len_from=why)
    worst = plan(cfg, 1, 16.0, "10gbit")
    assert (planned["seq_len"], planned["seq_len_from"]) == (width, why)
    assert worst["seq_len"] == 2048 and planned["layouts"][0]["total"] < worst["layouts"][0]["total"]


def test_plan_with_packed_data_takes_the_rows_train_takes(cli):
    from mlx_lm.utils import load_tokenizer

    from meshtune.data import load_datasets
    from meshtune.plan.row_length import packed_row_length

    cfg = Config.from_dict({"data": {"path": str(ARITH_DATA), "pack": True}})
    train = load_datasets(str(ARITH_DATA), load_tokenizer(TINY_MODEL), need_valid=False).train
    rows = packed_row_length(cfg, train.lengths)  # what meshtune train says and packs (api.finetune)
    assert rows.picked and data_row_length(cfg) == (rows.tokens, f"--data, packed rows: {rows.why}")
    for flags, tokens in (([], rows.tokens), (["--max-seq-length", "512"], 512),
                          (["--data.pack_length", "160"], 160)):
        proc = cli("plan", "--data", str(ARITH_DATA), "--data.pack", "true", *flags, "--json")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads(proc.stdout)["seq_len"] == tokens, flags
    proc = cli("plan", "--data.pack", "true", "--data.pack_length", "160", "--json")  # no --data: the given rows
    assert (json.loads(proc.stdout)["seq_len"], json.loads(proc.stdout)["seq_len_from"]) == (160, "data.pack_length")
