"""How a prompt reaches a trained model: through the chat template or as raw text, with the system prompt
the run trained with.

A training run records its data's format and, for chat data whose rows all open with the same
system message, that message, in adapter_config.json (`recorded_prompt_format`; stock mlx-lm
ignores both keys). `meshtune generate` and `meshtune serve` read them back
(`run_prompt_format`) so a user's message is framed as the model saw its training examples.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .run_dir import RunDir

DATA_FORMAT_KEY = "data_format"
SYSTEM_PROMPT_KEY = "system_prompt"


def recorded_prompt_format(train_split: Any) -> dict[str, Any]:
    """adapter_config.json's keys for the prompt format of a run's tokenized train split."""
    recorded: dict[str, Any] = {DATA_FORMAT_KEY: train_split.format}
    if getattr(train_split, "system_prompt", None) is not None:
        recorded[SYSTEM_PROMPT_KEY] = train_split.system_prompt
    return recorded


@dataclass(frozen=True)
class RunPrompt:
    """What a run recorded about its prompts: the data format (None: not recorded) and the shared system prompt."""

    data_format: str | None = None
    system_prompt: str | None = None


def run_prompt_format(adapter_path: str | Path | None) -> RunPrompt:
    """The prompt format recorded in an adapter folder (empty for no folder or an mlx_lm.lora run)."""
    config = RunDir(adapter_path).config if adapter_path else None
    if config is None or not config.is_file():
        return RunPrompt()
    saved = json.loads(config.read_text())
    return RunPrompt(saved.get(DATA_FORMAT_KEY), saved.get(SYSTEM_PROMPT_KEY))


@dataclass(frozen=True)
class PromptChoice:
    """How one prompt is sent: `chat` through the template, with `system_prompt` (None: no system message);
    `why` says in a few words what decided it."""

    chat: bool
    system_prompt: str | None
    why: str


def choose_prompt_format(run: RunPrompt, *, has_template: bool, has_adapters: bool, raw: bool = False,
                         chat: bool = False, system_prompt: str | None = None) -> PromptChoice:
    """Template or raw text, and the system prompt, for a prompt to the model (generate's --raw / --chat /
    --system-prompt; an empty --system-prompt sends none).

    The template only when the tokenizer has one and the adapters were trained on chat or
    prompt/completion data: a model trained on plain text continues a raw prompt. The system
    prompt given wins over the one the run trained with.
    """
    if raw:
        return PromptChoice(False, None, "--raw")
    system = system_prompt if system_prompt is not None else run.system_prompt
    system = system or None
    if chat:
        if not has_template:
            raise ValueError("--chat: the tokenizer has no chat template; drop --chat to send the prompt as is")
        return PromptChoice(True, system, "--chat")
    if not has_template:
        return PromptChoice(False, None, "the tokenizer has no chat template")
    if not has_adapters:
        return PromptChoice(True, system, "the tokenizer has one; --raw sends the prompt as is")
    if run.data_format == "text":
        return PromptChoice(False, None, "the adapters were trained on text data; --chat forces the template")
    if run.data_format in ("chat", "completions"):
        why = f"the adapters were trained on {run.data_format} data"
        if system is not None and system_prompt is None:
            why += " with a system prompt, sent too (--system-prompt '' drops it)"
        return PromptChoice(True, system, f"{why}; --raw sends the prompt as is")
    return PromptChoice(True, system, "the tokenizer has one and the adapters record no data format; --raw sends "
                                      "the prompt as is")


def prompt_messages(prompt: str, system_prompt: str | None) -> list[dict[str, str]]:
    """The conversation a single prompt makes: the system message (if any), then the user's."""
    head = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
    return [*head, {"role": "user", "content": prompt}]


def with_system_prompt(messages: list[dict[str, Any]], system_prompt: str | None) -> list[dict[str, Any]]:
    """`messages` opened by the run's system prompt unless they bring a system message of their own."""
    if system_prompt is None or any(isinstance(m, dict) and m.get("role") == "system" for m in messages):
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


def prompt_tokens(tokenizer: Any, prompt: str, choice: PromptChoice) -> list[int]:
    """The prompt's tokens as `choice` frames them (the template's generation prompt appended)."""
    if choice.chat:
        return list(tokenizer.apply_chat_template(prompt_messages(prompt, choice.system_prompt),
                                                  add_generation_prompt=True, return_dict=False))
    return list(tokenizer.encode(prompt))
