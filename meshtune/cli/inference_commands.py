"""The commands that use a finished run: `meshtune generate`, `meshtune serve` and `meshtune export`.

Their flags follow the mlx-lm commands users know (mlx_lm.generate, mlx_lm.server,
mlx_lm.fuse) with the same meanings; each command is a thin call into meshtune.inference,
meshtune.serve or meshtune.export. Nothing here imports MLX at the top (cli/__init__.py).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..run_dir import CONFIG_FILE
from .run_args import check_adapter_folder, check_run_config, default_model, model_from_adapters, no_extra


def _true_or_false(text: str) -> bool:
    """mlx_lm.generate's reading of --verbose's value: anything but false/f is true."""
    return text.lower() not in ("false", "f")


def _model_path(args: argparse.Namespace, alone: str) -> str:
    """--model, else the base the adapters record, else the embedded model."""
    if args.adapter_path:
        check_adapter_folder(args.adapter_path)
    if args.model:
        return args.model
    return model_from_adapters(args.adapter_path, alone) if args.adapter_path else default_model()


def cmd_generate(args: argparse.Namespace, rest: list[str]) -> int:
    """Stream a completion of --prompt, framed as the run trained (prompt_format.py)."""
    no_extra(rest)
    from ..inference import Sampling, load_for_inference, stream_completion
    from ..prompt_format import choose_prompt_format, prompt_tokens, run_prompt_format

    sampling = Sampling(temp=args.temp, top_p=args.top_p, min_p=args.min_p, top_k=args.top_k, seed=args.seed)
    sampling.check()  # before the model loads
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens {args.max_tokens}: give 1 or more, e.g. --max-tokens 100")
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    model_path = _model_path(args, " (generate also runs the base alone: --model without --adapter-path)")
    model, tokenizer = load_for_inference(model_path, args.adapter_path)
    choice = choose_prompt_format(run_prompt_format(args.adapter_path),
                                  has_template=bool(getattr(tokenizer, "chat_template", None)),
                                  has_adapters=bool(args.adapter_path), raw=args.raw, chat=args.chat,
                                  system_prompt=args.system_prompt)
    system = f", system prompt {choice.system_prompt!r}" if choice.system_prompt is not None else ""
    print(f"generate: {'chat template' if choice.chat else 'raw prompt'}{system} ({choice.why})", file=sys.stderr,
          flush=True)
    last = stream_completion(model, tokenizer, prompt_tokens(tokenizer, prompt, choice), max_tokens=args.max_tokens,
                             sampling=sampling, write=lambda text: print(text, end="", flush=True))
    print(flush=True)
    if args.verbose:  # mlx_lm.generate's lines, on stderr so that stdout stays the completion
        if last is None or last.generation_tokens == 0:
            print("No text generated for this prompt", file=sys.stderr)
        else:
            print(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec\n"
                  f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec\n"
                  f"Peak memory: {last.peak_memory:.3f} GB", file=sys.stderr)
    return 0


def add_generate(sub: Any) -> None:
    """`meshtune generate`: mlx_lm.generate's flags, with their meanings."""
    gen = sub.add_parser("generate", help="Stream a completion of a prompt (mlx_lm.generate's flags).",
                         description="Sampling flags mean what mlx_lm.generate's do. With --adapter-path the "
                                     "prompt is framed as the run trained: the chat template for chat or "
                                     "prompt/completion data, with the system prompt the training rows shared.")
    gen.add_argument("--model", help=f"Base model (default: from {CONFIG_FILE} or the embedded one).")
    gen.add_argument("--adapter-path", help="Adapters to apply (a run folder or one of its checkpoints).")
    gen.add_argument("-p", "--prompt", required=True, help="The user message ('-' reads it from stdin).")
    gen.add_argument("--system-prompt", default=None,
                     help="System message (default: the one the run's chat data shared, if any; '' sends none).")
    gen.add_argument("-m", "--max-tokens", type=int, default=64, help="Tokens to generate at most (default 64).")
    gen.add_argument("--temp", type=float, default=0.0, help="Sampling temperature (default 0: greedy).")
    gen.add_argument("--top-p", type=float, default=1.0, help="Sampling top-p (default 1: off).")
    gen.add_argument("--min-p", type=float, default=0.0, help="Sampling min-p (default 0: off).")
    gen.add_argument("--top-k", type=int, default=0, help="Sampling top-k (default 0: off).")
    gen.add_argument("--seed", type=int, default=None, help="PRNG seed, for a repeatable sampled completion.")
    gen.add_argument("--verbose", type=_true_or_false, nargs="?", const=True, default=False,
                     help="Also print prompt and generation tokens/s and peak memory (on stderr); "
                          "'--verbose' or '--verbose True' as in mlx_lm.generate.")
    form = gen.add_mutually_exclusive_group()
    form.add_argument("--raw", "--ignore-chat-template", dest="raw", action="store_true",
                      help="Send the prompt as is, without the chat template.")
    form.add_argument("--chat", action="store_true", help="Send the prompt through the tokenizer's chat template "
                                                          "(default: when the adapters were trained on chat or "
                                                          "prompt/completion data).")
    gen.set_defaults(func=cmd_generate)


