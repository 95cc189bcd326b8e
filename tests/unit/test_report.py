"""The run report, the report line and the trackers' plumbing, without starting a run."""

from __future__ import annotations

import io
import json
import re
import struct
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from meshtune.config.mlx_lm_compat import FLAT_KEYS, MLX_LM_FLAGS
from meshtune.runtime.mesh import Mesh
from meshtune.parallel.pipeline.schedules import idle_fraction
from meshtune.parallel.pipeline.schedules import build
from meshtune.training import trackers
from meshtune.training.metrics import Reporter, peak_memory_per_rank, read_metrics, wait_shares
from meshtune.report import summary_line, write_report
from meshtune.run_dir import PLOT_FILE, REPORT_FILE

TRAIN = [  # (step, loss, tokens, tokens/s)
    (2, 3.5, 100, 50.0), (4, 2.25, 120, 60.0), (6, 1.125, 80, 40.0),
]


def _fake_run(out: Path, *, pp: int = 1, ranks: int = 2) -> None:
    out.mkdir()
    # 16 blocks asked of a 2-block model: adapter_config.json says what was applied, which the report gives.
    config = {"model": "models/tiny", "data": "data/arith", "fine_tune_type": "dora", "num_layers": 2,
              "meshtune": {"adapter": {"fine_tune_type": "dora", "rank": 4, "scale": 10.0, "num_layers": 16},
                           "parallel": {"pp": pp, "schedule": "gpipe", "micro_batches": 4}}}
    (out / "adapter_config.json").write_text(json.dumps(config))
    records = [{"type": "val", "step": 0, "val_loss": 4.0, "tokens": 9, "seconds": 0.1, "time": 1000.0}]
    trained = 0
    for i, (step, loss, tokens, tps) in enumerate(TRAIN):
        trained += tokens
        records.append({"type": "train", "step": step, "loss": loss, "learning_rate": 1e-3, "tokens": tokens,
                        "tokens_per_sec": tps, "trained_tokens": trained, "peak_memory_gb": 0.5 + i,
                        "peak_memory_gb_per_rank": [0.5 + i] + [0.1] * (ranks - 1), "comm_share": 0.1 * (i + 1),
                        "time": 1001.0 + i})
    records.append({"type": "val", "step": 6, "val_loss": 1.5, "tokens": 9, "seconds": 0.1, "time": 1010.5})
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def _row(text: str, name: str) -> str:
    found = re.search(rf"^\| {re.escape(name)} \| (.*) \|$", text, re.M)
    assert found, f"no row {name!r} in report.md:\n{text}"
    return found.group(1)


def test_report_numbers_come_from_the_metrics(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _fake_run(run)
    summary = write_report(run)
    text = (run / REPORT_FILE).read_text()
    assert _png_size(run / PLOT_FILE) == (800, 500)
    records = [r for r in read_metrics(run) if r["type"] == "train"]
    seconds = sum(r["tokens"] / r["tokens_per_sec"] for r in records)  # 2 + 2 + 2
    assert _row(text, "model") == "models/tiny" and _row(text, "data") == "data/arith"
    assert _row(text, "layout") == "2 ranks: dp 2, pp 1"
    assert _row(text, "adapter") == "dora, rank 4, scale 10.0, layers 2"
    assert _row(text, "steps") == "6"
    assert _row(text, "tokens trained") == "300" == str(records[-1]["trained_tokens"])
    assert _row(text, "time in steps") == f"{seconds:.1f} s" == "6.0 s"
    assert _row(text, "tokens/s") == f"{300 / seconds:.1f}"
    assert _row(text, "peak memory") == "2.500 GB (the largest rank)"
    assert _row(text, "train loss") == "3.5000 (step 2) -> 1.1250 (step 6)"
    assert _row(text, "validation loss") == "4.0000 (step 0) -> 1.5000 (step 6)"
    assert _row(text, "comm share, measured (mean of the reports)") == "20.0%"
    line = summary_line(summary, run, run / "adapters.safetensors")
    assert line.startswith("done: 6 steps, 300 tokens in 6.0 s (50 tok/s); final train loss 1.1250, val loss 1.5000")
    assert str(run / REPORT_FILE) in line and str(run / PLOT_FILE) in line


def test_a_run_cut_off_is_reported_as_incomplete_with_its_checkpoint(tmp_path: Path) -> None:
    """kill -9 at step 6 of 50: no end was recorded; the adapters hold the newest checkpoint's step."""
    run = tmp_path / "run"
    _fake_run(run)
    config = json.loads((run / "adapter_config.json").read_text())
    config["meshtune"]["train"] = {"iters": 50}
    (run / "adapter_config.json").write_text(json.dumps(config))
    (run / "checkpoints" / "0000004").mkdir(parents=True)
    summary = write_report(run)
    assert summary.status == "incomplete" and _row((run / REPORT_FILE).read_text(), "steps") == "6 of 50 (incomplete)"
    line = summary_line(summary, run, run / "adapters.safetensors")
    assert line.startswith("incomplete: step 6 of 50, 300 tokens") and "no adapters written yet" in line
    (run / "adapters.safetensors").write_bytes(b"")
    line = summary_line(summary, run, run / "adapters.safetensors")
    assert f"adapters {run / 'adapters.safetensors'} (step 4)" in line
    # A 2-rank run: resumed on 2 ranks (a run without a start record: from its reports' rank count) ...
    assert line.endswith(f"; resume with meshtune launch -n 2 -- meshtune train --adapter-path {run} --resume")
    hosts = "meshtune launch --hostfile /abs/hosts.json -- meshtune train --adapter-path r --resume"
    with (run / "metrics.jsonl").open("a") as f:  # ... else as its start record says (api.finetune writes it)
        f.write(json.dumps({"type": "start", "step": 0, "resume": hosts}) + "\n")
    assert summary_line(write_report(run), run, run / "adapters.safetensors").endswith(f"; resume with {hosts}")
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"type": "stop", "step": 6, "message": "stopped"}) + "\n")
    assert write_report(run).status == "stopped"


