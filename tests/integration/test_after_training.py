"""After the run, end to end on the embedded model: a chat run's system prompt recorded and used by
`meshtune generate` (mlx_lm.generate's flags, streamed) and by `meshtune serve` (a real server process,
plain HTTP)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from support import ROOT, TINY_MODEL, run_cli

SYSTEM = "Answer with the number only."
PROMPT = "What is 3 + 4?"


def write_chat_data(folder) -> None:
    """Sums as chats that all open with the same system message."""
    folder.mkdir(parents=True)
    for split, count in (("train", 24), ("valid", 8), ("test", 20)):
        rows = [{"messages": [{"role": "system", "content": SYSTEM},
                              {"role": "user", "content": f"What is {a} + {a + 3}?"},
                              {"role": "assistant", "content": str(2 * a + 3)}]} for a in range(count)]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A LoRA and a DoRA run of 4 steps on the chat data: {kind: run folder}."""
    root = tmp_path_factory.mktemp("after")
    write_chat_data(root / "chat")
    out = {}
    for kind in ("lora", "dora"):
        out[kind] = root / kind
        proc = run_cli("train", "--data", str(root / "chat"), "--iters", "4", "--fine-tune-type", kind,
                       "--learning-rate", "1e-3", "--train.val_batches", "1", "--adapter-path", str(out[kind]))
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[f"{kind}_stdout"] = proc.stdout
    return out


def _framed_length(prompt: str, system: str | None = SYSTEM) -> int:
    """Tokens of the prompt as the run trained: the system message, the user's, the assistant header."""
    from mlx_lm.utils import load_tokenizer

    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return len(load_tokenizer(TINY_MODEL).apply_chat_template(messages, add_generation_prompt=True,
                                                               return_dict=False))


def _stock_greedy(run, prompt: str, max_tokens: int, system: str | None = SYSTEM) -> str:
    """What stock mlx-lm generates from the run's adapters, the prompt framed by hand."""
    from mlx_lm import generate, load

    model, tokenizer = load(str(TINY_MODEL), adapter_path=str(run))
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    tokens = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    return generate(model, tokenizer, prompt=tokens, max_tokens=max_tokens)


def test_the_run_records_its_system_prompt_and_stock_mlx_lm_still_loads_it(runs):
    config = json.loads((runs["lora"] / "adapter_config.json").read_text())
    assert config["data_format"] == "chat" and config["system_prompt"] == SYSTEM
    assert _stock_greedy(runs["lora"], PROMPT, 3)  # stock's loader takes the config with the new key


def test_generate_streams_the_run_s_framing_with_mlx_lm_generate_s_flags(runs):
    run = runs["lora"]
    proc = run_cli("generate", "--adapter-path", str(run), "-p", PROMPT, "-m", "6", "--verbose")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == _stock_greedy(run, PROMPT, 6) + "\n"  # the system prompt was sent, as trained
    lines = proc.stderr.splitlines()
    assert lines[0].startswith(f"generate: chat template, system prompt {SYSTEM!r} (the adapters were trained on "
                               "chat data with a system prompt")
    assert [line.split(":")[0] for line in lines[1:]] == ["Prompt", "Generation", "Peak memory"]
    assert lines[1].startswith(f"Prompt: {_framed_length(PROMPT)} tokens, ")
    assert _framed_length(PROMPT) > _framed_length(PROMPT, system=None)
    assert "tokens-per-sec" in lines[2] and lines[3].endswith(" GB")
    dropped = run_cli("generate", "--adapter-path", str(run), "-p", PROMPT, "-m", "6", "--system-prompt", "")
    assert dropped.stdout == _stock_greedy(run, PROMPT, 6, system=None) + "\n"
    sampled = [run_cli("generate", "--adapter-path", str(run), "-p", PROMPT, "--max-tokens", "8", "--temp", "1.5",
                       "--top-k", "20", "--seed", "3").stdout for _ in range(2)]
    assert sampled[0] == sampled[1] and sampled[0].strip()


