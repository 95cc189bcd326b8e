"""Build meshtune's embedded default model and its fine-tuning data set.

meshtune ships a tiny pretrained causal LM so that its examples, tests and
benchmarks run offline, on a CPU, in seconds, and still show that fine-tuning
does something measurable.  This script creates, deterministically:

* ``<out>/tiny-llama/``: a ~0.8M-parameter Llama (mlx-lm layout: config.json,
  float32 model.safetensors, a character-level tokenizer.json plus
  tokenizer_config.json with a chat template) that ``mlx_lm.load`` opens with
  no network;
* ``<out>/data/arithmetic/{train,valid,test}.jsonl``: a completions-format task
  (two-digit addition, "What is 23 + 45?" -> "68") that the base model cannot
  do and that a short LoRA run learns.

The base model is pretrained here, on CPU, on text the script generates itself
(counting, number words, single-digit sums, two-digit + one-digit sums, place
value, templated sentences, and chat turns about other things), so the repo
ships no third-party text and the base model never sees a two-digit +
two-digit sum (asserted).  The two-digit + one-digit sums give LoRA a units
and carry circuit to adapt; without them LoRA still learns the task, only later.
``make demo`` fine-tunes the result and prints validation loss and greedy exact
match on test.jsonl before and after.

Outputs are bit-identical across runs on one machine; another BLAS or CPU
may change the weights in the last bits.

Usage::

    make tiny-model                       # rebuild meshtune/assets in place
    python tools/make_tiny_model.py [--out-dir meshtune/assets] [--steps 2000] [--docs 60000]

tests/integration/test_tools.py runs it for a few steps into a temporary folder.

On Linux, preloading OpenBLAS (``LD_PRELOAD=.../openblas-pthread/libblas.so.3``)
makes the CPU matmuls much faster; pretraining takes a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import time
from pathlib import Path
from typing import Iterable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm import generate, load
from mlx_lm.models import llama
from mlx_lm.utils import load_tokenizer
from tokenizers import Tokenizer, decoders, models

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT_DIR = REPO_ROOT / "meshtune" / "assets"
SEED = 0

# ----------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------

PAD, BOS, EOS, UNK = "<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>"
SYSTEM, USER, ASSISTANT = "<|system|>", "<|user|>", "<|assistant|>"
# Order fixes the ids: pad is 0 so that mlx-lm's zero padding is the pad token.
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK, SYSTEM, USER, ASSISTANT]
# Every printable ASCII character (and newline) is its own token, so digits
# are always single tokens: that keeps arithmetic learnable by a tiny model.
CHARACTERS = ["\n"] + [chr(c) for c in range(32, 127)]

# Jinja chat template.  Tokens of a prompt rendered with
# add_generation_prompt=True are an exact prefix of the full conversation's
# tokens (mlx-lm's mask_prompt relies on that); `tools` is optional.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if tools -%}"
    "<|system|>You can call these tools: {{ tools | tojson }}{{ '\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "<|system|>{{ message['content'] }}{{ '\\n' }}"
    "{%- elif message['role'] == 'user' -%}"
    "<|user|>{{ message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}"
    "<|assistant|>{{ message['content'] }}{{ eos_token }}"
    "{%- elif message['role'] == 'tool' -%}"
    "<|system|>Tool result: {{ message['content'] }}{{ '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def build_vocab() -> dict[str, int]:
    """Special tokens first, then one token per character."""
    return {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}


def build_tokenizer(vocab: dict[str, int]) -> Tokenizer:
    """A character-level `tokenizers` tokenizer.

    A BPE model with no merges and no pre-tokenizer splits text into single
    characters; Fuse joins them back without the spaces a decoder-less
    tokenizer would insert.  No post-processor: the chat template adds BOS.
    """
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.decoder = decoders.Fuse()
    return tok


def write_tokenizer_files(model_dir: Path, vocab: dict[str, int]) -> None:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    build_tokenizer(vocab).save(str(model_dir / "tokenizer.json"))
    added = {
        str(vocab[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "chat_template": CHAT_TEMPLATE,
        # Not the class registered for model_type llama (LlamaTokenizer forces
        # a SentencePiece layout); this loads tokenizer.json as written.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    _write_json(model_dir / "tokenizer_config.json", config)
    _write_json(
        model_dir / "special_tokens_map.json",
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK},
    )


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


# ----------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------


def model_config(vocab_size: int) -> dict:
    """config.json contents: a 4-layer, 128-wide Llama with GQA and tied embeddings."""
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "intermediate_size": 384,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "vocab_size": vocab_size,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "float32",
    }


# ----------------------------------------------------------------------------
# Pretraining corpus (generated, so the repo ships no third-party text)
# ----------------------------------------------------------------------------

ONES = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen".split()
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()

NAMES = "Ana Ben Cara Dev Eli Fay Gus Hana Ivo Jun Kai Lea Max Noor Omar Pia Raj Sol Tom Uma Vic Wen Yara Zed".split()
ANIMALS = "cat dog bird fish horse cow sheep fox owl bear duck frog goat mouse lion".split()
ADJECTIVES = "big small quick slow happy sleepy red blue green old young brave quiet loud warm".split()
PLACES = "park school market river garden library beach farm city forest kitchen station".split()
THINGS = "apple book ball cup hat key lamp pen shoe box coin leaf stone star boat".split()
VERBS = "sees likes finds holds wants draws carries cleans paints counts".split()
COLORS = {"sky": "blue", "grass": "green", "snow": "white", "coal": "black", "sun": "yellow", "blood": "red"}
FACTS = [
    ("How many legs does a cat have?", "four"),
    ("How many days are in a week?", "seven"),
    ("What do bees make?", "honey"),
    ("What do cows drink?", "water"),
    ("What is the opposite of hot?", "cold"),
    ("What is the opposite of up?", "down"),
    ("What is the opposite of big?", "small"),
    ("Is fire hot or cold?", "hot"),
    ("Is ice hot or cold?", "cold"),
    ("What comes after Monday?", "Tuesday"),
    ("Say hello.", "Hello!"),
    ("Who are you?", "I am a tiny language model."),
]


def number_words(n: int) -> str:
    """English words for 0 <= n <= 999 ("forty-five", "one hundred and two")."""
    if n < 20:
        return ONES[n]
    if n < 100:
        tens, ones = divmod(n, 10)
        return TENS[tens] + ("" if ones == 0 else "-" + ONES[ones])
    hundreds, rest = divmod(n, 100)
    head = ONES[hundreds] + " hundred"
    return head if rest == 0 else head + " and " + number_words(rest)


def _counting_up(rng: random.Random) -> str:
    # Successor is the skill behind carrying into the tens digit.
    start, length = rng.randrange(0, 990), rng.randrange(3, 12)
    return " ".join(str(start + i) for i in range(length))


def _counting_down(rng: random.Random) -> str:
    start, length = rng.randrange(12, 1000), rng.randrange(3, 10)
    return " ".join(str(start - i) for i in range(length))


def _number_name(rng: random.Random) -> str:
    n = rng.randrange(0, 1000)
    return rng.choice([f"{n} is {number_words(n)}.", f"{number_words(n).capitalize()} is written {n}."])


def _neighbour(rng: random.Random) -> str:
    n = rng.randrange(0, 999)
    return rng.choice([f"The number after {n} is {n + 1}.", f"The number before {n + 1} is {n}."])


def _digit_sum(rng: random.Random) -> str:
    # The addition table for single digits, in symbols and in words.
    a, b = rng.randrange(10), rng.randrange(10)
    return rng.choice([f"{a} + {b} = {a + b}", f"{number_words(a)} plus {number_words(b)} is {number_words(a + b)}."])


def _add_one_digit(rng: random.Random) -> str:
    # A two-digit number plus ONE digit (either order): units sums and
    # carrying, but never the task's two-digit + two-digit sums.
    a, b = rng.randrange(10, 100), rng.randrange(1, 10)
    return f"{a} + {b} = {a + b}" if rng.random() < 0.5 else f"{b} + {a} = {a + b}"


def _place_value(rng: random.Random) -> str:
    n = rng.randrange(10, 100)
    return f"In {n}, the tens digit is {n // 10} and the ones digit is {n % 10}."


def _comparison(rng: random.Random) -> str:
    a, b = rng.sample(range(100), 2)
    return f"{max(a, b)} is more than {min(a, b)}."


def _story(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return f"The {rng.choice(ADJECTIVES)} {rng.choice(ANIMALS)} went to the {rng.choice(PLACES)}."
    n = rng.randrange(2, 10)
    return f"{rng.choice(NAMES)} {rng.choice(VERBS)} {number_words(n)} {rng.choice(THINGS)}s."


def _colour(rng: random.Random) -> str:
    thing = rng.choice(list(COLORS))
    return f"The {thing} is {COLORS[thing]}."


def _alphabet(rng: random.Random) -> str:
    start = rng.randrange(0, 20)
    return " ".join("abcdefghijklmnopqrstuvwxyz"[start : start + rng.randrange(3, 7)])


# (weight, generator): weighted towards number skills, which are what the
# fine-tuning task builds on; the English keeps the model a "language" model.
PROSE_KINDS = [
    (2, _counting_up),
    (1, _counting_down),
    (1, _number_name),
    (1, _neighbour),
    (3, _digit_sum),
    (4, _add_one_digit),
    (1, _place_value),
    (1, _comparison),
    (2, _story),
    (0.5, _colour),
    (0.5, _alphabet),
]


def prose_sentence(rng: random.Random) -> str:
    """One generated sentence of a randomly chosen kind."""
    weights, kinds = zip(*PROSE_KINDS)
    return rng.choices(kinds, weights=weights)[0](rng)


def chat_turn(rng: random.Random) -> tuple[str, str]:
    """A (user, assistant) pair about anything except adding two numbers."""
    kind = rng.randrange(9)
    n = rng.randrange(0, 999)
    if kind == 0:
        return f"What comes after {n}?", str(n + 1)
    if kind == 1:
        return f"What comes before {n + 1}?", str(n)
    if kind == 2:
        return f"Write {number_words(n)} as a number.", str(n)
    if kind == 3:
        return f"Spell {n} in words.", number_words(n)
    if kind == 4:
        a, b = rng.sample(range(100), 2)
        return f"Which is larger, {a} or {b}?", str(max(a, b))
    if kind == 5:
        words = " ".join(rng.choice(ANIMALS + THINGS) for _ in range(rng.randrange(1, 4)))
        return f"Repeat after me: {words}", words
    if kind == 6:
        start = rng.randrange(0, 95)
        end = start + rng.randrange(2, 6)
        return f"Count from {start} to {end}.", " ".join(str(i) for i in range(start, end + 1))
    if kind == 7:
        m = rng.randrange(10, 100)
        return f"What is the tens digit of {m}?", str(m // 10)
    if rng.random() < 0.5:
        thing = rng.choice(list(COLORS))
        return f"What color is the {thing}?", COLORS[thing]
    return rng.choice(FACTS)


# A two-digit + two-digit sum: the fine-tuning task, which the base model
# must never see (checked on every generated document).
TASK_PATTERN = re.compile(r"(?<!\d)\d\d \+ \d\d(?!\d)")


def pretraining_token_stream(tokenizer, n_docs: int, rng: random.Random) -> np.ndarray:
    """Generate documents and tokenize them into one stream of token ids.

    Half the documents are chat conversations rendered with the model's own
    chat template (so the base model knows the turn format and to stop with
    EOS), half are a few prose sentences between BOS and EOS.
    """
    ids: list[int] = []
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    for _ in range(n_docs):
        if rng.random() < 0.5:
            messages = []
            for _ in range(1 if rng.random() < 0.8 else 2):
                user, assistant = chat_turn(rng)
                messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
            text = " ".join(m["content"] for m in messages)
            ids += tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        else:
            text = " ".join(prose_sentence(rng) for _ in range(rng.randrange(1, 5)))
            ids += [bos] + tokenizer.encode(text, add_special_tokens=False) + [eos]
        assert not TASK_PATTERN.search(text), f"task leaked into pretraining text: {text!r}"
    return np.array(ids, dtype=np.int32)


# ----------------------------------------------------------------------------
# Pretraining
# ----------------------------------------------------------------------------


def pretrain(
    model: nn.Module,
    stream: np.ndarray,
    steps: int,
    batch_size: int,
    seq_len: int,
    lr: float,
    np_rng: np.random.RandomState,
) -> float:
    """Next-token training on random windows of the stream; returns the final loss."""
    warmup = max(1, steps // 20)
    # Short linear warmup, then cosine decay to 10% of the peak.
    schedule = optim.join_schedules(
        [optim.linear_schedule(1e-5, lr, warmup), optim.cosine_decay(lr, steps - warmup, lr * 0.1)],
        [warmup],
    )
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=0.01)

    def loss_fn(m: nn.Module, x: mx.array, y: mx.array) -> mx.array:
        return nn.losses.cross_entropy(m(x), y, reduction="mean")

    loss_and_grad = nn.value_and_grad(model, loss_fn)

    def step(batch: mx.array) -> mx.array:
        loss, grads = loss_and_grad(model, batch[:, :-1], batch[:, 1:])
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(model, grads)
        return loss

    tic, running = time.perf_counter(), None
    for it in range(1, steps + 1):
        starts = np_rng.randint(0, len(stream) - seq_len - 1, size=batch_size)
        batch = mx.array(np.stack([stream[s : s + seq_len + 1] for s in starts]))
        loss = step(batch)
        mx.eval(loss, model.parameters(), optimizer.state)
        running = loss.item() if running is None else 0.9 * running + 0.1 * loss.item()
        if it % 25 == 0 or it == steps:
            print(f"  step {it:4d}/{steps}  loss {running:.3f}  {time.perf_counter() - tic:6.1f}s", flush=True)
    return float(running)


# ----------------------------------------------------------------------------
# Fine-tuning task: two-digit addition
# ----------------------------------------------------------------------------


def arithmetic_splits(rng: random.Random, n_train: int, n_valid: int, n_test: int) -> dict[str, list[dict]]:
    """Disjoint splits of "What is a + b?" -> "a+b" for 10 <= a, b <= 99."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng.shuffle(pairs)
    chosen = {
        "test": pairs[:n_test],
        "valid": pairs[n_test : n_test + n_valid],
        "train": pairs[n_test + n_valid : n_test + n_valid + n_train],
    }
    return {
        split: [{"prompt": f"What is {a} + {b}?", "completion": str(a + b)} for a, b in rows]
        for split, rows in chosen.items()
    }


