"""`meshtune serve`: an OpenAI-compatible chat/completions server over one run's adapters.

mlx_lm.server's machinery does the serving (its request handler, response generator, batching
and prompt cache); this module gives it two parts of its own. `RunModelProvider` loads the
base and the run's adapters through meshtune's loader, so every adapter meshtune trains is
served (DoRA on experts or on a quantized embedding included) and DoRA runs its folded
inference path (adapters/dora.py). `BoundedHandler` checks each request before mlx-lm reads
it: a body over `max_request_bytes` is 413, a malformed chat or a `max_tokens` over the cap is
400, a request for another model or for other adapters is 404 (mlx-lm's server would load
whatever path a request names), each with a JSON `error` that says what to change. A chat
without a system message gets the one the run trained with (prompt_format.py); /v1/models lists
the one served model by the name requests use.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import threading
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache
from mlx_lm.server import APIHandler, ModelProvider, ResponseGenerator, get_system_fingerprint

from . import adapters as ad
from .inference import load_model
from .prompt_format import run_prompt_format, with_system_prompt

DEFAULT_MODEL_KEY = "default_model"  # mlx_lm.server's name for the model it was started with


@dataclass(frozen=True, kw_only=True)
class ServeSettings:
    """What `meshtune serve` serves and how; sampling defaults are mlx_lm.server's."""

    model_path: str
    """The base model (a folder or hub id)."""
    adapter_path: str | None = None
    """The run's adapters (None: the base alone)."""
    model_name: str = ""
    """The name clients send as `model`; the adapter folder's name by default (the model path also works)."""
    system_prompt: str | None = None
    """Put before chats that bring no system message; None: none."""
    host: str = "127.0.0.1"
    """The address to listen on."""
    port: int = 8080
    """0 picks a free port (the start line says which)."""
    max_request_bytes: int = 1 << 20
    """Largest request body accepted (413 above it)."""
    max_tokens_limit: int = 4096
    """Largest max_tokens a request may ask for (400 above it)."""
    max_tokens: int = 512
    """max_tokens of a request that gives none."""
    temp: float = 0.0
    """Sampling temperature of a request that gives none (0: greedy)."""
    top_p: float = 1.0
    """top_p of a request that gives none (1: off)."""
    top_k: int = 0
    """top_k of a request that gives none (0: off)."""
    min_p: float = 0.0
    """min_p of a request that gives none (0: off)."""
    decode_concurrency: int = 32
    """Requests decoded together (mlx_lm.server's batching)."""
    prompt_concurrency: int = 8
    """Prompts prefilled together."""
    prefill_step_size: int = 2048
    """Prompt tokens per prefill step."""
    prompt_cache_size: int = 10
    """Distinct KV caches kept for reuse across requests."""

    def check(self) -> None:
        """One line naming the first setting out of range and its flag."""
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port}: give a port in 0..65535 (0 picks a free one)")
        if self.max_request_bytes < 1024:
            raise ValueError(f"--max-request-bytes {self.max_request_bytes}: give at least 1024")
        if not 1 <= self.max_tokens <= self.max_tokens_limit:
            raise ValueError(f"--max-tokens {self.max_tokens}: give 1 to --max-tokens-limit "
                             f"({self.max_tokens_limit}), or raise --max-tokens-limit")
        for name, value, low, high in (("--temp", self.temp, 0, None), ("--top-p", self.top_p, 0, 1),
                                       ("--min-p", self.min_p, 0, 1), ("--top-k", self.top_k, 0, None)):
            if value < low or (high is not None and value > high):
                span = f"in [{low}, {high}]" if high is not None else f"of {low} or more"
                raise ValueError(f"{name} {value}: give a value {span}")

    def served_names(self) -> set[str]:
        """The `model` values a request may name: the served name, the base's path, mlx-lm's default key."""
        return {self.model_name, self.model_path, DEFAULT_MODEL_KEY} - {""}

    def mlx_lm_args(self) -> argparse.Namespace:
        """The namespace mlx_lm.server's classes read their settings from (its own parser's keys)."""
        return argparse.Namespace(
            model=self.model_path, adapter_path=self.adapter_path, draft_model=None, num_draft_tokens=3,
            trust_remote_code=False, chat_template="", use_default_chat_template=False, pipeline=False,
            allowed_origins=["*"], temp=self.temp, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            max_tokens=self.max_tokens, chat_template_args={}, decode_concurrency=self.decode_concurrency,
            prompt_concurrency=self.prompt_concurrency, prefill_step_size=self.prefill_step_size,
            prompt_cache_size=self.prompt_cache_size, prompt_cache_bytes=None, kv_bits=None, kv_group_size=64,
            quantized_kv_start=5000)


class RunModelProvider(ModelProvider):
    """mlx_lm.server's model provider for one base and one run's adapters, loaded by meshtune."""

    def __init__(self, settings: ServeSettings) -> None:
        super().__init__(settings.mlx_lm_args())
        self.settings = settings
        # MLX binds arrays to the thread that made them: the model loads on mlx-lm's generation thread,
        # which says here when it is done, or why it failed, for `start_server` to report.
        self.loaded = threading.Event()
        self.load_error: Exception | None = None

    def load_default(self) -> None:
        try:
            super().load_default()
        except Exception as err:  # the loader's errors come in many types; start_server gives one line
            self.load_error = err
        finally:
            self.loaded.set()

    def load(self, model_path: str, adapter_path: str | None = None, draft_model_path: str | None = None) -> Any:
        # One model: whatever served name a request used (BoundedHandler checked it), the one loaded.
        return super().load(DEFAULT_MODEL_KEY, None, DEFAULT_MODEL_KEY)

    def _load(self, model_path: str, adapter_path: str | None = None, draft_model_path: str | None = None) -> None:
        from mlx_lm.processors import load_processor

        self.reset()
        gc.collect()
        mx.clear_cache()
        model, tokenizer, config = load_model(self.settings.model_path, return_config=True)
        if self.settings.adapter_path:
            ad.load_adapters(model, self.settings.adapter_path, self.settings.model_path)
        model.eval()
        self.model_key = (model_path, adapter_path, draft_model_path)
        self.model, self.tokenizer, self.draft_model = model, tokenizer, None
        self.processor = load_processor(model, config)
        self.is_batchable = all(hasattr(c, "merge") for c in make_prompt_cache(model))


