"""`--data org/name` reads a hub dataset through the datasets library, here offline from a temporary HF cache
(HF_DATASETS_OFFLINE=1: no network at test time); an id that is in no cache is one line and exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support import ARITH_DATA, ROOT

pytest.importorskip("datasets")

# Puts arithmetic rows in the HF datasets cache as `load_dataset("someorg/arith")` would have left them:
# built by the library's own parquet builder, then filed under the id's cache folder.
PLACE = """
import glob, json, os, shutil, sys
import datasets, pyarrow as pa, pyarrow.parquet as pq
arith, tmp = sys.argv[1], sys.argv[2]
files = {}
for split, name, n in (("train", "train", 16), ("valid", "validation", 4)):
    rows = [json.loads(l) for l in open(os.path.join(arith, split + ".jsonl")).read().splitlines()[:n]]
    files[name] = os.path.join(tmp, name + ".parquet")
    pq.write_table(pa.table({k: [r[k] for r in rows] for k in rows[0]}), files[name])
datasets.load_dataset("parquet", data_files=files, cache_dir=os.path.join(tmp, "build"))
built = [p for p in glob.glob(os.path.join(tmp, "build", "parquet", "*", "*", "*")) if os.path.isdir(p)][0]
into = os.path.join(datasets.config.HF_DATASETS_CACHE, "someorg___arith", "default", "0.0.0", "cached")
shutil.copytree(built, into)
for f in os.listdir(into):
    if f.startswith("parquet-"):
        os.rename(os.path.join(into, f), os.path.join(into, "arith-" + f[len("parquet-"):]))
"""


def test_hub_id_trains_offline_from_the_cache(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HOME=str(tmp_path / "hf"), HF_DATASETS_OFFLINE="1",
               HF_HUB_OFFLINE="1")
    subprocess.run([sys.executable, "-c", PLACE, str(ARITH_DATA), str(tmp_path)], env=env, check=True,
                   capture_output=True, timeout=120)
    cmd = [sys.executable, "-m", "meshtune.cli", "train", "--iters", "2", "--batch-size", "4",
           "--train.val_batches", "1", "--steps-per-eval", "2", "--mask-prompt"]
    proc = subprocess.run([*cmd, "--data", "someorg/arith", "--adapter-path", str(tmp_path / "run")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {(r["type"], r["step"]) for r in rows} >= {("train", 2), ("val", 2)}
    assert json.loads((tmp_path / "run" / "adapter_config.json").read_text())["data"] == "someorg/arith"

    proc = subprocess.run([*cmd, "--data", "someorg/not-cached", "--adapter-path", str(tmp_path / "no")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("meshtune: error: data.path=someorg/not-cached: no such folder, and no hub dataset "
                               "of that id could be loaded ("), proc.stderr
