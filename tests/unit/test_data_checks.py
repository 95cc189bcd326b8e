"""Examples with nothing to learn (meshtune/data/checks.py): each cause is one error line naming
file:line and the fix; data.skip_empty skips them with one warning per split; an unknown chat role
is an error either way; the cached split warns as the tokenized one does; chat rows without a reply
warn once unmasked."""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest

from meshtune.data import SkippedExamplesWarning, load_datasets, load_split
from meshtune.data.checks import NoReplyWarning, trained_tokens
from meshtune.data.token_cache import CACHE_ENV
from meshtune.training.losses import target_mask

pytest.importorskip("tokenizers")
from test_data import make_tokenizer, write_jsonl  # noqa: E402

GOOD = {"prompt": "1+2?", "completion": "3"}
# Renders user messages only, as a template that drops what it does not know.
USER_ONLY = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}</s>"
             "{% endif %}{% endfor %}")
SKIP = r", or set --data\.skip_empty true to skip such rows$"


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def _fails(path, tok, pattern, **kw):
    with pytest.raises(ValueError, match=pattern) as info:
        load_split(path, tok, **kw)
    assert "\n" not in str(info.value) and str(path) in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("length,offset,msl", [(l, o, m) for l in (1, 2, 5, 9) for o in (0, 1, 3, 8)
                                                 for m in (None, 2, 4, 16)])
def test_trained_tokens_counts_what_the_loss_counts(length, offset, msl):
    kept = length if msl is None else min(length, msl)
    width = kept + 3  # padded, as the batcher pads
    mask = target_mask(mx.array([[offset, kept]]), width - 1)
    assert trained_tokens(length, offset, msl) == int(mask.sum().item())


# Renders the four roles chat templates share and drops any other, as Qwen's and the tiny model's do.
STRICT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] in ['system', 'user', 'assistant', 'tool'] %}"
                   "<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endif %}{% endfor %}"
                   "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.mark.parametrize("role,template", [("wizard", STRICT_TEMPLATE), ("developer", STRICT_TEMPLATE),
                                           ("", STRICT_TEMPLATE), (3, STRICT_TEMPLATE), (None, STRICT_TEMPLATE),
                                           ("human", STRICT_TEMPLATE), ("human", None), ("gpt", None)])
def test_a_role_the_template_drops_names_role_and_line_even_with_skip_empty(tmp_path, role, template):
    """A role outside system/user/assistant/tool that the tokenizer's template drops, or ShareGPT's
    human/gpt even where the template renders any role (None: test_data's, which does)."""
    tok = make_tokenizer() if template is None else make_tokenizer(template)
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
            {"messages": [{"role": role, "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    path = write_jsonl(tmp_path, "train", rows)
    for skip in (False, True):
        msg = _fails(path, tok, rf"train\.jsonl:2: message 0 of 'messages' has role {role!r}, which this "
                                r"tokenizer's chat template drops or rejects; use one of system, user, assistant, "
                                r"tool", skip_empty=skip)
        assert "data.skip_empty does not skip this row" in msg


@pytest.mark.parametrize("role", ["developer", "ipython"])
def test_a_role_the_template_renders_trains_as_mlx_lm_trains_it(tmp_path, tok, role):
    """OpenAI's developer, Llama 3.1's ipython: where the template renders them, the row tokenizes as
    mlx-lm's would (the template applied to the messages as given)."""
    messages = [{"role": role, "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"}]
    path = write_jsonl(tmp_path, "train", [{"messages": messages}])
    split = load_split(path, tok)
    expected = tok.apply_chat_template(messages, return_dict=False)
    assert split.tokens[split.starts[0]:split.starts[0] + split.lengths[0]].tolist() == expected


@pytest.mark.parametrize("row,mask,why", [
    ({"prompt": "p", "completion": " "}, False, r"'completion' is empty"),
    ({"text": ""}, False, r"'text' is empty"),
    ({"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": ""}]}, True,
     r"the last message of 'messages' \(assistant\) is empty"),
])
def test_empty_content_is_an_error_with_the_fix(tmp_path, tok, row, mask, why):
    first = {"text": "ok"} if "text" in row else GOOD if "prompt" in row else \
        {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "v"}]}
    path = write_jsonl(tmp_path, "train", [first, row])
    _fails(path, tok, rf"train\.jsonl:2: {why}, so the example has nothing to learn; fill it in or remove "
                      rf"the line{SKIP}", mask_prompt=mask)


