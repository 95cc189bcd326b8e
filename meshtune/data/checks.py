"""Every example must leave at least one token in the loss; this module says why one does not.

An example with no target position (`trained_tokens`) adds nothing to a step, and a batch made only
of such examples divides zero by zero: the run reports ``loss=nan`` and trains on nothing. So every
row is checked at load time, and one with nothing to learn is an ``EmptyExample`` error naming
``file:line`` and the cause (an empty completion, text or last message, a prompt that is the whole
example, a completion cut off by max_seq_length), unless ``data.skip_empty`` drops such rows with
one warning per split. A message whose role the chat template would drop is an error even then
(`check_role`).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT's names, a file converted for another tool: an error even where a template renders any role.
FOREIGN_ROLES = ("human", "gpt")
SKIP_FIX = "or set --data.skip_empty true to skip such rows"
SHOWN = 3  # skipped rows named in the warning, for reference


class EmptyExample(ValueError):
    """A row that leaves no token in the loss; ``why`` is the cause without the location."""

    def __init__(self, where: str, why: str, fix: str) -> None:
        self.where, self.why = where, why
        super().__init__(f"{where}: {why}, so the example has nothing to learn; {fix}, {SKIP_FIX}")


class SkippedExamplesWarning(UserWarning):
    """``data.skip_empty`` dropped examples of a split that had nothing to learn."""


class NoReplyWarning(UserWarning):
    """Chat rows of a split hold no assistant message: without the prompt mask they train on the others."""


def check_role(message: Dict[str, Any], k: int, key: str, where: str,
               template_keeps: Callable[[str], bool] = lambda role: False) -> None:
    """Raise for a role outside :data:`ROLES` that the tokenizer's chat template drops or rejects
    (`template_keeps(role)` says whether it renders such a message: Llama 3.1's ipython, OpenAI's developer).

    Templates drop (or reject) roles they do not know, so the example would silently lose that message.
    That is bad input, usually a whole file written with another tool's role names (ShareGPT's
    human/gpt), and it is an error even with ``data.skip_empty``: skipping would quietly train on what
    is left.
    """
    role = message.get("role")
    if role not in ROLES and (role in FOREIGN_ROLES or not (isinstance(role, str) and template_keeps(role))):
        raise ValueError(
            f"{where}: message {k} of {key!r} has role {role!r}, which this tokenizer's chat template drops "
            "or rejects; "
            f"use one of {', '.join(ROLES)} (e.g. human -> user, gpt -> assistant); data.skip_empty "
            "does not skip this row: an unknown role is a data error, not an empty example"
        )


def trained_tokens(length: int, offset: int, max_seq_length: Optional[int] = None) -> int:
    """How many target positions of an example count in the loss.

    The loss (training/losses.py, mlx-lm's ``default_loss``) counts target positions ``t`` with
    ``max(offset, 1) <= t < min(length, max_seq_length)``: the prompt mask removes the first
    ``offset``, truncation everything past ``data.max_seq_length``.
    """
    kept = length if max_seq_length is None else min(length, max_seq_length)
    return max(0, kept - max(offset, 1))


def check_example(where: str, length: int, offset: int, max_seq_length: Optional[int]) -> None:
    """Raise ``EmptyExample`` when a tokenized example leaves no token in the loss."""
    if trained_tokens(length, offset) == 0:
        raise EmptyExample(
            where, f"it is only {length} token{'s' if length != 1 else ''} long" +
            (f" and the prompt mask covers {offset}" if offset else ""),
            "give it content to learn")
    if max_seq_length is not None and trained_tokens(length, offset, max_seq_length) == 0:
        need = max(offset, 1) + 1
        raise EmptyExample(
            where, f"its completion starts at token {offset} of {length} but --max-seq-length "
            f"{max_seq_length} (data.max_seq_length) cuts it off there",
            f"raise it with --max-seq-length {max(need, length)} (at least {need}), shorten the prompt")


def check_nonempty(row: Dict[str, Any], key: str, where: str) -> None:
    """Raise ``EmptyExample`` when the string ``row[key]`` is empty or blank."""
    if not row[key].strip():
        raise EmptyExample(where, f"{key!r} is empty", "fill it in or remove the line")


def skipped_message(name: str, place: Callable[[int], str], skipped: Sequence[Tuple[int, str]], total: int) -> str:
    """The one warning of a split whose rows with nothing to learn were skipped; `place(n)` names row n."""
    shown = "; ".join(f"{place(line)} ({why})" for line, why in skipped[:SHOWN])
    more = f"; and {len(skipped) - SHOWN} more" if len(skipped) > SHOWN else ""
    return (f"{name}: skipped {len(skipped)} of {total} examples with nothing to learn "
            f"(data.skip_empty): {shown}{more}")


def no_reply_message(name: str, place: Callable[[int], str], lines: Sequence[int], total: int) -> str:
    """The one warning of a split whose chat rows at `lines` have no assistant message (data.mask_prompt off;
    on, each is an error)."""
    return (f"{name}: {len(lines)} of {total} chat examples have no assistant reply (first: {place(lines[0])}); "
            "without --mask-prompt they train on their user and system messages as the text to learn; add the "
            "assistant's reply as the last message, or remove them")
