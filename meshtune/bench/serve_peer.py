"""`meshtune bench serve`: decode tokens/s of `meshtune serve` beside `mlx_lm.server` on the same adapters.

Both servers run in this process, one at a time, on the same model and LoRA and DoRA adapter
folders. HELP, the command's --help, says how; docs/performance.md ("Generation") holds the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import urllib.request
from http.server import ThreadingHTTPServer
from pathlib import Path
from threading import Thread
from typing import Any

import mlx.core as mx

from ..run_dir import RunDir
from .adapters import describe_device
from .flags import COUNT, BenchParser, at_least
from .fit import preset_shape
from .models import PRESETS, Shape, build_model, perturb_adapters, write_model_folder

HELP = """`meshtune bench serve`: decode tokens/s of `meshtune serve` beside `mlx_lm.server` on the same adapters.

One random model of the preset's shape (bench/models.py), written as a model folder, dense or
4-bit (group 64, affine: mlx-lm's converter), and LoRA and DoRA adapter folders on every linear
layer with trained-looking factors (perturb_adapters), saved in mlx-lm's layout so both
servers load the same files. Each server runs in this process on a free localhost port, one at
a time: meshtune's (meshtune.serve: its own adapter loading, DoRA's folded inference path) and
stock's (mlx_lm.server's ModelProvider, which loads adapters with mlx-lm's own classes). A
measurement is two chat completions with end-of-sequence banned (logit_bias), so each decodes
exactly its max_tokens: one of 1 token and one of --tokens tokens, on prompts as long as each
other that differ, so no request reads another's prompt cache; decode tokens/s is (tokens - 1)
over the difference of their seconds, the median of --requests measurements after one warm-up.
(The random model's ids mostly decode to no text, so counting streamed chunks would miss tokens.)

    meshtune bench serve                         # 1b on a GPU, small on a CPU; 4-bit and dense bases
    meshtune bench serve --preset tiny --json    # seconds on a CPU; what the test runs
"""

KINDS = ("lora", "dora")
BASES = ("4bit", "dense")
RANK, SCALE = 8, 20.0


def _parser() -> argparse.ArgumentParser:
    p = BenchParser(prog="meshtune bench serve", description=HELP)
    p.add_argument("--preset", choices=list(PRESETS), default=None,
                   help="Model shape (bench/models.py): tiny, small (CPU) or 1b (GPU). Default: 1b on a GPU, "
                        "small on a CPU.")
    p.add_argument("--bases", nargs="+", choices=BASES, default=list(BASES), help="Base storage: 4bit, dense.")
    p.add_argument("--tokens", type=at_least(2), default=64, help="Tokens each request decodes (default 64).")
    p.add_argument("--requests", type=COUNT, default=3, help="Measurements per server (default 3), after one "
                                                            "warm-up; each is two requests.")
    p.add_argument("--json", action="store_true", help="Print one JSON object last.")
    return p


def write_run(shape: Shape, quantized: bool, folder: Path) -> tuple[Path, dict[str, Path]]:
    """(model folder, {kind: adapter folder}) for one base: the same seed's model and adapters for both servers."""
    from ..adapters import apply_adapters, trainable_parameters

    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    model_dir = write_model_folder(shape, dtype, folder / "model", quantized=quantized)
    runs = {}
    for kind in KINDS:
        adapted = build_model(shape, mx.float32, quantized=quantized)  # the weights are reloaded; shapes matter
        apply_adapters(adapted, fine_tune_type=kind, num_layers=-1, keys=None, rank=RANK, scale=SCALE, dropout=0.0)
        perturb_adapters(adapted)
        runs[kind] = folder / kind
        runs[kind].mkdir()
        mx.save_safetensors(str(RunDir(runs[kind]).adapters), trainable_parameters(adapted))
        RunDir(runs[kind]).config.write_text(json.dumps({
            "fine_tune_type": kind, "num_layers": shape.layers, "model": str(model_dir),
            "lora_parameters": {"rank": RANK, "scale": SCALE, "dropout": 0.0}}))
    return model_dir, runs


def _stock_server(model_dir: Path, adapters: Path) -> tuple[ThreadingHTTPServer, Any]:
    """mlx_lm.server as `mlx_lm.server --model M --adapter-path A` builds it, on a free port."""
    from mlx_lm.models.cache import LRUPromptCache
    from mlx_lm.server import APIHandler, ModelProvider, ResponseGenerator

    from ..serve import ServeSettings

    class QuietHandler(APIHandler):  # stock's handler, without a log line per request in the bench's table
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
            pass

    args = ServeSettings(model_path=str(model_dir), adapter_path=str(adapters), port=0).mlx_lm_args()
    generator = ResponseGenerator(ModelProvider(args), LRUPromptCache(args.prompt_cache_size))
    server = ThreadingHTTPServer(("127.0.0.1", 0), lambda *a, **k: QuietHandler(generator, *a, **k))
    return server, generator


def _ours(model_dir: Path, adapters: Path) -> tuple[ThreadingHTTPServer, Any]:
    from ..serve import serve_settings_for_run, start_server

    return start_server(serve_settings_for_run(str(model_dir), str(adapters), None, port=0))


def _timed_completion(port: int, prompt: str, tokens: int, eos: list[int]) -> float:
    """Seconds for one chat completion that decodes exactly `tokens` tokens (end-of-sequence banned)."""
    body = {"model": "default_model", "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "logit_bias": {str(t): -1e9 for t in eos}}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    began = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        count = json.loads(response.read())["usage"]["completion_tokens"]
    seconds = time.perf_counter() - began
    if count != tokens:
        raise RuntimeError(f"a request decoded {count} tokens, not {tokens}; the rates would not compare")
    return seconds


def decode_rate(port: int, round_: int, tokens: int, eos: list[int]) -> float:
    """Decode tokens/s: a request of `tokens` tokens against one of 1 token, whose prompts are as long and
    differ (no prompt cache reuse), so the difference is the decoding of tokens - 1 tokens."""
    one = _timed_completion(port, f"round {round_} a: tell a long story", 1, eos)
    many = _timed_completion(port, f"round {round_} b: tell a long story", tokens, eos)
    return (tokens - 1) / max(many - one, 1e-9)


def measure(start: Any, model_dir: Path, adapters: Path, a: argparse.Namespace, eos: list[int]) -> float:
    """Median decode tokens/s of one server over --requests requests (after one warm-up)."""
    server, generator = start(model_dir, adapters)
    thread = Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        decode_rate(port, 0, a.tokens, eos)  # warm-up
        return statistics.median(decode_rate(port, i + 1, a.tokens, eos) for i in range(a.requests))
    finally:
        server.shutdown()
        server.server_close()
        generator.stop_and_join()
        mx.clear_cache()


def main(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    from mlx_lm.utils import load_tokenizer

    on_gpu = mx.default_device() == mx.gpu
    preset = a.preset or ("1b" if on_gpu else "small")
    shape = preset_shape(preset)
    print(f"serve bench: {shape.describe()}; LoRA/DoRA rank {RANK} on every linear layer; {a.tokens} decoded "
          f"tokens per request, median of {a.requests}; {describe_device()}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="meshtune-bench-serve-") as tmp:
        for base in a.bases:
            model_dir, runs = write_run(shape, base == "4bit", Path(tmp) / base)
            eos = sorted(load_tokenizer(model_dir).eos_token_ids)
            for kind in KINDS:
                ours = measure(_ours, model_dir, runs[kind], a, eos)
                stock = measure(_stock_server, model_dir, runs[kind], a, eos)
                rows.append({"base": base, "kind": kind, "meshtune_tps": ours, "mlx_lm_tps": stock})
    print("| base | adapter | meshtune serve decode tok/s | mlx_lm.server decode tok/s | meshtune / stock |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        r["vs_stock"] = r["meshtune_tps"] / r["mlx_lm_tps"]
        print(f"| {r['base']} | {r['kind']} | {r['meshtune_tps']:.1f} | {r['mlx_lm_tps']:.1f} | {r['vs_stock']:.2f}x |")
    ratios = {}
    for base in a.bases:
        by_kind = {r["kind"]: r for r in rows if r["base"] == base}
        ratios[base] = {side: by_kind["dora"][f"{side}_tps"] / by_kind["lora"][f"{side}_tps"]
                        for side in ("meshtune", "mlx_lm")}
        print(f"{base}: DoRA / LoRA decode, meshtune serve {ratios[base]['meshtune']:.2f}x, "
              f"mlx_lm.server {ratios[base]['mlx_lm']:.2f}x")
    if a.json:
        print(json.dumps({"preset": preset, "tokens": a.tokens, "requests": a.requests, "rows": rows,
                          "dora_over_lora": ratios}))
    return 0