def write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def exact_match(model: nn.Module, tokenizer, rows: list[dict], max_tokens: int = 6) -> float:
    """Greedy-decode each completion through the chat template; fraction exactly right."""
    hits = 0
    for row in rows:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True, return_dict=False
        )
        out = generate(model, tokenizer, prompt, max_tokens=max_tokens, verbose=False)
        hits += out.strip() == row["completion"]
    return hits / len(rows)


# ----------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR, help="assets folder to write into")
    # Small batches and many steps learn fastest per CPU-second here; peak lr
    # 1e-3 (2e-3 and up stalls, 5e-4 is slow) with this model and batch size.
    parser.add_argument("--steps", type=int, default=2000, help="pretraining steps")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3, help="peak pretraining learning rate")
    parser.add_argument("--docs", type=int, default=60000, help="generated pretraining documents")
    args = parser.parse_args()

    random.seed(SEED)
    np_rng = np.random.RandomState(SEED)
    mx.random.seed(SEED)

    model_dir = args.out_dir / "tiny-llama"
    data_dir = args.out_dir / "data" / "arithmetic"
    # Start clean so no stale file (e.g. an old shard) survives a rebuild.
    shutil.rmtree(model_dir, ignore_errors=True)
    model_dir.mkdir(parents=True)
    data_dir.mkdir(parents=True, exist_ok=True)

    # 1. Tokenizer files, then load them back the way mlx-lm will, so the
    #    corpus is tokenized by exactly the shipped tokenizer and template.
    vocab = build_vocab()
    write_tokenizer_files(model_dir, vocab)
    config = model_config(len(vocab))
    _write_json(model_dir / "config.json", config)
    tokenizer = load_tokenizer(model_dir)

    # 2. Data set for fine-tuning (its own rng, so corpus changes don't move it).
    splits = arithmetic_splits(random.Random(SEED + 1), n_train=2000, n_valid=200, n_test=100)
    for split, rows in splits.items():
        write_jsonl(data_dir / f"{split}.jsonl", rows)

    # 3. Pretraining corpus and model.
    tic = time.perf_counter()
    stream = pretraining_token_stream(tokenizer, args.docs, random.Random(SEED + 2))
    print(f"corpus: {len(stream):,} tokens ({time.perf_counter() - tic:.1f}s)")

    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"model: {n_params:,} parameters; pretraining {args.steps} steps")
    tic = time.perf_counter()
    final_loss = pretrain(model, stream, args.steps, args.batch_size, args.seq_len, args.lr, np_rng)
    print(f"pretraining done: loss {final_loss:.3f} in {time.perf_counter() - tic:.0f}s")

    # 4. Save float32 weights in the layout mlx_lm.load expects.
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(model_dir / "model.safetensors"), weights, metadata={"format": "mlx"})

    # 5. Sanity checks through the public loader: the base model chats and
    #    cannot yet add two-digit numbers.
    model, tokenizer = load(str(model_dir))
    for question in ["What comes after 41?", "Spell 57 in words.", splits["test"][0]["prompt"]]:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=False
        )
        print(f"  {question!r} -> {generate(model, tokenizer, prompt, max_tokens=24)!r}")
    print(f"base exact match on test: {exact_match(model, tokenizer, splits['test']):.0%}")


if __name__ == "__main__":
    main()
