"""`meshtune bench badinput`: a corpus of bad inputs, each of which must fail cleanly.

Each case writes its inputs beside a copy of a finished run, runs the CLI and checks RULE: exit 2,
one error line naming the file or option, the copy untouched. HELP, the command's --help, spells
the rule out; docs/reliability.md ("Bad input") says what a user sees.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..run_dir import ADAPTER_FILE, CHECKPOINTS, CONFIG_FILE, METRICS_FILE, RunDir
from .flags import BenchParser

HELP = """`meshtune bench badinput`: a corpus of bad inputs, each of which must fail cleanly.

Every case writes a few files into its own temporary folder (data, a YAML config, a
broken model folder...), next to a copy of a finished earlier run (`run/`: adapters,
a checkpoint, metrics), then runs the CLI. A clean failure is the rule `RULE`: exit
code 2; no Python traceback; the last non-empty stderr line starts with
"meshtune: error: " and no earlier stderr line mentions "error" (log lines before it
are fine); that line holds the case's fragment (the file and line, or the option);
and every file of `run/` has the bytes and mtime it had before. Most cases call the
CLI's `main` in this process (fast); those marked `subprocess` run the real command.

Long examples are truncated with one warning by default (mlx-lm's policy); the corpus
counts only the option-controlled error (`--data.truncate false`). An example with nothing
to learn (empty completion, text or answer, a completion cut off by max_seq_length) is an
error unless `--data.skip_empty true`; an unknown chat role is an error either way.
"""

ASSETS = Path(__file__).resolve().parents[1] / "assets"
TINY = ASSETS / "tiny-llama"
DATA = ASSETS / "data" / "arithmetic"
PREFIX = "meshtune: error: "
RULE = ("exit 2; no Traceback; last stderr line starts with 'meshtune: error: ' and holds the fragment; "
        "no earlier stderr line mentions 'error'; run/ unchanged (bytes and mtimes)")
BASE = ("--iters", "2", "--batch-size", "4", "--steps-per-eval", "100", "--train.val_batches", "1",
        "--save-every", "2")
GOOD = '{"prompt": "What is 1 + 2?", "completion": "3"}\n'
CHAT = '{"messages": [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "3"}]}\n'
WORDY = '{"prompt": "What is %s?", "completion": "40"}\n' % " + ".join(["1"] * 40)  # 169 prompt tokens
NOTHING = ", so the example has nothing to learn; "  # every such error, then its fix and --data.skip_empty


@dataclass(frozen=True)
class Case:
    """One bad input: files to write (relative to the case folder), CLI args, expected fragment.

    `{tmp}` in args, files' text and `expect` is the case folder; `{shared}` (in args and `expect`) the data
    folder the earlier run was trained on (a resume must name it to match). Train cases get BASE
    plus `--data {tmp}/data --adapter-path {tmp}/run` (and `--output.overwrite true`
    unless `overwrite` is false or --resume is given), so each one aims at the earlier run.
    """

    name: str
    args: tuple[str, ...]
    expect: str
    files: dict[str, str | bytes] = field(default_factory=dict)
    setup: Callable[[Path], None] | None = None
    train: bool = True
    overwrite: bool = True
    subprocess: bool = False

    def argv(self, tmp: Path) -> list[str]:
        args = list(self.args)
        if self.train:
            extra = ["--output.overwrite", "true"] if self.overwrite and "--resume" not in args else []
            args = ["train", *BASE, "--data", "{tmp}/data", "--adapter-path", "{tmp}/run", *extra, *args]
        shared = tmp.parent / "template" / "data"
        return [a.replace("{tmp}", str(tmp)).replace("{shared}", str(shared)) for a in args]


def _model_without(*patterns: str) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        shutil.copytree(TINY, tmp / "model")
        for pattern in patterns:
            for f in (tmp / "model").glob(pattern):
                f.unlink()
    return setup


def _quantized_model(tmp: Path) -> None:
    """The tiny model quantized to 4 bits, as mlx_lm.convert -q writes it."""
    from mlx_lm import convert

    with redirect_stdout(sys.stderr):  # convert's progress lines are not the bench's output
        convert(str(TINY), mlx_path=str(tmp / "q4"), quantize=True, q_group_size=32, q_bits=4)


def _adapters_of_another_model(tmp: Path) -> None:
    """A copy of the earlier run's adapters with every tensor twice as wide (another hidden size)."""
    import mlx.core as mx

    other = RunDir(tmp / "other")
    shutil.copytree(tmp / "run", other.path, ignore=shutil.ignore_patterns(CHECKPOINTS))
    weights = mx.load(str(other.adapters))
    mx.save_safetensors(str(other.adapters),
                        {k: mx.concatenate([v, v], axis=-1) for k, v in weights.items()})


def _corrupt_checkpoint(tmp: Path) -> None:
    for f in (c.adapters for c in RunDir(tmp / "run").numbered() if c.adapters.exists()):
        f.write_bytes(f.read_bytes()[:-1] + b"\x00")


def _dangling_link(tmp: Path) -> None:
    (tmp / "link").symlink_to(tmp / "gone")


def _held_by_another_run() -> Callable[[Path], None]:
    """A setup that takes run/'s lock (runtime/run_lock.py) and keeps it for as long as this process lives,
    as another run would hold it: the case's run, in this process or a child, must find it held."""
    held = []

    def setup(tmp: Path) -> None:
        from ..runtime.run_lock import lock_folder

        held.append(lock_folder(tmp / "run", say=lambda line: None))
    return setup


def _data_changed_since(tmp: Path) -> None:
    """The checkpoint's cursor records a digest of other data (as if train.jsonl had been edited since)."""
    for manifest in (c.manifest for c in RunDir(tmp / "run").numbered() if c.manifest.exists()):
        state = json.loads(manifest.read_text())
        state["data_cursor"]["digest"] = "0" * 32
        manifest.write_text(json.dumps(state, indent=2))


NOT_FINITE = "expected a finite number (nan and inf are never a setting)"
TRAIN = "data/train.jsonl"
CASES: list[Case] = [
    Case("malformed_json", (), "data/train.jsonl:2: invalid JSON",
         {TRAIN: GOOD + '{"prompt": "x", "completion": "y",}\n'}, subprocess=True),
    Case("not_an_object", (), "data/train.jsonl:2: expected a JSON object", {TRAIN: GOOD + "[1, 2]\n"}),
    Case("mixed_formats", (), "data/train.jsonl:2: expected keys 'prompt' and 'completion' like line 1",
         {TRAIN: GOOD + '{"text": "1 + 2 = 3"}\n'}),
    Case("missing_field", (), "data/train.jsonl:3: expected keys 'prompt' and 'completion'",
         {TRAIN: GOOD * 2 + '{"prompt": "What is 2 + 2?"}\n'}),
    Case("unknown_format", (), "data/train.jsonl:1: unrecognised format", {TRAIN: '{"question": "q"}\n'}),
    Case("wrong_field_type", (), "data/train.jsonl:2: 'completion' must be a string",
         {TRAIN: GOOD + '{"prompt": "What is 1 + 1?", "completion": 2}\n'}),
    Case("empty_file", (), "data/train.jsonl: file is empty", {TRAIN: ""}),
    Case("blank_lines_only", (), "data/valid.jsonl: file is empty; add one JSON object per line, or turn off "
         "validation with --val-batches 0", {"data/valid.jsonl": "\n  \n"}),
    Case("non_utf8", (), "data/train.jsonl:2: not UTF-8 text",
         {TRAIN: GOOD.encode() + b'{"prompt": "caf\xe9", "completion": "1"}\n'}),
    Case("empty_completion", (), "data/train.jsonl:2: 'completion' is empty" + NOTHING + "fill it in or remove "
         "the line, or set --data.skip_empty true to skip such rows",
         {TRAIN: GOOD + '{"prompt": "What is 1 + 2?", "completion": ""}\n'}),
    Case("empty_completion_in_valid", (), "data/valid.jsonl:3: 'completion' is empty" + NOTHING,
         {"data/valid.jsonl": GOOD * 2 + '{"prompt": "What is 1 + 2?", "completion": " "}\n'}),
    Case("empty_text", ("--data.mask_prompt", "false"), "data/train.jsonl:2: 'text' is empty" + NOTHING,
         {TRAIN: '{"text": "1 + 2 = 3"}\n{"text": ""}\n'}),
    Case("empty_chat_answer", (), "data/train.jsonl:2: the last message of 'messages' (assistant) is empty" + NOTHING,
         {TRAIN: CHAT + CHAT.replace('"3"', '""')}),
    Case("unknown_role", (), "data/train.jsonl:2: message 0 of 'messages' has role 'wizard', which this "
         "tokenizer's chat template drops or rejects; use one of system, user, assistant, tool",
         {TRAIN: CHAT + '{"messages": [{"role": "wizard", "content": "hi"}]}\n'}, subprocess=True),
    Case("unknown_role_with_skip_empty", ("--data.skip_empty", "true"),
         "data/train.jsonl:3: message 1 of 'messages' has role 'gpt'",
         {TRAIN: CHAT * 2 + CHAT.replace('"assistant"', '"gpt"')}),
    Case("completion_cut_off", ("--mask-prompt", "--max-seq-length", "64"),
         "data/train.jsonl:2: its completion starts at token 169 of 172 but --max-seq-length 64 (data.max_seq_length) "
         "cuts it off there" + NOTHING + "raise it with --max-seq-length 172", {TRAIN: GOOD + WORDY}),
    Case("skip_empty_leaves_nothing", ("--data.skip_empty", "true"),
         "data/train.jsonl: all 2 examples have nothing to learn (line 1: 'completion' is empty)",
         {TRAIN: '{"prompt": "What is 1 + 2?", "completion": ""}\n' * 2}),
    Case("empty_chat", (), "data/train.jsonl:1: 'messages' must be a non-empty list",
         {TRAIN: '{"messages": []}\n'}),
    Case("too_long_strict", ("--data.max_seq_length", "8", "--data.truncate", "false"),
         "data/train.jsonl:1: example is", {TRAIN: GOOD * 8}),
    Case("valid_smaller_than_a_batch", (), "valid ({tmp}/data/valid.jsonl): has 2 examples, fewer than "
         "batch_size=4; add examples, give --batch-size 2 (or less), or turn off validation with --val-batches 0",
         {"data/valid.jsonl": GOOD * 2}),
    Case("missing_valid_split", (), "data/valid.jsonl: not found", setup=lambda t: (t / "data/valid.jsonl").unlink()),
    Case("no_data_dir", ("--data", "{tmp}/nowhere"), "data.path={tmp}/nowhere"),
    Case("yaml_unknown_key", ("-c", "{tmp}/run.yaml"), "run.yaml:3: unknown key 'train.iter'; did you mean 'train.iters'",
         {"run.yaml": "# a run\ntrain:\n  iter: 5\n"}, subprocess=True),
    Case("cli_mistyped_option", ("--train.learning_rate", "1e-4"), "--optimizer.learning_rate"),
    Case("yaml_wrong_type", ("-c", "{tmp}/run.yaml"), "run.yaml:2: train.seed = 'four' (str): expected int",
         {"run.yaml": "train:\n  seed: four\n"}),
    Case("cli_wrong_type", ("--iters", "2.5"), "train.iters = 2.5 (float): expected int"),
    Case("bad_choice", ("--fine-tune-type", "lorra"), "did you mean 'lora'"),
    Case("yaml_syntax", ("-c", "{tmp}/run.yaml"), "run.yaml:3: YAML syntax error",
         {"run.yaml": "train:\n  iters: [1, 2\n  batch_size: 4\n"}, subprocess=True),
    Case("config_missing", ("-c", "{tmp}/nope.yaml"), "nope.yaml: cannot read the config file"),
    Case("config_empty", ("-c", "{tmp}/run.yaml"), "run.yaml: the config file is empty (no settings)",
         {"run.yaml": "# settings to come\n"}),
    Case("nan_weight_decay", ("--optimizer", "adamw", "--optimizer.weight_decay", ".nan"),
         "optimizer.weight_decay = nan (float): " + NOT_FINITE),
    Case("nan_warmup_init", ("--schedule.warmup", "1", "--schedule.warmup_init", ".nan"),
         "schedule.warmup_init = nan (float): " + NOT_FINITE),
    Case("nan_max_grad_norm", ("--train.max_grad_norm", ".nan"), "train.max_grad_norm = nan (float): " + NOT_FINITE),
    Case("nan_adapter_scale", ("--adapter.scale", ".nan"), "adapter.scale = nan (float): " + NOT_FINITE,
         subprocess=True),
    Case("inf_learning_rate", ("--learning-rate", ".inf"), "optimizer.learning_rate = inf (float): " + NOT_FINITE),
    Case("lr_past_float32", ("--learning-rate", "1e39"), "optimizer.learning_rate = 1e+39 (float): is inf in float32"),
    Case("nan_optimizer_option", ("--optimizer", "sgd", "--optimizer.options", "{momentum: .nan}"),
         "optimizer.options.momentum = nan: " + NOT_FINITE),
    Case("negative_lr", ("--learning-rate", "-1e-4"), "optimizer.learning_rate = -0.0001"),
    Case("zero_lr", ("--learning-rate", "0"), "optimizer.learning_rate = 0.0"),
    Case("two_problems", ("--iters", "0", "--learning-rate", "-1"),
         "2 configuration problems: command line: train.iters = 0"),
    Case("zero_steps", ("--iters", "0"), "train.iters = 0"),
    Case("negative_steps", ("--iters", "-3"), "train.iters = -3"),
    Case("batch_not_divisible_by_ranks", ("launch", "-n", "2", "--", "meshtune", "train", *BASE[:2],
                                          "--batch-size", "3", "--adapter-path", "{tmp}/run"),
         "train.batch_size = 3: must be divisible by the 2 data-parallel ranks", train=False, subprocess=True),
    Case("more_stages_than_layers", ("launch", "-n", "8", "--", "meshtune", "train", *BASE[:2],
                                     "--batch-size", "8", "--parallel.pp", "8", "--adapter-path", "{tmp}/run"),
         "parallel.pp=8 stages for a model of 4 blocks", train=False),
    Case("launch_command_missing", ("launch", "-n", "2", "--", "meshtun", "train"),
         "command 'meshtun' not found", train=False),
    Case("model_without_weights", ("--model", "{tmp}/model"), "model.path={tmp}/model: no weights",
         setup=_model_without("*.safetensors"), subprocess=True),
    Case("model_without_tokenizer", ("--model", "{tmp}/model"), "model.path={tmp}/model: no tokenizer",
         setup=_model_without("tokenizer*", "special_tokens_map.json")),
    Case("model_missing", ("--model", "{tmp}/no-model"), "model.path={tmp}/no-model"),
    Case("model_dot_path_missing", ("--model", "./no-such-model-folder"),
         "no-such-model-folder: no mlx-lm model folder there"),  # a folder by its "./", never a hub id
    Case("data_dot_path_missing", ("--data", "./no-such-data-folder"), "no-such-data-folder: no such folder"),
    Case("full_on_quantized", ("--model", "{tmp}/q4", "--fine-tune-type", "full"),
         "adapter.fine_tune_type=full: layer model.layers.0.mlp.down_proj of {tmp}/q4 is quantized", setup=_quantized_model),
    Case("dora_on_norm", ("--fine-tune-type", "dora", "--adapter.keys", "[input_layernorm]"),
         "cannot put dora on a RMSNorm; adapter.keys"),
    Case("adapter_key_unknown", ("--adapter.keys", "[self_attn.qq_proj]"), "adapter.keys: 'self_attn.qq_proj'"),
    Case("fuse_over_files", ("fuse", "--adapter-path", "{tmp}/run", "--save-path", "{tmp}/run"),
         "--save-path {tmp}/run is a folder that already holds files; pass --overwrite", train=False),
    Case("fuse_model_missing", ("fuse", "--model", "{tmp}/no-model", "--adapter-path", "{tmp}/run", "--save-path",
                                "{tmp}/fused"), "model.path={tmp}/no-model: no mlx-lm model folder there", train=False),
    Case("resume_mismatch", ("--resume", "--adapter.rank", "4", "--data", "{shared}"),
         "--resume: adapter.rank = 4 differs from the checkpoint's 8"),
    Case("resume_corrupt", ("--resume", "--data", "{shared}"), "--resume: no intact checkpoint",
         setup=_corrupt_checkpoint),
    Case("resume_nothing", ("--resume", "--adapter-path", "{tmp}/fresh"), "--resume: no checkpoint"),
    Case("init_from_other_blocks", ("--num-layers", "2", "--adapter.init_from", "{tmp}/run"),
         "those adapters cover the last 4 of 4 blocks, this run 2"),
    Case("eval_without_a_run", ("eval", "--adapter-path", "{tmp}/nothing"), f"no {CONFIG_FILE} there",
         train=False),
    Case("existing_run", (), "output.adapter_path={tmp}/run already holds a run", overwrite=False),
    Case("earlier_run_without_a_save", ("--adapter-path", "{tmp}/died"),
         f"output.adapter_path={{tmp}}/died already holds a run ({METRICS_FILE})",
         {f"died/{METRICS_FILE}": '{"type": "start", "step": 0, "time": 0}\n'}, overwrite=False),
    Case("folder_in_use", (), "output.adapter_path={tmp}/run is in use by another run (pid ",
         setup=_held_by_another_run(), subprocess=True),
    Case("dangling_adapter_path", ("--adapter-path", "{tmp}/link"),
         "output.adapter_path={tmp}/link is a symbolic link to {tmp}/gone, which does not exist",
         setup=_dangling_link),
    Case("resume_on_changed_data", ("--resume", "--iters", "4", "--data", "{shared}"),
         "--resume: the train data ({shared}/train.jsonl) is not the data the checkpoint was trained on",
         setup=_data_changed_since),
    Case("output_under_a_file", ("--adapter-path", f"{{tmp}}/run/{CONFIG_FILE}/x"), "is a file, not a folder"),
    Case("adapters_of_another_model", ("generate", "--model", str(TINY), "--adapter-path", "{tmp}/other",
                                       "--prompt", "hi"), f"other/{ADAPTER_FILE} does not match the model",
         setup=_adapters_of_another_model, train=False),
]


@dataclass
class Result:
    name: str
    code: int | None
    clean: bool
    seconds: float
    problems: list[str]
    last: str


def _snapshot(folder: Path) -> dict[str, tuple[int, str]]:
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _in_process(argv: list[str]) -> tuple[int | None, str]:
    from ..cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(argv if argv[0] == "launch" else ["--no-system-blas", *argv])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except Exception:  # what the interpreter would print for an uncaught error
            traceback.print_exc(file=err)
            code = 1
        finally:
            from ..runtime.fastmath import uninstall_fast_swiglu
            from ..training.attention import uninstall_chunked_attention

            uninstall_fast_swiglu()  # a run patches mlx-lm's modules; leave this process as found
            uninstall_chunked_attention()
    return code, err.getvalue()


def _subprocess(argv: list[str]) -> tuple[int | None, str]:
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "meshtune.cli", *argv], env=env, capture_output=True,
                          text=True, timeout=300)
    return proc.returncode, proc.stderr


