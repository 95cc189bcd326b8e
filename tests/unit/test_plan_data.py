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
