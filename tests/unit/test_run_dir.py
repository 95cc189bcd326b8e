"""The run folder has one owner: meshtune/run_dir.py spells every name a run writes, and no other module does.

The names are checked as the package's code spells them: every string constant outside a docstring
(f-string parts and format specs included) is searched for them, read from the source with `ast`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from meshtune.run_dir import CheckpointDir, RunDir, is_earlier_run, is_temp, stage_names, temp_path

PACKAGE = Path(__file__).resolve().parents[2] / "meshtune"
OWNER = PACKAGE / "run_dir.py"

# A run folder's names, as a module would spell them to build a path (a substring of any string).
NAMES = ("adapters.safetensors", "adapter_config.json", "metrics.jsonl", "report.md", "loss.png", ".meshtune.lock",
         ".heartbeats", ".earlier-run-", "optimizer.safetensors", "config.yaml", "state.json", "state.stage",
         "base_path.rank", ".tmp-")
# Folder names that are also words: only as a whole string or a path component.
FOLDERS = ("checkpoints",)
# A checkpoint folder's 7-digit step.
STEP_FORMAT = "07d"

# (module, a piece of the string): the same spelling meaning another thing, each with its reason.
ALLOWED = {
    # PEFT's own name for its config, in the folder `meshtune export --format peft` writes.
    ("export/peft.py", "adapter_config.json"),
    ("cli/inference_commands.py", "adapter_config.json + adapter_model.safetensors"),
    # A Hugging Face dataset folder (save_to_disk) holds a state.json of its own.
    ("data/hf.py", "state.json"),
}


def _strings(tree: ast.AST) -> list[ast.Constant]:
    """Every string constant of code, f-string parts and format specs included; docstrings (and other bare
    string statements) are prose, left out."""
    prose = {id(node.value) for node in ast.walk(tree)
             if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
    return [node for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose]


def spelled(source: str) -> list[tuple[int, str, str]]:
    """(line, name, string) for each run-folder name a module's code spells."""
    hits = []
    for node in _strings(ast.parse(source)):
        text = node.value
        names = [name for name in NAMES if name in text]
        names += [name for name in FOLDERS if re.search(rf"(^|/){name}($|/)", text)]
        names += [STEP_FORMAT] if text == STEP_FORMAT else []
        hits += [(node.lineno, name, text) for name in names]
    return hits


def test_the_search_finds_what_a_module_would_spell() -> None:
    source = ('"""Writes adapters.safetensors."""\n'
              'p = out / "checkpoints" / f"{step:07d}"\n'
              'q = out / f".{name}.tmp-{pid}"\n'
              'say(f"no checkpoints yet in {out}")\n')
    assert sorted((line, name) for line, name, _ in spelled(source)) == [(2, "07d"), (2, "checkpoints"),
                                                                         (3, ".tmp-")]


def test_no_module_but_the_owner_spells_a_run_folder_name() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == OWNER:
            continue
        where = path.relative_to(PACKAGE).as_posix()
        for line, name, text in spelled(path.read_text(encoding="utf-8")):
            if not any(module == where and piece in text for module, piece in ALLOWED):
                found.append(f"meshtune/{where}:{line}: {name} in {text!r}")
    assert not found, "ask meshtune.run_dir (RunDir, CheckpointDir) instead:\n" + "\n".join(found)


def test_every_allowed_spelling_is_still_there() -> None:
    stale = [(module, piece) for module, piece in sorted(ALLOWED)
             if not any(piece in text for _, _, text in spelled((PACKAGE / module).read_text(encoding="utf-8")))]
    assert not stale, f"allowed spellings no longer in the code (drop them): {stale}"


def test_a_run_folder_is_laid_out_as_mlx_lm_and_earlier_runs_wrote_it() -> None:
    run = RunDir("runs/x")
    assert [p.as_posix() for p in (run.adapters, run.config, run.metrics, run.report, run.plot, run.lock,
                                   run.heartbeats, run.model, run.base_path_record(3))] == [
        "runs/x/adapters.safetensors", "runs/x/adapter_config.json", "runs/x/metrics.jsonl", "runs/x/report.md",
        "runs/x/loss.png", "runs/x/.meshtune.lock", "runs/x/.heartbeats", "runs/x/model",
        "runs/x/base_path.rank3.json"]
    checkpoint = run.checkpoint(40)
    assert checkpoint.path.as_posix() == "runs/x/checkpoints/0000040" and checkpoint.step == 40
    assert [p.name for p in (checkpoint.adapters, checkpoint.optimizer, checkpoint.saved_config,
                             checkpoint.manifest, checkpoint.adapter_config, *checkpoint.stage(1))] == [
        "adapters.safetensors", "optimizer.safetensors", "config.yaml", "state.json", "adapter_config.json",
        "stage1.safetensors", "stage1.optimizer.safetensors", "state.stage1.json"]
    assert stage_names(0) == tuple(p.name for p in checkpoint.stage(0))
    assert run.checkpoint_temp(40, "stages").as_posix() == "runs/x/checkpoints/.0000040.tmp-stages"
    assert temp_path(run.adapters, "12", ".safetensors").name == ".adapters.safetensors.tmp-12.safetensors"
    assert is_temp(temp_path(run.report, "7")) and not is_temp(run.report)
    assert run.earlier_run(9).name == ".earlier-run-9" and is_earlier_run(run.earlier_run(9))


def test_checkpoints_are_listed_by_step_and_temp_folders_apart(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    assert run.numbered() == [] and run.leftover_temps() == []
    for step in (12, 4, 100):
        run.checkpoint(step).path.mkdir(parents=True)
    run.checkpoint_temp(104, "abc").mkdir()
    (run.checkpoints / "notes").mkdir()
    assert [c.step for c in run.numbered()] == [4, 12, 100]
    assert [p.name for p in run.leftover_temps()] == [".0000104.tmp-abc"]
    pipeline = run.checkpoint(12)
    pipeline.stage(0)[2].write_text("{}")
    assert pipeline.is_pipeline and pipeline.has_manifest and pipeline.stage_manifests() == [pipeline.stage(0)[2]]
    single = run.checkpoint(4)
    single.manifest.write_text("{}")
    assert not single.is_pipeline and single.has_manifest and not run.checkpoint(100).has_manifest
    assert CheckpointDir(str(single.path)) == single
