"""Read data splits in mlx-lm's formats and tokenize them once, up front.

Three formats, chosen from the keys of a file's first line as ``mlx_lm.tuner.datasets.create_dataset``
chooses: completions (``{"prompt", "completion"}``, through the chat template), chat
(``{"messages": [...]}``) and text (``{"text": ...}``); completions and chat rows may carry ``"tools"``.
With ``mask_prompt`` the loss skips the prompt, measured as mlx-lm measures it. Unlike mlx-lm, every
line is checked: a problem is a one-line ``ValueError`` naming ``file:line`` (a Hugging Face row as
``<path or id>[split] row N``) and the fix, a row with nothing to learn included (checks.py;
``skip_empty`` skips it with one warning). ``tokenize_rows`` checks and tokenizes any source of rows.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, NamedTuple, Optional, Tuple

import numpy as np

from .checks import (EmptyExample, NoReplyWarning, SkippedExamplesWarning, check_example, check_nonempty, check_role,
                     no_reply_message, skipped_message)
from .dataset import TokenizedDataset
from .token_cache import cached_split

TEXT, COMPLETIONS, CHAT = "text", "completions", "chat"


@dataclass(frozen=True)
class Features:
    """Names of the jsonl keys holding each field (mlx-lm's ``*_feature`` options)."""

    prompt_feature: str = "prompt"
    completion_feature: str = "completion"
    text_feature: str = "text"
    chat_feature: str = "messages"


def detect_format(row: Dict[str, Any], features: Features) -> Optional[str]:
    """The format a row's keys indicate, with mlx-lm's priority, or None."""
    if features.prompt_feature in row and features.completion_feature in row:
        return COMPLETIONS
    if features.chat_feature in row:
        return CHAT
    if features.text_feature in row:
        return TEXT
    return None


def _format_keys(fmt: str, features: Features) -> str:
    if fmt == COMPLETIONS:
        return f"keys {features.prompt_feature!r} and {features.completion_feature!r}"
    if fmt == CHAT:
        return f"key {features.chat_feature!r}"
    return f"key {features.text_feature!r}"


def _has_keys(row: Dict[str, Any], fmt: str, features: Features) -> bool:
    if fmt == COMPLETIONS:
        return features.prompt_feature in row and features.completion_feature in row
    if fmt == CHAT:
        return features.chat_feature in row
    return features.text_feature in row


def _one_line(err: BaseException) -> str:
    # Tokenizer and Jinja errors can span lines; our errors promise one line.
    return " ".join(f"{type(err).__name__}: {err}".split())


def _apply_template(
    tokenizer: Any,
    messages: List[Dict[str, Any]],
    tools: Any,
    add_generation_prompt: bool,
    where: str,
) -> List[int]:
    try:
        ids = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            return_dict=False,
        )
    except Exception as err:  # any template failure is a data/tokenizer mismatch
        raise ValueError(
            f"{where}: the tokenizer's chat template failed ({_one_line(err)}); "
            "fix this row or use a tokenizer with a chat template that accepts it"
        ) from err
    return [int(t) for t in ids]


def _check_string(row: Dict[str, Any], key: str, where: str, *, nonempty: bool = False) -> str:
    value = row[key]
    if not isinstance(value, str):
        raise ValueError(
            f"{where}: {key!r} must be a string, got {type(value).__name__}"
        )
    if nonempty:
        # An empty target trains only the end-of-turn tokens: almost always a data bug.
        check_nonempty(row, key, where)
    return value


ROLE_PROBE = "meshtune-role-probe-7f3a"