def _request_problem(body: Any, path: str, settings: ServeSettings) -> tuple[int, str] | None:
    """(status, error) for a request meshtune refuses before mlx-lm reads it, or None."""
    if not isinstance(body, dict):
        return 400, "the request body must be a JSON object"
    model = body.get("model", DEFAULT_MODEL_KEY)
    if model not in settings.served_names():
        return 404, f"model {model!r} is not served here; send \"model\": {settings.model_name!r}"
    for key in ("adapters", "draft_model"):
        if body.get(key) is not None:
            return 400, f"{key!r}: this server serves the adapters it was started with; drop {key!r}"
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and value > settings.max_tokens_limit:
            return 400, (f"{key} {value} is more than this server's limit {settings.max_tokens_limit} "
                         "(meshtune serve --max-tokens-limit)")
    if path.endswith("chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return 400, "'messages' must be a non-empty list like [{\"role\": \"user\", \"content\": \"Hi\"}]"
        for k, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                return 400, f"messages[{k}] must be an object with a 'role' string and 'content'"
    elif "prompt" not in body or not isinstance(body["prompt"], str):
        return 400, "'prompt' must be a string"
    return None


def bounded_handler(settings: ServeSettings) -> type:
    """mlx_lm.server's request handler behind meshtune's checks (the module docstring lists them)."""

    class BoundedHandler(APIHandler):
        def _refuse(self, status: int, error: str) -> None:
            self._set_completion_headers(status)
            self.end_headers()
            self.wfile.write(json.dumps({"error": error}).encode())

        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                return super().do_POST()  # mlx-lm answers 411 or 400
            if int(length) > settings.max_request_bytes:
                self.close_connection = True  # the body is left unread
                return self._refuse(413, f"the request body is {length} bytes, more than this server's "
                                         f"{settings.max_request_bytes} (meshtune serve --max-request-bytes)")
            raw = self.rfile.read(int(length))
            try:
                body = json.loads(raw.decode())
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                return self._refuse(400, f"the request body is not JSON ({err})")
            problem = _request_problem(body, self.path, settings)
            if problem is not None:
                return self._refuse(*problem)
            if "messages" in body:
                body["messages"] = with_system_prompt(body["messages"], settings.system_prompt)
            raw = json.dumps(body).encode()
            del self.headers["Content-Length"]
            self.headers["Content-Length"] = str(len(raw))
            self.rfile = io.BytesIO(raw)
            return super().do_POST()

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if not self.path.startswith("/v1/models"):
                return super().do_GET()  # /health, or mlx-lm's 404
            # The one model served, by the name requests use (mlx-lm lists its hub cache's models instead).
            self._set_completion_headers(200)
            self.end_headers()
            self.wfile.write(json.dumps({"object": "list", "data": [
                {"id": settings.model_name, "object": "model", "created": self.created}]}).encode())

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
            pass  # one line per request would drown the start line; errors still reach the client

    return BoundedHandler


def serve_settings_for_run(model_path: str, adapter_path: str | None, system_prompt: str | None,
                           **rest: Any) -> ServeSettings:
    """Settings for serving a run: the served name from its folder, the system prompt its data shared
    unless `system_prompt` is given ('' sends none)."""
    run = run_prompt_format(adapter_path)
    system = run.system_prompt if system_prompt is None else (system_prompt or None)
    name = rest.pop("model_name", "") or (Path(adapter_path).resolve().name if adapter_path else model_path)
    return ServeSettings(model_path=model_path, adapter_path=adapter_path, system_prompt=system, model_name=name,
                         **rest)


def start_server(settings: ServeSettings) -> tuple[ThreadingHTTPServer, ResponseGenerator]:
    """Load the model (errors are one line, before the port is bound), then bind the server; the caller
    runs `serve_forever`."""
    settings.check()
    provider = RunModelProvider(settings)
    generator = ResponseGenerator(provider, LRUPromptCache(settings.prompt_cache_size))  # starts the load
    provider.loaded.wait()
    if provider.load_error is not None:
        generator.stop_and_join()
        raise provider.load_error if isinstance(provider.load_error, ValueError) else ValueError(
            f"--model {settings.model_path} with --adapter-path {settings.adapter_path} could not be loaded "
            f"({type(provider.load_error).__name__}: {provider.load_error})")
    handler = bounded_handler(settings)
    fingerprint = get_system_fingerprint()
    server = ThreadingHTTPServer((settings.host, settings.port),
                                 lambda *a, **k: handler(generator, *a, system_fingerprint=fingerprint, **k))
    return server, generator


def serve(settings: ServeSettings, say: Callable[[str], None] = print) -> None:
    """Serve until interrupted; the start line names the address, the model and the adapters."""
    server, generator = start_server(settings)
    host, port = server.server_address[:2]
    what = f"{settings.model_path} with {settings.adapter_path}" if settings.adapter_path else settings.model_path
    say(f"serving {what} as {settings.model_name!r} at http://{host}:{port}/v1/chat/completions "
        f"(and /v1/completions); Ctrl-C stops")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        generator.stop_and_join()