def test_generate_refuses_a_sampling_flag_out_of_range_before_loading(runs):
    proc = run_cli("generate", "--adapter-path", str(runs["lora"]), "-p", PROMPT, "--top-p", "0")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["meshtune: error: --top-p 0.0: give a value in (0, 1], e.g. --top-p 0.9 (1 "
                                        "keeps every token)"]


def _post(port: int, path: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def server(runs):
    """`meshtune serve` on the DoRA run, on a free port: (port, process)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "meshtune.cli", "serve", "--adapter-path", str(runs["dora"]),
                             "--port", "0", "--max-request-bytes", "4096", "--max-tokens-limit", "64"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # the start line, printed once the model is loaded and the port bound
        assert line.startswith(f"serving {TINY_MODEL} with {runs['dora']} as 'dora' at http://127.0.0.1:"), (
            line + (proc.stderr.read() if not line else ""))
        yield int(line.split("http://127.0.0.1:")[1].split("/")[0]), proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_serve_answers_a_chat_completion_as_generate_does(server, runs):
    port, _ = server
    chat = {"model": "dora", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6}
    status, reply = _post(port, "/v1/chat/completions", json.dumps(chat).encode())
    assert status == 200, reply
    assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] <= 6
    assert reply["usage"]["prompt_tokens"] == _framed_length(PROMPT)
    # The run's system prompt went first, and DoRA ran through meshtune's layers: the same text as generate.
    generated = run_cli("generate", "--adapter-path", str(runs["dora"]), "-p", PROMPT, "-m", "6")
    assert reply["choices"][0]["message"]["content"] == generated.stdout[:-1]
    status, text = _post(port, "/v1/completions", json.dumps({"model": "dora", "prompt": "What is",
                                                              "max_tokens": 3}).encode())
    assert status == 200 and text["object"] == "text_completion"
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as response:
        assert [m["id"] for m in json.loads(response.read())["data"]] == ["dora"]


@pytest.mark.parametrize("body, status, error", [
    (b"{not json", 400, "the request body is not JSON"),
    (json.dumps({"model": "dora", "messages": []}).encode(), 400, "'messages' must be a non-empty list"),
    (json.dumps({"model": "dora", "messages": ["hi"]}).encode(), 400, "messages[0] must be an object"),
    (json.dumps({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}).encode(), 404,
     "model 'gpt-4' is not served here; send \"model\": 'dora'"),
    (json.dumps({"model": "dora", "adapters": "/elsewhere", "messages": [{"role": "user", "content": "x"}]}).encode(),
     400, "'adapters': this server serves the adapters it was started with"),
    (json.dumps({"model": "dora", "max_tokens": 65, "messages": [{"role": "user", "content": "x"}]}).encode(), 400,
     "max_tokens 65 is more than this server's limit 64 (meshtune serve --max-tokens-limit)"),
    (json.dumps({"model": "dora", "messages": [{"role": "user", "content": "x" * 5000}]}).encode(), 413,
     "more than this server's 4096 (meshtune serve --max-request-bytes)"),
])
def test_serve_refuses_a_bad_request_with_a_4xx_that_says_why(server, body, status, error):
    port, proc = server
    got, reply = _post(port, "/v1/chat/completions", body)
    assert (got, error in reply["error"]) == (status, True), reply
    assert proc.poll() is None  # still serving


def test_export_peft_writes_peft_s_two_files_for_a_dora_run(runs, tmp_path):
    out = tmp_path / "peft"
    proc = run_cli("export", "--format", "peft", "--adapter-path", str(runs["dora"]), "--save-path", str(out),
                   "--base-model", "org/tiny-llama")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [f"exported DoRA adapters on 28 layers as PEFT (r 8, lora_alpha 160) into {out}"]
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["peft_type"], config["use_dora"], config["base_model_name_or_path"]) == ("LORA", True,
                                                                                           "org/tiny-llama")
    from safetensors import safe_open

    with safe_open(str(out / "adapter_model.safetensors"), "np") as f:
        assert f.metadata() == {"format": "pt"}
        keys = set(f.keys())
    assert len(keys) == 28 * 3 and "base_model.model.model.layers.3.self_attn.q_proj.lora_magnitude_vector" in keys
    again = run_cli("export", "--format", "peft", "--adapter-path", str(runs["dora"]), "--save-path", str(out))
    assert again.returncode == 2 and "pass --overwrite to write the PEFT adapters over it" in again.stderr


def test_export_hf_and_gguf_write_the_fused_model(runs, tmp_path):
    import mlx.core as mx
    from mlx_lm import load

    from meshtune.inference import load_for_inference

    hf = tmp_path / "hf"
    proc = run_cli("export", "--format", "gguf", "--adapter-path", str(runs["dora"]), "--save-path", str(hf))
    assert proc.returncode == 0, proc.stderr[-2000:]
    config = json.loads((hf / "config.json").read_text())
    assert "quantization" not in config and config["model_type"] == "llama"
    gguf = mx.load(str(hf / "ggml-model-f16.gguf"))
    assert "blk.0.attn_q.weight" in gguf and "token_embd.weight" in gguf
    # The folder is the base with the DoRA run fused: the same logits as the adapters applied.
    fused, tok = load(str(hf))
    adapted, _ = load_for_inference(str(TINY_MODEL), runs["dora"])
    tokens = mx.array([tok.encode(PROMPT)])
    assert mx.allclose(fused(tokens), adapted(tokens), rtol=1e-4, atol=1e-4).item()


def test_gguf_for_a_family_mlx_lm_does_not_convert_is_one_line():
    from meshtune.export.fused import gguf_refusal

    assert gguf_refusal("llama") is None
    assert gguf_refusal("qwen3") == ("--format gguf: mlx-lm writes GGUF for llama, mistral, mixtral models only and "
                                     "this is a qwen3 model; export --format hf and convert that folder with "
                                     "llama.cpp's convert_hf_to_gguf.py")


def test_eval_scores_every_example_of_the_split_and_says_how(runs):
    def scored(*flags: str) -> tuple[float, str]:
        proc = run_cli("eval", "--adapter-path", str(runs["lora"]), *flags)
        assert proc.returncode == 0, proc.stderr[-2000:]
        head, _, how = proc.stdout.strip().partition(" (")
        return float(head.split()[2].rstrip(",")), how

    # 20 test rows: batches of 8 leave 4 over, scored as one more batch; batches of 4 leave none.
    loss_8, how_8 = scored("--batch-size", "8")
    loss_4, how_4 = scored("--batch-size", "4")
    assert " of 20 examples in 2 batches of 8 and 1 of 4;" in how_8
    assert " of 20 examples in 5 batches of 4;" in how_4
    assert loss_8 == pytest.approx(loss_4, abs=1e-4)  # the same examples, token-weighted
    _, how_1 = scored("--batch-size", "8", "--batches", "1")
    assert " of 8 of the split's 20 examples in 1 batch of 8;" in how_1


def test_a_run_without_num_layers_says_nothing_about_it(runs):
    assert "num_layers" not in runs["lora_stdout"]


def test_checkpoint_folders_take_the_umask_like_the_run_folder(runs):
    import stat

    run = runs["lora"]
    mode = stat.S_IMODE(run.stat().st_mode)
    folders = [p for p in (run / "checkpoints").iterdir()]
    assert folders and {stat.S_IMODE(p.stat().st_mode) for p in folders} == {mode}
    assert mode == 0o777 & ~_umask()


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def test_report_remakes_a_run_s_report_from_its_metrics(runs, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(runs["lora"], copy)
    before = (copy / "report.md").read_text()
    (copy / "report.md").unlink()
    (copy / "loss.png").unlink()
    proc = run_cli("report", "--adapter-path", str(copy))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("done: 4 steps, ") and (copy / "loss.png").exists()
    assert (copy / "report.md").read_text() == before
    missing = run_cli("report", "--adapter-path", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and "no such folder; give the --adapter-path of a run" in missing.stderr