def test_a_tool_call_turn_without_text_is_not_empty(tmp_path, tok):
    row = {"messages": [{"role": "user", "content": "add"},
                        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add"}}]}]}
    assert len(load_split(write_jsonl(tmp_path, "train", [row]), tok)) == 1


def test_prompt_that_is_the_whole_example(tmp_path):
    # The template drops the assistant turn: with mask_prompt the prompt is everything.
    row = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "v"}]}
    path = write_jsonl(tmp_path, "train", [row])
    _fails(path, make_tokenizer(USER_ONLY), r"train\.jsonl:1: with mask_prompt the prompt is all \d+ tokens, so "
                                            rf"the example has nothing to learn; .*set --data\.mask_prompt false{SKIP}",
           mask_prompt=True)


def test_example_of_one_token(tmp_path):
    path = write_jsonl(tmp_path, "train", [{"messages": [{"role": "assistant", "content": "v"}]}])
    _fails(path, make_tokenizer(USER_ONLY), rf"train\.jsonl:1: it is only 1 token long, so .*{SKIP}")


def test_completion_cut_off_by_max_seq_length_names_the_flag(tmp_path, tok):
    rows = [GOOD, {"prompt": "x" * 40, "completion": "y"}]
    path = write_jsonl(tmp_path, "train", rows)
    assert len(load_split(path, tok, mask_prompt=True, max_seq_length=64)) == 2
    assert len(load_split(path, tok, max_seq_length=16)) == 2  # unmasked: the prompt trains
    msg = _fails(path, tok, r"train\.jsonl:2: its completion starts at token (\d+) of (\d+) but --max-seq-length 16 "
                            r"\(data\.max_seq_length\) cuts it off there, so the example has nothing to learn; "
                            rf"raise it with --max-seq-length \d+ \(at least \d+\), shorten the prompt{SKIP}",
                 mask_prompt=True, max_seq_length=16)
    offset = load_split(path, tok, mask_prompt=True).offsets[1]
    assert f"starts at token {offset} " in msg and f"(at least {offset + 1})" in msg
    # At the bound it trains one token, so it loads.
    assert len(load_split(path, tok, mask_prompt=True, max_seq_length=int(offset) + 1)) == 2


def test_skip_empty_skips_with_one_warning_per_split(tmp_path, tok):
    bad = [{"prompt": "p", "completion": ""}, {"prompt": "x" * 40, "completion": "y"}]
    rows = [GOOD, bad[0], GOOD, bad[1], bad[0], GOOD, bad[0], bad[0]]  # bad on lines 2, 4, 5, 7, 8
    write_jsonl(tmp_path, "train", rows)
    write_jsonl(tmp_path, "valid", [GOOD, bad[0]])
    seen = []
    data = load_datasets(tmp_path, tok, mask_prompt=True, max_seq_length=16, skip_empty=True, warn=seen.append)
    assert len(data.train) == 3 and len(data.valid) == 1
    assert [line for line, _ in data.train.skipped] == [2, 4, 5, 7, 8]
    train = tmp_path / "train.jsonl"
    assert seen == [
        f"train: skipped 5 of 8 examples with nothing to learn (data.skip_empty): {train}:2 ('completion' is "
        f"empty); {train}:4 (its completion starts at token {data.train.skipped[1][1].split()[5]} of "
        f"{data.train.skipped[1][1].split()[7]} but --max-seq-length 16 (data.max_seq_length) cuts it off "
        f"there); {train}:5 ('completion' is empty); and 2 more",
        f"valid: skipped 1 of 2 examples with nothing to learn (data.skip_empty): "
        f"{tmp_path / 'valid.jsonl'}:2 ('completion' is empty)",
    ]
    # What is kept is what a file of the good rows alone gives.
    clean = load_split(write_jsonl(tmp_path / "..", "clean", [GOOD] * 3), tok, mask_prompt=True)
    assert np.array_equal(clean.tokens, data.train.tokens) and np.array_equal(clean.offsets, data.train.offsets)
    with warnings.catch_warnings(record=True) as caught:  # the default warn
        warnings.simplefilter("always")
        load_split(tmp_path / "valid.jsonl", tok, skip_empty=True)
    assert [str(w.message)[:20] for w in caught if w.category is SkippedExamplesWarning] == ["valid: skipped 1 of "]