def test_a_last_record_cut_off_mid_write_is_left_out_and_a_bad_line_named(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _fake_run(run)
    whole = read_metrics(run)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"type": "train", "step": 7, "lo')
    with pytest.warns(UserWarning, match=r"metrics.jsonl:6: an incomplete last record"):
        assert read_metrics(run) == whole
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([lines[0], "not json", *lines[1:-1]]) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON record"):
        read_metrics(run)


def test_a_pipeline_report_gives_the_schedule_and_its_analytic_idle_share(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _fake_run(run, pp=2, ranks=4)
    text = (write_report(run), (run / REPORT_FILE).read_text())[1]
    assert _row(text, "layout") == "4 ranks: dp 2, pp 2, schedule gpipe, 4 micro-batches"
    assert _row(text, "pipeline idle share, analytic from the schedule") == "20.0%"  # (2 - 1) / (4 + 2 - 1)


@pytest.mark.parametrize("stages,micro", [(2, 2), (2, 4), (4, 8), (3, 5)])
def test_idle_fraction_is_the_textbook_bubble(stages: int, micro: int) -> None:
    for name in ("gpipe", "1f1b"):
        assert idle_fraction(build(name, stages, micro)) == pytest.approx((stages - 1) / (micro + stages - 1))
    assert idle_fraction(build("naive", stages, micro)) == pytest.approx((stages - 1) / stages)
    assert idle_fraction(build("gpipe", 1, micro)) == 0.0


def test_report_line_has_no_bar_off_a_terminal(tmp_path: Path) -> None:
    lines: list[str] = []
    err = io.StringIO()  # not a terminal
    with Reporter(tmp_path, total_steps=4, log=lines.append, terminal=err) as rep:
        assert rep._bar is None
        for step in (1, 2):
            rep.advance()
            rep.train(step, loss=2.0, tokens=10, seconds=0.5, steps=1, learning_rate=1e-3, trained_tokens=10 * step,
                      peaks=[0.25, 0.75], shares={"bubble_share": 0.125})
    assert err.getvalue() == ""
    assert lines == [f"step {s}: train loss 2.0000, lr 1.000e-03, 20 tok/s, peak mem 0.750 GB, bubble 12.5%"
                     for s in (1, 2)]
    rec = read_metrics(tmp_path)[0]
    assert rec["peak_memory_gb"] == 0.75 and rec["peak_memory_gb_per_rank"] == [0.25, 0.75]
    assert rec["bubble_share"] == 0.125


def test_the_bar_stays_on_a_terminal(tmp_path: Path) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    with Reporter(tmp_path, total_steps=4, log=lambda _: None, terminal=Tty()) as rep:
        assert rep._bar is not None


def test_one_process_gathers_its_own_peak_and_shares() -> None:
    mesh = Mesh.single()
    mx.eval(mx.zeros((16, 2**20), dtype=mx.float32))  # 64 MiB, so the peak is at least that
    peaks = peak_memory_per_rank(mesh)
    assert len(peaks) == 1 and peaks[0] == mx.get_peak_memory() / 1e9 and peaks[0] >= 64 * 2**20 / 1e9
    assert wait_shares(mesh, {}, 2.0) == {}
    assert wait_shares(mesh, {"comm": 0.5}, 2.0) == {"comm_share": 0.25}


def test_report_to_names(monkeypatch) -> None:
    assert trackers.tracker_names(None) == [] and trackers.tracker_names("") == []
    assert trackers.tracker_names("TensorBoard, wandb") == ["tensorboard", "wandb"]
    assert trackers.tracker_names(["wandb", "wandb"]) == ["wandb"]
    with pytest.raises(ValueError, match=r"'swanlab' is not one of tensorboard, wandb; e.g. --report-to"):
        trackers.tracker_names("swanlab")
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import fails as if not installed
    with pytest.raises(ValueError) as err:
        trackers.check_trackers("tensorboard,wandb")
    assert str(err.value) == ("output.report_to=tensorboard needs tensorboardX: pip install 'meshtune[tensorboard]', "
                              "or --report-to wandb")
    assert MLX_LM_FLAGS["--report-to"] == FLAT_KEYS["report_to"] == "output.report_to"
    assert MLX_LM_FLAGS["--project-name"] == FLAT_KEYS["project_name"] == "output.project_name"


def test_wandb_without_a_key_is_refused_before_the_run(tmp_path) -> None:
    """W&B with no key and no offline mode would fail inside wandb.init, after the model loaded."""
    pytest.importorskip("wandb")
    # Never logged in: no netrc, no settings files.
    environ = {"NETRC": str(tmp_path / "netrc"), "WANDB_CONFIG_DIR": str(tmp_path / "config"),
               "WANDB_DIR": str(tmp_path)}
    with pytest.raises(ValueError) as err:
        trackers.check_trackers("tensorboard,wandb", environ)
    assert str(err.value).startswith("output.report_to=wandb: no W&B API key")
    assert "wandb login" in str(err.value) and "WANDB_MODE=offline" in str(err.value)
    assert str(err.value).endswith("or --report-to tensorboard")
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    assert trackers.check_trackers("wandb", environ) == ["wandb"]  # `wandb login` writes this
    (tmp_path / "netrc").unlink()
    assert trackers.check_trackers("wandb", environ | {"WANDB_MODE": "offline"}) == ["wandb"]
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "settings").write_text("[default]\nmode = offline\n")  # what `wandb offline` writes
    assert trackers.check_trackers("wandb", environ) == ["wandb"]
    (tmp_path / "config" / "settings").unlink()
    assert trackers.check_trackers("wandb", environ | {"WANDB_API_KEY": "abc"}) == ["wandb"]


def test_tracker_scalars() -> None:
    train = {"type": "train", "step": 3, "loss": 1.0, "learning_rate": 0.1, "tokens_per_sec": 5.0,
             "peak_memory_gb": 0.5, "comm_share": 0.2, "tokens": 7}
    assert trackers.scalars(train) == {"train/loss": 1.0, "train/learning_rate": 0.1, "train/tokens_per_sec": 5.0,
                                       "train/peak_memory_gb": 0.5, "train/comm_share": 0.2}
    assert trackers.scalars({"type": "val", "step": 3, "val_loss": 2.0}) == {"val/loss": 2.0}
    assert trackers.scalars({"type": "skip", "step": 3}) == {}


def test_a_run_stopped_before_its_next_eval_does_not_pass_the_step_0_loss_off_as_its_result(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _fake_run(run)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    kept = [l for l in lines if not (json.loads(l)["type"] == "val" and json.loads(l)["step"] == 6)]
    (run / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    line = summary_line(write_report(run), run, run / "adapters.safetensors")
    assert "; final train loss 1.1250, val loss 4.0000 (at step 0, before training); " in line


def test_a_run_resumed_on_fewer_ranks_reports_the_ranks_it_ended_on(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _fake_run(run, ranks=2)
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    for r in records:  # the reports after step 4 came from one rank
        if r["type"] == "train" and r["step"] > 4:
            r["peak_memory_gb_per_rank"] = r["peak_memory_gb_per_rank"][:1]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = write_report(run)
    assert summary.ranks == 1
    assert _row((run / REPORT_FILE).read_text(), "layout") == "1 rank: dp 1, pp 1 (resumed; 2 ranks up to step 4)"
