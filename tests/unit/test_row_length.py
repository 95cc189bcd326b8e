"""The packed row length a run takes (meshtune/plan/row_length.py): given, or picked for the data and model.

A picked length holds the longest example, is a multiple of data.pad_to, never draws the long-rows
warning, grows with a model whose attention is cheaper against its weights, and is the cheapest of its
candidates by the cost it states; a given one wins, and one shorter than an example is refused.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from meshtune.config import Config, ConfigError
from meshtune.data import BatchIterator, TokenizedDataset
from meshtune.plan.model_facts import ModelFacts, read_model
from meshtune.plan.row_length import (LONG_ROW_FACTOR, STEP_OVERHEAD, break_even, packed_row_length,
                                      pick_row_length, row_cost, weights_per_token)
from support import TINY_MODEL


def _facts(hidden: int, layers: int = 4, heads: int = 4) -> ModelFacts:
    return ModelFacts(Path("model"), {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
                                      "num_key_value_heads": heads // 2, "intermediate_size": 3 * hidden,
                                      "vocab_size": 1000}, [])


def _lengths(n: int = 2000, lo: int = 40, hi: int = 70, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(lo, hi, size=n).astype(np.int32)


def test_the_embedded_model_breaks_even_at_137_tokens():
    facts = read_model(TINY_MODEL)
    # 4 blocks x (q, o 128x128; k, v 128x64; MLP 3 x 128x384) + the 103 x 128 head, over
    # 4 blocks x 4 heads x (2 x 32 + 300).
    assert weights_per_token(facts) == 4 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 384) + 103 * 128
    assert break_even(facts) == pytest.approx(799616 / 5824)


@pytest.mark.parametrize("hidden", [64, 128, 512, 2048])
def test_picked_rows_hold_the_longest_example_and_draw_no_warning(hidden):
    lengths = _lengths()
    rows = pick_row_length(lengths, max_seq_length=2048, pad_to=32, batch_size=4, facts=_facts(hidden))
    longest = int(lengths.max())
    assert rows.picked and rows.tokens % 32 == 0 and longest <= rows.tokens <= LONG_ROW_FACTOR * longest
    said: list[str] = []
    ds = TokenizedDataset.from_examples("train", [(np.ones(n, dtype=np.int32), 0) for n in lengths])
    BatchIterator(ds, batch_size=1, max_seq_length=rows.tokens, pack=True, warn=said.append)  # none left out
    assert said == []
    assert rows.line().startswith(f"data.pack: rows of {rows.tokens} tokens (the cheapest per target token for "
                                  f"examples of up to {longest} tokens, on a model whose attention costs as much "
                                  f"as its weights at {break_even(_facts(hidden)):.0f}-token rows;")


def test_the_pick_is_the_cheapest_candidate_and_grows_as_attention_gets_cheaper():
    lengths = _lengths()
    picks = []
    for hidden in (64, 128, 512, 2048):
        facts = _facts(hidden)
        rows = pick_row_length(lengths, max_seq_length=2048, pad_to=32, batch_size=4, facts=facts)
        cost = {c: row_cost(lengths, c, pad_to=32, batch_size=4, tokens_at_par=break_even(facts),
                            step_tokens=STEP_OVERHEAD / weights_per_token(facts))
                for c in range(96, 16 * 69 + 1, 32)}  # 69: the longest
        assert cost[rows.tokens] == min(cost.values())
        picks.append(rows.tokens)
    assert picks == sorted(picks) and picks[0] < picks[-1]


def test_rows_never_pass_max_seq_length_and_examples_past_it_are_cut_first():
    lengths = _lengths(lo=100, hi=300)
    rows = pick_row_length(lengths, max_seq_length=128, pad_to=32, batch_size=4, facts=_facts(2048))
    assert rows.tokens == 128 and "examples of up to 128 tokens" in rows.why
    rows = pick_row_length(lengths, max_seq_length=300, pad_to=32, batch_size=4, facts=None)  # unread shapes
    assert rows.tokens == 300 and "on a model" not in rows.why


def test_a_given_length_wins_and_one_shorter_than_an_example_is_refused():
    lengths = _lengths()
    cfg = Config.from_dict({"data": {"pack": True}})
    picked = packed_row_length(cfg, lengths)  # the embedded model's shapes, read from its folder
    assert picked.picked and picked.tokens == pick_row_length(lengths, max_seq_length=2048, pad_to=32, batch_size=4,
                                                              facts=read_model(TINY_MODEL)).tokens
    cfg.origins["data.max_seq_length"] = "command line"  # --max-seq-length 2048, as the user gave it
    given = packed_row_length(cfg, lengths)
    assert (given.tokens, given.picked, given.line()) == (2048, False, "data.pack: rows of 2048 tokens "
                                                                        "(data.max_seq_length)")
    cfg = Config.from_dict({"data": {"pack": True, "pack_length": 320}})
    assert (packed_row_length(cfg, lengths).tokens, packed_row_length(cfg, lengths).picked) == (320, False)
    cfg = Config.from_dict({"data": {"pack": True, "pack_length": 32}})
    with pytest.raises(ValueError, match=r"^data.pack_length 32 is shorter than the longest training example "
                                         r"\(69 tokens\); give --data.pack_length 69 or more, or 0 to pick it$"):
        packed_row_length(cfg, lengths)


@pytest.mark.parametrize("value", [-1, 1, 4096])
def test_pack_length_outside_2_to_max_seq_length_is_a_config_error(value):
    cfg = Config.from_dict({"data": {"pack": True, "pack_length": value, "max_seq_length": 2048}})
    with pytest.raises(ConfigError, match=rf"data.pack_length = {value}: must be 0 \(picked from the data\) or 2 "
                                          r"to data.max_seq_length \(2048\)"):
        cfg.validate()