def judge(code: int | None, stderr: str, expect: str, before: dict, after: dict) -> list[str]:
    """What breaks RULE ([] for a clean failure)."""
    problems = []
    lines = [l for l in stderr.splitlines() if l.strip()]
    last = lines[-1] if lines else ""
    if code != 2:
        problems.append(f"exit code {code}, not 2")
    if "Traceback" in stderr:
        problems.append("a traceback on stderr")
    if not last.startswith(PREFIX):
        problems.append(f"last stderr line does not start with {PREFIX!r}: {last[:200]!r}")
    elif expect not in last:
        problems.append(f"error line lacks {expect!r}: {last[:300]!r}")
    noisy = [l for l in lines[:-1] if "error" in l.lower()]
    if noisy:
        problems.append(f"{len(noisy)} more stderr lines mention an error, first: {noisy[0][:200]!r}")
    if before != after:
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        problems.append(f"output folder changed: {', '.join(changed[:5])}")
    return problems


def make_template(root: Path) -> Path:
    """Small data and a finished earlier run (adapters, checkpoint 2, metrics) to copy into cases."""
    data = root / "template" / "data"
    data.mkdir(parents=True)
    for split, n in (("train", 32), ("valid", 8)):
        lines = (DATA / f"{split}.jsonl").read_text().splitlines()[:n]
        (data / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    run = root / "template" / "run"
    code, err = _in_process(["train", *BASE, "--data", str(data), "--adapter-path", str(run)])
    if code != 0:
        raise RuntimeError(f"the earlier run for the corpus failed ({code}): {err[-2000:]}")
    return root / "template"


def run_case(case: Case, root: Path, template: Path, *, force_subprocess: bool = False) -> Result:
    """Set the case up in root/<name>, run it, judge it."""
    tmp = root / case.name
    shutil.copytree(template, tmp)  # template = root/"template", whose data/ is {shared}
    for rel, content in case.files.items():
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content.replace("{tmp}", str(tmp)))
    if case.setup is not None:
        case.setup(tmp)
    before = _snapshot(tmp / "run")
    tic = time.perf_counter()
    code, stderr = (_subprocess if case.subprocess or force_subprocess else _in_process)(case.argv(tmp))
    seconds = time.perf_counter() - tic
    expect = case.expect.replace("{tmp}", str(tmp)).replace("{shared}", str(template / "data"))
    problems = judge(code, stderr, expect, before, _snapshot(tmp / "run"))
    lines = [l for l in stderr.splitlines() if l.strip()]
    return Result(case.name, code, not problems, seconds, problems, lines[-1] if lines else "")