def test_skip_empty_leaving_nothing_is_an_error(tmp_path, tok):
    path = write_jsonl(tmp_path, "train", [{"prompt": "p", "completion": ""}] * 2)
    _fails(path, tok, r"train\.jsonl: all 2 examples have nothing to learn \(line 1: 'completion' is empty\); "
                      r"data\.skip_empty leaves none, so fix the data", skip_empty=True)


def test_valid_split_is_checked_too(tmp_path):
    write_jsonl(tmp_path, "train", [GOOD])
    chat = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "v"}]}
    write_jsonl(tmp_path, "valid", [chat, {"messages": [{"role": "wizard", "content": "hi"}]}])
    with pytest.raises(ValueError, match=r"valid\.jsonl:2: message 0 of 'messages' has role 'wizard'"):
        load_datasets(tmp_path, make_tokenizer(STRICT_TEMPLATE))  # a template that drops the role


def test_cached_split_is_checked_and_warns_again(tmp_path, tok, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    path = write_jsonl(tmp_path, "train", [GOOD, {"prompt": "x" * 40, "completion": "y"}])
    first, again = [], []
    a = load_split(path, tok, mask_prompt=True, max_seq_length=16, skip_empty=True, warn=first.append)
    b = load_split(path, tok, mask_prompt=True, max_seq_length=16, skip_empty=True, warn=again.append)
    assert len(list((tmp_path / "cache" / "tokens").glob("*.npz"))) == 1  # the second was read back
    assert first == again and len(first) == 1 and a.skipped == b.skipped and len(b) == 1
    # Without skip_empty, or with another max_seq_length, the cached entry is not the answer.
    _fails(path, tok, r"train\.jsonl:2: its completion starts", mask_prompt=True, max_seq_length=16)
    assert len(load_split(path, tok, mask_prompt=True, max_seq_length=64, skip_empty=True)) == 2


def test_unmasked_splits_do_not_key_the_cache_on_max_seq_length(tmp_path, tok, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    path = write_jsonl(tmp_path, "train", [GOOD, {"prompt": "x" * 40, "completion": "y"}])
    for msl in (2, 16, 64, None):  # unmasked, every cut keeps a target: one entry serves all
        assert len(load_split(path, tok, max_seq_length=msl)) == 2
    assert len(list((tmp_path / "cache" / "tokens").glob("*.npz"))) == 1


def test_chat_rows_without_a_reply_warn_once_unmasked_and_stop_a_masked_run(tmp_path, tok, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    chat = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "v"}]}
    lone = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}
    path = write_jsonl(tmp_path, "train", [chat, lone, chat, chat, lone])
    first, again = [], []
    data = load_split(path, tok, warn=first.append)
    load_split(path, tok, warn=again.append)  # read back from the token cache
    assert len(list((tmp_path / "cache" / "tokens").glob("*.npz"))) == 1
    assert data.no_reply == (2, 5) and len(data) == 5
    assert first == again == [
        f"train: 2 of 5 chat examples have no assistant reply (first: {path}:2); without --mask-prompt they "
        "train on their user and system messages as the text to learn; add the assistant's reply as the last "
        "message, or remove them"]
    with warnings.catch_warnings(record=True) as caught:  # the default warn
        warnings.simplefilter("always")
        load_split(path, tok)
    assert [w.category for w in caught] == [NoReplyWarning]
    _fails(path, tok, r"train\.jsonl:2: with mask_prompt the loss is on the assistant's reply", mask_prompt=True)
    said = []
    assert load_split(write_jsonl(tmp_path, "valid", [chat, chat]), tok, warn=said.append).no_reply == ()
    assert said == []