class TemplateRoles:
    """Whether a tokenizer's chat template renders a message of each role (its content in the text), tried
    once per role: a split's rows ask for every message."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._kept: Dict[str, bool] = {}

    def __call__(self, role: str) -> bool:
        if role not in self._kept:
            try:
                text = self.tokenizer.apply_chat_template([{"role": role, "content": ROLE_PROBE},
                                                           {"role": "user", "content": "hi"}], tokenize=False)
                self._kept[role] = isinstance(text, str) and ROLE_PROBE in text
            except Exception:  # a template that raises on the role rejects it
                self._kept[role] = False
        return self._kept[role]


def _check_messages(row: Dict[str, Any], key: str, where: str,
                    keeps_role: Optional[TemplateRoles] = None) -> List[Dict[str, Any]]:
    messages = row[key]
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"{where}: {key!r} must be a non-empty list of messages like "
            '{"role": "user", "content": "..."}'
        )
    for k, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg:
            raise ValueError(
                f"{where}: message {k} of {key!r} must be an object with a 'role' "
                f"key, got {json.dumps(msg)[:60]}"
            )
        check_role(msg, k, key, where, keeps_role or (lambda role: False))
    last = messages[-1]
    content = last.get("content")
    # An assistant turn that only calls tools has no text content, and is fine.
    if last["role"] == "assistant" and isinstance(content, str) and not content.strip() \
            and not last.get("tool_calls"):
        raise EmptyExample(where, f"the last message of {key!r} (assistant) is empty",
                           "fill it in or remove the line")
    return messages


def _masked(
    tokenizer: Any,
    messages: List[Dict[str, Any]],
    tools: Any,
    add_generation_prompt: bool,
    full: List[int],
    where: str,
) -> int:
    """Prompt length for the mask; the prompt must be a prefix of the full tokens."""
    prompt = _apply_template(tokenizer, messages[:-1], tools, add_generation_prompt, where)
    if full[: len(prompt)] != prompt:
        differ = next(
            (k for k, (a, b) in enumerate(zip(prompt, full)) if a != b),
            min(len(prompt), len(full)),
        )
        raise ValueError(
            f"{where}: with mask_prompt the prompt's {len(prompt)} tokens are not a "
            f"prefix of the full conversation's {len(full)} tokens (first difference "
            f"at token {differ}), so the answer cannot be located; turn off "
            "mask_prompt (--data.mask_prompt false) or use a chat template that renders the prompt unchanged"
        )
    if len(prompt) >= len(full):
        raise EmptyExample(
            where, f"with mask_prompt the prompt is all {len(full)} tokens",
            "give the last message some content, set --data.mask_prompt false")
    return len(prompt)


def has_reply(messages: List[Dict[str, Any]]) -> bool:
    """Whether a chat holds an assistant message (what a masked row trains on)."""
    return any(m.get("role") == "assistant" for m in messages)


def tokenize_row(
    row: Dict[str, Any],
    fmt: str,
    tokenizer: Any,
    *,
    mask_prompt: bool,
    features: Features,
    where: str = "<row>",
    roles: Optional[TemplateRoles] = None,
) -> Tuple[List[int], int]:
    """Tokenize one row of a known format into ``(tokens, offset)`` as mlx-lm's ``process``; ``roles``, the
    tokenizer's TemplateRoles, shared by a split's rows (default: one for this row)."""
    if fmt == TEXT:
        text = _check_string(row, features.text_feature, where, nonempty=True)
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError(
                f"{where}: text data needs an end-of-sequence token but the "
                "tokenizer has no eos_token_id; set eos_token on the tokenizer"
            )
        ids = [int(t) for t in tokenizer.encode(text)]
        if not ids or ids[-1] != eos:
            ids.append(int(eos))
        return ids, 0

    tools = row.get("tools")
    if fmt == COMPLETIONS:
        messages = [
            {"role": "user", "content": _check_string(row, features.prompt_feature, where)},
            {
                "role": "assistant",
                "content": _check_string(row, features.completion_feature, where, nonempty=True),
            },
        ]
        add_generation_prompt = True
    elif fmt == CHAT:
        keeps_role = roles or (TemplateRoles(tokenizer) if tokenizer is not None else None)
        messages = _check_messages(row, features.chat_feature, where, keeps_role)
        # mlx-lm only asks for the assistant header when an assistant turn follows.
        add_generation_prompt = messages[-1].get("role") == "assistant"
    else:
        raise ValueError(f"{where}: unknown format {fmt!r}; use text, completions or chat")

    if mask_prompt and fmt == CHAT and not has_reply(messages):
        # mlx-lm masks every message but the last; with no reply that is the user's own text
        # (or, for a single message, nothing the template can render).
        raise EmptyExample(where, f"with mask_prompt the loss is on the assistant's reply, and the "
                                  f"{len(messages)} message(s) of {features.chat_feature!r} hold none",
                           "add the assistant's reply as the last message, set --data.mask_prompt false")
    full = _apply_template(tokenizer, messages, tools, False, where)
    if not mask_prompt:
        return full, 0
    return full, _masked(tokenizer, messages, tools, add_generation_prompt, full, where)


def _decode(raw: bytes, where: str, encoding: str) -> str:
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{where}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column {err.start + 1}); "
            "save the file as UTF-8"
        ) from None


def _parse_line(line: str, where: str) -> Dict[str, Any]:
    # Without its newline: a line cut short then fails where it ends, not at "line 2 column 1".
    text = line.rstrip("\r\n")
    try:
        row = json.loads(text)
    except json.JSONDecodeError as err:
        cut = err.pos >= len(text.rstrip()) or err.msg.startswith("Unterminated string")
        what = (f"the line ends at column {len(text)} inside the object: cut short?" if cut
                else f"{err.msg} at column {err.colno}")
        raise ValueError(
            f"{where}: invalid JSON ({what}); write exactly one JSON object per line"
        ) from None
    if not isinstance(row, dict):
        raise ValueError(
            f"{where}: expected a JSON object, got a JSON {type(row).__name__}; write "
            "one object per line"
        )
    return row


class Source(NamedTuple):
    """Where a split's rows come from, for messages: ``place(n)`` names row n; ``unit`` is line or row."""

    label: str
    unit: str
    container: str
    place: Callable[[int], str]


