"""--data beyond jsonl folders (meshtune/data/sources.py, hf.py): save_to_disk folders, parquet files, hub ids.

Every source gives the same tokens as the jsonl folder of the same rows, is checked row by row with
errors naming `<path or id>[split] row N`, and is cached on its content.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from meshtune.data import check_source, formats, load_datasets
from meshtune.run_data import TRAINING_WAYS_OUT

pytest.importorskip("tokenizers")
datasets = pytest.importorskip("datasets")
pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")
from test_data import completion_rows, make_tokenizer, write_jsonl  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def _columns(rows):
    return {k: [r[k] for r in rows] for k in rows[0]}


def _rows(n: int, seed: int) -> list[dict]:
    return [{"prompt": r["prompt"], "completion": r["completion"]} for r in completion_rows(n, seed=seed)]


TRAIN, VALID, TEST = _rows(6, 0), _rows(3, 1), _rows(2, 2)


def _same(a, b) -> None:
    assert a.name == b.name and a.format == b.format
    assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.lengths, b.lengths)
    assert np.array_equal(a.offsets, b.offsets)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tok):
    folder = tmp_path_factory.mktemp("jsonl")
    for name, rows in (("train", TRAIN), ("valid", VALID), ("test", TEST)):
        write_jsonl(folder, name, rows)
    return load_datasets(folder, tok, mask_prompt=True, need_test=True)


def test_saved_dataset_dict_equals_jsonl(tmp_path, tok, reference):
    # validation is the hub's name for valid; both are accepted.
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict(_columns(TRAIN)),
                               "validation": datasets.Dataset.from_dict(_columns(VALID)),
                               "test": datasets.Dataset.from_dict(_columns(TEST))})
    dd.save_to_disk(str(tmp_path / "saved"))
    got = load_datasets(tmp_path / "saved", tok, mask_prompt=True, need_test=True)
    for a, b in zip(got, reference):
        _same(a, b)


@pytest.mark.parametrize("layout", ["flat", "hub"])
def test_parquet_folders_equal_jsonl(tmp_path, tok, reference, layout):
    for name, rows in (("train", TRAIN), ("valid", VALID), ("test", TEST)):
        if layout == "flat":
            path = tmp_path / f"{name}.parquet"
        else:  # the hub's layout, train split in two shards
            (tmp_path / "data").mkdir(exist_ok=True)
            path = tmp_path / "data" / f"{name}-00000-of-00001.parquet"
        if layout == "hub" and name == "train":
            pq.write_table(pa.table(_columns(rows[:4])), tmp_path / "data" / "train-00000-of-00002.parquet")
            pq.write_table(pa.table(_columns(rows[4:])), tmp_path / "data" / "train-00001-of-00002.parquet")
            continue
        pq.write_table(pa.table(_columns(rows)), path)
    got = load_datasets(tmp_path, tok, mask_prompt=True, need_test=True)
    for a, b in zip(got, reference):
        _same(a, b)


NAMED = ("{% for m in messages %}<|{{ m['role'] }}|>{% if 'name' in m %}[{{ m.name }}]{% endif %}"
         "{{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_chat_rows_read_as_their_jsonl_lines(tmp_path):
    # Arrow gives the user message the assistant's extra key, as None; the template sees the rows as written.
    tok = make_tokenizer(NAMED)
    chats = [{"messages": [{"role": "user", "content": f"q{i}"},
                           {"role": "assistant", "content": f"a{i}", "name": "bot"}]} for i in range(3)]
    write_jsonl(tmp_path, "train", chats)
    want = load_datasets(tmp_path, tok, mask_prompt=True, need_valid=False).train
    datasets.Dataset.from_list(chats).save_to_disk(str(tmp_path / "saved"))
    got = load_datasets(tmp_path / "saved", tok, mask_prompt=True, need_valid=False).train
    assert got.format == "chat"
    assert np.array_equal(got.tokens, want.tokens) and np.array_equal(got.offsets, want.offsets)


def test_single_dataset_is_train_and_splits_slice(tmp_path, tok, reference):
    datasets.Dataset.from_dict(_columns(TRAIN + VALID)).save_to_disk(str(tmp_path / "one"))
    with pytest.raises(ValueError, match=r"one: no valid or validation split \(it has train\); choose one "
                                         r"with --data.valid_split NAME .* turn off validation with --val-batches 0"):
        load_datasets(tmp_path / "one", tok, mask_prompt=True, ways_out=TRAINING_WAYS_OUT)
    with pytest.raises(ValueError, match=r"\(slices like train\[-10%:\] work\)$"):  # a caller with no way out
        load_datasets(tmp_path / "one", tok, mask_prompt=True)
    got = load_datasets(tmp_path / "one", tok, mask_prompt=True,
                        splits={"train": "train[:6]", "valid": "train[-3:]"})
    _same(got.train, reference.train)
    _same(got.valid, reference.valid)
    with pytest.raises(ValueError, match=r"data.valid_split='train\[x': .*--data.valid_split"):
        load_datasets(tmp_path / "one", tok, splits={"valid": "train[x"})


def test_rows_are_checked_with_their_place(tmp_path, tok):
    rows = [*TRAIN]
    rows[2] = {"prompt": "What is 1 + 1?", "completion": ""}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(_columns(rows)),
                          "valid": datasets.Dataset.from_dict(_columns(VALID))}).save_to_disk(str(tmp_path / "d"))
    with pytest.raises(ValueError, match=r"d\[train\] row 2: 'completion' is empty, so the example has nothing "
                                         r"to learn; .* --data.skip_empty true"):
        load_datasets(tmp_path / "d", tok)
    seen: list[str] = []
    data = load_datasets(tmp_path / "d", tok, skip_empty=True, warn=seen.append)
    assert len(data.train) == 5 and data.train.skipped[0][0] == 2
    assert len(seen) == 1 and "d[train] row 2 ('completion' is empty)" in seen[0]
    pq.write_table(pa.table({"text": ["a b"]}), tmp_path / "train.parquet")
    with pytest.raises(ValueError, match=r"\[train\] row 0: mask_prompt needs .* this split is text.*"
                                         r"--data.mask_prompt false"):
        load_datasets(tmp_path, tok, mask_prompt=True, need_valid=False)


def test_token_cache_keys_on_the_rows(tmp_path, tok, monkeypatch):
    calls = []
    real = formats.tokenize_row
    monkeypatch.setattr(formats, "tokenize_row", lambda *a, **k: calls.append(1) or real(*a, **k))
    folder = tmp_path / "p"
    folder.mkdir()
    pq.write_table(pa.table(_columns(TRAIN)), folder / "train.parquet")
    first = load_datasets(folder, tok, need_valid=False).train
    assert len(calls) == 6
    again = load_datasets(folder, tok, need_valid=False).train  # same rows: read back
    assert len(calls) == 6
    _same(first, again)
    changed = [dict(r) for r in TRAIN]
    changed[5]["completion"] = "999"
    pq.write_table(pa.table(_columns(changed)), folder / "train.parquet")
    other = load_datasets(folder, tok, need_valid=False).train  # other rows: tokenized again
    assert len(calls) == 12 and not np.array_equal(other.tokens, first.tokens)
    sliced = load_datasets(folder, tok, need_valid=False, splits={"train": "train[:3]"}).train
    assert len(calls) == 15 and len(sliced) == 3  # a slice is its own entry


def test_sources_and_their_errors(tmp_path, tok, monkeypatch):
    check_source("someorg/some-set")  # a hub id: checked when loaded
    check_source(str(tmp_path))
    for bad in (str(tmp_path / "missing"), "./org/name"):
        with pytest.raises(ValueError, match=r"no such folder; point --data at a folder holding train.jsonl and "
                                             r"valid.jsonl \(or train/valid .parquet files, or a dataset saved "
                                             r"with save_to_disk\), a .parquet file, or a hub dataset id like "
                                             r"org/name"):
            check_source(bad)
    write_jsonl(tmp_path, "train", TRAIN)
    with pytest.raises(ValueError, match=r"data.train_split='train\[:2\]' applies to Hugging Face datasets"):
        load_datasets(tmp_path, tok, need_valid=False, splits={"train": "train[:2]"})
    with pytest.raises(ValueError, match=r"valid.jsonl: not found; .*--val-batches 0"):  # as training asks
        load_datasets(tmp_path, tok, ways_out=TRAINING_WAYS_OUT)
    # Without the optional library: one line naming the extra.
    pq.write_table(pa.table(_columns(TRAIN)), tmp_path / "train.parquet")
    (tmp_path / "train.jsonl").unlink()
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ValueError, match=r"needs the datasets library; pip install 'meshtune\[datasets\]'$"):
        load_datasets(tmp_path, tok, need_valid=False)


def test_one_parquet_file_is_the_train_split_and_an_unnamed_one_is_named(tmp_path, tok, reference):
    one = tmp_path / "mydata.parquet"
    pq.write_table(pa.table(_columns(TRAIN + VALID)), one)
    check_source(str(one))
    got = load_datasets(str(one), tok, mask_prompt=True, splits={"train": "train[:6]", "valid": "train[-3:]"})
    _same(got.train, reference.train)
    _same(got.valid, reference.valid)
    # A folder holding only that file: said before any model loads, with both ways out.
    with pytest.raises(ValueError, match=rf"data.path={tmp_path}: mydata.parquet names no split and there is no "
                                         r"train.jsonl; name the files train.parquet .* give one file as --data "
                                         rf"{one} and slice its splits"):
        check_source(str(tmp_path))