def cmd_serve(args: argparse.Namespace, rest: list[str]) -> int:
    """Serve the run's adapters over an OpenAI-compatible API until interrupted."""
    no_extra(rest)
    from ..serve import serve, serve_settings_for_run

    model_path = _model_path(args, " (serve also serves the base alone: --model without --adapter-path)")
    settings = serve_settings_for_run(
        model_path, args.adapter_path, args.system_prompt, model_name=args.model_name, host=args.host,
        port=args.port, max_request_bytes=args.max_request_bytes, max_tokens_limit=args.max_tokens_limit,
        max_tokens=min(512, args.max_tokens_limit) if args.max_tokens is None else args.max_tokens, temp=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        decode_concurrency=args.decode_concurrency, prompt_concurrency=args.prompt_concurrency,
        prefill_step_size=args.prefill_step_size, prompt_cache_size=args.prompt_cache_size)
    serve(settings, say=lambda line: print(line, flush=True))
    return 0


def add_serve(sub: Any) -> None:
    """`meshtune serve`: mlx_lm.server's flags that apply to one run, and the request bounds."""
    srv = sub.add_parser("serve", help="OpenAI-compatible chat/completions server over a run's adapters.",
                         description="mlx_lm.server's endpoints (/v1/chat/completions, /v1/completions, /health) "
                                     "over the base with the run's adapters, loaded by meshtune (every adapter "
                                     "type it trains). Chats without a system message get the one the run's data "
                                     "shared. Requests over the bounds below are refused with a 4xx.")
    srv.add_argument("--model", help=f"Base model (default: from {CONFIG_FILE} or the embedded one).")
    srv.add_argument("--adapter-path", help="The run's adapters (a run folder or one of its checkpoints).")
    srv.add_argument("--model-name", default="", help="The model name clients send (default: the adapter "
                                                      "folder's name; the base's path works too).")
    srv.add_argument("--system-prompt", default=None,
                     help="System message for chats that bring none (default: the run's; '' sends none).")
    srv.add_argument("--host", default="127.0.0.1", help="Address to listen on (default 127.0.0.1).")
    srv.add_argument("--port", type=int, default=8080, help="Port (default 8080; 0 picks a free one).")
    srv.add_argument("--max-request-bytes", type=int, default=1 << 20,
                     help="Largest request body accepted, in bytes (default 1 MiB; 413 above).")
    srv.add_argument("--max-tokens-limit", type=int, default=4096,
                     help="Largest max_tokens a request may ask for (default 4096; 400 above).")
    srv.add_argument("--max-tokens", type=int, default=None,
                     help="Default max_tokens of a request (default 512, or --max-tokens-limit when lower).")
    srv.add_argument("--temp", type=float, default=0.0, help="Default sampling temperature (default 0).")
    srv.add_argument("--top-p", type=float, default=1.0, help="Default top-p (default 1: off).")
    srv.add_argument("--top-k", type=int, default=0, help="Default top-k (default 0: off).")
    srv.add_argument("--min-p", type=float, default=0.0, help="Default min-p (default 0: off).")
    srv.add_argument("--decode-concurrency", type=int, default=32, help="Requests decoded together (default 32).")
    srv.add_argument("--prompt-concurrency", type=int, default=8, help="Prompts prefilled together (default 8).")
    srv.add_argument("--prefill-step-size", type=int, default=2048, help="Prompt tokens per prefill step.")
    srv.add_argument("--prompt-cache-size", type=int, default=10, help="Distinct KV caches kept (default 10).")
    srv.set_defaults(func=cmd_serve)


EXPORT_FORMATS = ("peft", "hf", "gguf")


def cmd_export(args: argparse.Namespace, rest: list[str]) -> int:
    """Write the run's result in another tool's format."""
    no_extra(rest)
    from ..export import export_gguf, export_hf, export_peft

    check_run_config(args.adapter_path)
    model_path = _model_path(args, "")
    if args.format == "peft":
        export_peft(args.adapter_path, args.save_path, model_path=model_path, base_model=args.base_model,
                    overwrite=args.overwrite)
    elif args.format == "hf":
        export_hf(model_path, args.adapter_path, args.save_path, overwrite=args.overwrite)
    else:
        export_gguf(model_path, args.adapter_path, args.save_path, overwrite=args.overwrite)
    return 0


def add_export(sub: Any) -> None:
    """`meshtune export --format peft|hf|gguf`."""
    exp = sub.add_parser("export", help="A run's adapters as PEFT, or the fused model as a Hugging Face folder or "
                                        "GGUF.",
                         description="peft: LoRA/DoRA adapters as adapter_config.json + adapter_model.safetensors "
                                     "with Hugging Face module names (transformers, vLLM, TGI). hf: the fused, "
                                     "dequantized model as a Hugging Face folder. gguf: that folder plus "
                                     "ggml-model-f16.gguf, for the families mlx-lm converts (llama, mistral, "
                                     "mixtral).")
    exp.add_argument("--format", required=True, choices=EXPORT_FORMATS, help="peft, hf or gguf.")
    exp.add_argument("--adapter-path", default="adapters", help="The run's folder (or one of its checkpoints).")
    exp.add_argument("--save-path", required=True, help="The folder to write.")
    exp.add_argument("--model", help=f"Base model (default: the one in {CONFIG_FILE}).")
    exp.add_argument("--base-model", default=None,
                     help="peft: the base_model_name_or_path to record, e.g. the Hugging Face id the MLX base was "
                          "converted from (default: --model).")
    exp.add_argument("--overwrite", action="store_true", help="Write into a --save-path that already holds files.")
    exp.set_defaults(func=cmd_export)