def jsonl_source(path: Path) -> Source:
    """A jsonl file: rows are lines, named ``file:line``."""
    return Source(str(path), "line", "file", lambda n: f"{path}:{n}")


class EmptySplit(ValueError):
    """A split without a single row; `what` says so without the fix, for a caller that gives its own."""

    def __init__(self, what: str, fix: str) -> None:
        self.what = what
        super().__init__(f"{what}; {fix}")


def load_split(
    path: Path,
    tokenizer: Any,
    *,
    mask_prompt: bool = False,
    features: Features = Features(),
    max_length: Optional[int] = None,
    max_seq_length: Optional[int] = None,
    skip_empty: bool = False,
    warn: Optional[Callable[[str], None]] = None,
) -> TokenizedDataset:
    """Read one jsonl split and tokenize every line; the split is named after the file stem.

    With ``max_length`` an example of more tokens is an error (``data.truncate false``);
    without, the batcher truncates it and warns once per split. An example with no token
    in the loss once truncated to ``max_seq_length`` (the batcher's cap, data.max_seq_length)
    is an error naming its line, or with ``skip_empty`` left out; ``warn`` (default:
    ``warnings.warn`` with ``SkippedExamplesWarning``) then gets one message for the split.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"{path}: file not found; create it with one JSON object per line"
        )
    # Tokenized once per file, tokenizer and these options; read back after that (token_cache.py).
    # The skipped rows are cached with the tokens, so a split read back warns the same way.
    cut, options = options_key(mask_prompt, features, max_length, max_seq_length, skip_empty)
    source = jsonl_source(path)
    data = cached_split(path, tokenizer, options, lambda: tokenize_rows(
        _jsonl_rows(path), tokenizer, name=path.stem, path=path, source=source, mask_prompt=mask_prompt,
        features=features, max_length=max_length, max_seq_length=cut, skip_empty=skip_empty))
    warn_rows(data, source, warn)
    return data


def options_key(mask_prompt: bool, features: Features, max_length: Optional[int],
                max_seq_length: Optional[int], skip_empty: bool) -> Tuple[Optional[int], str]:
    """(the cut tokenize_rows applies, the cache's options key) for these settings."""
    # Unmasked, a cut (to at least 2 tokens, batches.py) always leaves one target: no need to key on it.
    cut = max_seq_length if mask_prompt else None
    return cut, repr((mask_prompt, features, max_length, cut, skip_empty))


def warn_rows(data: TokenizedDataset, source: Source, warn: Optional[Callable[[str], None]]) -> None:
    """The split's warnings about its rows, one each: those data.skip_empty left out, chat rows with no reply."""
    said = [(skipped_message(data.name, source.place, data.skipped, len(data) + len(data.skipped)),
             SkippedExamplesWarning)] if data.skipped else []
    if data.no_reply:
        said.append((no_reply_message(data.name, source.place, data.no_reply, len(data)), NoReplyWarning))
    for message, kind in said:
        if warn is None:
            warnings.warn(message, kind, stacklevel=3)
        else:
            warn(message)


def _jsonl_rows(path: Path) -> Iterator[Tuple[int, Dict[str, Any]]]:
    """(line number, parsed object) of every non-blank line."""
    # Read bytes and decode line by line, so bad text is reported at its line;
    # utf-8-sig on line 1 tolerates a byte-order mark, which editors on Windows add.
    with open(path, "rb") as fid:
        for lineno, raw in enumerate(fid, start=1):
            where = f"{path}:{lineno}"
            line = _decode(raw, where, "utf-8-sig" if lineno == 1 else "utf-8")
            if not line.strip():
                continue  # blank lines (e.g. a trailing one) carry no example
            yield lineno, _parse_line(line, where)


def tokenize_rows(
    rows: Iterable[Tuple[int, Dict[str, Any]]],
    tokenizer: Any,
    *,
    name: str,
    path: Optional[Path],
    source: Source,
    mask_prompt: bool,
    features: Features,
    max_length: Optional[int],
    max_seq_length: Optional[int],
    skip_empty: bool,
) -> TokenizedDataset:
    """Check and tokenize every ``(number, row)`` of a split; errors name ``source.place(number)``."""
    fmt: Optional[str] = None
    arrays: List[np.ndarray] = []
    offsets: List[int] = []
    skipped: List[Tuple[int, str]] = []
    no_reply: List[int] = []  # chat rows kept with no assistant message (masked, each is an error)
    system_prompts: set = set()  # of the rows kept; None for a row without one
    roles = TemplateRoles(tokenizer) if tokenizer is not None else None
    for lineno, row in rows:
        where = source.place(lineno)
        if fmt is None:
            fmt = detect_format(row, features)
            if fmt is None:
                raise ValueError(
                    f"{where}: unrecognised format, got keys {sorted(row)}; use "
                    f"{{{features.text_feature!r}}}, {{{features.prompt_feature!r}, "
                    f"{features.completion_feature!r}}} or {{{features.chat_feature!r}}}"
                    " or name your keys with --data.text_feature, --data.prompt_feature, "
                    "--data.completion_feature or --data.chat_feature"
                )
            if fmt == TEXT and mask_prompt:
                raise ValueError(
                    f"{where}: mask_prompt needs prompt/completion or chat data but "
                    f"this {source.container} is text ({_format_keys(TEXT, features)}); turn off "
                    "mask_prompt (--data.mask_prompt false) or convert the data to prompt/completion rows"
                )
            first = lineno
        elif not _has_keys(row, fmt, features):
            raise ValueError(
                f"{where}: expected {_format_keys(fmt, features)} like {source.unit} {first}, "
                f"got {sorted(row)}; use one format per {source.container}"
            )
        try:
            ids, offset = tokenize_row(
                row, fmt, tokenizer, mask_prompt=mask_prompt, features=features, where=where, roles=roles
            )
            if max_length is not None and len(ids) > max_length:
                raise ValueError(
                    f"{where}: example is {len(ids)} tokens, longer than "
                    f"data.max_seq_length={max_length}; raise --max-seq-length, shorten "
                    "the example, or set --data.truncate true to cut it"
                )
            check_example(where, len(ids), offset, max_seq_length)
        except EmptyExample as empty:
            if not skip_empty:
                raise
            skipped.append((lineno, empty.why))
            continue
        arrays.append(np.asarray(ids, dtype=np.int32))
        offsets.append(offset)
        system_prompts.add(_system_prompt(row, fmt, features))
        if fmt == CHAT and not has_reply(row[features.chat_feature]):
            no_reply.append(lineno)
    if fmt is None:
        fix = "add one JSON object per line or remove the file" if source.unit == "line" else "choose another split"
        raise EmptySplit(f"{source.label}: {source.container} is empty", fix)
    if skipped and not arrays:
        line, why = skipped[0]
        raise ValueError(
            f"{source.label}: all {len(skipped)} examples have nothing to learn ({source.unit} {line}: {why}); "
            "data.skip_empty leaves none, so fix the data"
        )
    shared = next(iter(system_prompts)) if len(system_prompts) == 1 else None
    return TokenizedDataset.from_examples(
        name, zip(arrays, offsets), path=path, format=fmt, skipped=skipped, system_prompt=shared, no_reply=no_reply
    )


def _system_prompt(row: Dict[str, Any], fmt: str, features: Features) -> Optional[str]:
    """The text of a chat row's opening system message, or None."""
    messages = row.get(features.chat_feature) if fmt == CHAT else None
    first = messages[0] if messages else None
    if isinstance(first, dict) and first.get("role") == "system" and isinstance(first.get("content"), str):
        return first["content"]
    return None