def run_all(cases: list[Case] = CASES, *, force_subprocess: bool = False) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="meshtune-badinput-") as tmp:
        template = make_template(Path(tmp))
        return [run_case(c, Path(tmp), template, force_subprocess=force_subprocess) for c in cases]


def table(results: list[Result]) -> str:
    width = max(len(r.name) for r in results)
    rows = [f"{'case':<{width}} | exit | clean | seconds", f"{'-' * width}-|------|-------|--------"]
    rows += [f"{r.name:<{width}} | {str(r.code):>4} | {'yes' if r.clean else 'NO':>5} | {r.seconds:7.2f}"
             for r in results]
    for r in results:
        rows += [f"  {r.name}: {p}" for p in r.problems]
    rows.append(f"cases tried {len(results)}, clean errors {sum(r.clean for r in results)}")
    return "\n".join(rows)


def main(args: list[str]) -> int:
    p = BenchParser(prog="meshtune bench badinput", description=HELP)
    p.add_argument("--case", action="append", help="Run only this case (repeatable).")
    p.add_argument("--subprocess", action="store_true", help="Run every case as a real subprocess.")
    p.add_argument("--json", action="store_true", help="Print one JSON object last (every case's result).")
    a = p.parse_args(args)
    known = {c.name: c for c in CASES}
    unknown = [n for n in a.case or [] if n not in known]
    if unknown:
        raise ValueError(f"--case {unknown[0]}: no such case; cases are {', '.join(known)}")
    results = run_all([known[n] for n in a.case] if a.case else CASES, force_subprocess=a.subprocess)
    from .fit import Load, embedded_line

    print(embedded_line(2, 32, Load()))
    print(f"rule: {RULE}")
    print(table(results))
    if a.json:
        clean = sum(r.clean for r in results)
        print(json.dumps({"cases": [r.__dict__ for r in results], "cases_tried": len(results), "clean_errors": clean,
                          "ok": clean == len(results)}))
    return 0 if all(r.clean for r in results) else 1
