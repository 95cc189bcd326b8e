"""The prompt a trained model is sent: the run's recorded format and system prompt, the data side that records
them, and the sampling flags' checks."""

from __future__ import annotations

import json

import pytest

from meshtune.data.formats import Features, jsonl_source, tokenize_rows
from meshtune.inference import Sampling
from meshtune.prompt_format import (RunPrompt, choose_prompt_format, prompt_tokens, recorded_prompt_format,
                                    run_prompt_format, with_system_prompt)
from support import TINY_MODEL

SYSTEM = "Answer with the number only."


@pytest.fixture(scope="module")
def tokenizer():
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(TINY_MODEL)


def _chat(system: str | None, user: str = "What is 1 + 1?", reply: str | None = "2") -> dict:
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": user})
    if reply is not None:
        messages.append({"role": "assistant", "content": reply})
    return {"messages": messages}


def _split(tokenizer, rows, mask_prompt=False):
    return tokenize_rows(enumerate(rows, start=1), tokenizer, name="train", path=None,
                         source=jsonl_source(__import__("pathlib").Path("train.jsonl")), mask_prompt=mask_prompt,
                         features=Features(), max_length=None, max_seq_length=None, skip_empty=False)


def test_a_system_prompt_every_row_shares_is_recorded(tokenizer):
    shared = _split(tokenizer, [_chat(SYSTEM), _chat(SYSTEM, "What is 2 + 2?", "4")])
    assert shared.system_prompt == SYSTEM
    assert recorded_prompt_format(shared) == {"data_format": "chat", "system_prompt": SYSTEM}
    # Rows that differ, or some without one, record none: there is no single prompt to repeat.
    assert _split(tokenizer, [_chat(SYSTEM), _chat("Be brief.")]).system_prompt is None
    assert _split(tokenizer, [_chat(SYSTEM), _chat(None)]).system_prompt is None
    assert recorded_prompt_format(_split(tokenizer, [{"prompt": "a", "completion": "b"}])) == {
        "data_format": "completions"}


def test_mask_prompt_on_a_chat_row_without_a_reply_names_the_row_and_the_fix(tokenizer):
    with pytest.raises(ValueError) as err:
        _split(tokenizer, [_chat(SYSTEM), _chat(None, reply=None)], mask_prompt=True)
    message = str(err.value)
    assert message.startswith("train.jsonl:2: with mask_prompt the loss is on the assistant's reply, and the 1 "
                              "message(s) of 'messages' hold none")
    assert "--data.mask_prompt false" in message and "empty conversation" not in message


def test_the_run_s_system_prompt_frames_a_prompt_unless_replaced_or_raw(tmp_path, tokenizer):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"data_format": "chat", "system_prompt": SYSTEM}))
    run = run_prompt_format(tmp_path)
    assert run == RunPrompt("chat", SYSTEM)
    choice = choose_prompt_format(run, has_template=True, has_adapters=True)
    assert choice.chat and choice.system_prompt == SYSTEM and "--system-prompt ''" in choice.why
    framed = prompt_tokens(tokenizer, "What is 3 + 4?", choice)
    by_hand = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                             {"role": "user", "content": "What is 3 + 4?"}],
                                            add_generation_prompt=True, return_dict=False)
    assert framed == list(by_hand)
    assert choose_prompt_format(run, has_template=True, has_adapters=True, system_prompt="Other.").system_prompt \
        == "Other."
    assert choose_prompt_format(run, has_template=True, has_adapters=True, system_prompt="").system_prompt is None
    raw = choose_prompt_format(run, has_template=True, has_adapters=True, raw=True)
    assert prompt_tokens(tokenizer, "x", raw) == list(tokenizer.encode("x"))


def test_a_request_s_own_system_message_wins_over_the_run_s():
    user = [{"role": "user", "content": "hi"}]
    assert with_system_prompt(user, SYSTEM) == [{"role": "system", "content": SYSTEM}, *user]
    own = [{"role": "system", "content": "mine"}, *user]
    assert with_system_prompt(own, SYSTEM) == own
    assert with_system_prompt(user, None) == user


@pytest.mark.parametrize("settings, flag", [
    ({"temp": -0.5}, "--temp -0.5"), ({"top_p": 0.0}, "--top-p 0.0"), ({"top_p": 1.5}, "--top-p 1.5"),
    ({"min_p": 2.0}, "--min-p 2.0"), ({"top_k": -1}, "--top-k -1"),
])
def test_sampling_out_of_range_names_the_flag(settings, flag):
    with pytest.raises(ValueError, match=f"^{flag}: give"):
        Sampling(**settings).check()
    Sampling().check()
