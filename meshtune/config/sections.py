"""The sections of a run configuration: one small keyword-only dataclass per concern.

Each field's docstring is its help text (read by :mod:`meshtune.config.fields`).
:data:`SECTIONS` names them in the order a config file lists them, and
:class:`ConfigError` is the one error every loading and checking step raises. This
module imports nothing of meshtune: the rest of the package builds on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

ASSETS = Path(__file__).parents[1] / "assets"
DEFAULT_MODEL_PATH = ASSETS / "tiny-llama"
DEFAULT_DATA_PATH = ASSETS / "data" / "arithmetic"


class ConfigError(ValueError):
    """One or more configuration problems, each a self-contained line."""

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            message = f"{len(self.problems)} configuration problems:\n{lines}"
        super().__init__(message)


@dataclass(kw_only=True)
class ModelConfig:
    """The model to fine-tune."""

    path: str = ""
    """Local model folder; "" uses the tiny model shipped in meshtune/assets/tiny-llama."""
    trust_remote_code: bool = False
    """Let the tokenizer run code that ships with the model."""


@dataclass(kw_only=True)
class DataConfig:
    """The training data and how it becomes token batches."""

    path: str = ""
    """Folder with train/valid/test.jsonl or .parquet, a Hugging Face dataset folder (save_to_disk) or a
    hub dataset id; "" uses the arithmetic data in meshtune/assets/data/arithmetic."""
    max_seq_length: int = 2048
    """Longest sequence in tokens; longer examples are truncated (see truncate)."""
    truncate: bool = True
    """Cut examples longer than max_seq_length, with one warning per split saying how many
    (mlx-lm's behaviour); false makes such an example an error naming its file and line."""
    mask_prompt: bool = False
    """Leave prompt tokens out of the loss (prompt/completion and chat data)."""
    skip_empty: bool = False
    """Skip examples with nothing to learn (an empty completion, text or last message, or a
    completion cut off by max_seq_length), with one warning per split giving the count and the
    first file:line; false (the default) makes such an example an error naming its file and line.
    A message with a role other than system/user/assistant/tool is an error either way."""
    changed_ok: bool = False
    """With --resume: go on from the saved position even though the training data's content changed
    since the checkpoint (its digest differs); false (the default) makes that an error."""
    pad_to: int = 32
    """Pad batch lengths up to a multiple of this many tokens."""
    prompt_feature: str = "prompt"
    """JSONL field holding the prompt of a prompt/completion example."""
    completion_feature: str = "completion"
    """JSONL field holding the completion of a prompt/completion example."""
    text_feature: str = "text"
    """JSONL field holding the text of a plain-text example."""
    chat_feature: str = "messages"
    """JSONL field holding the message list of a chat example."""
    train_split: str = ""
    """Split of a Hugging Face dataset (saved folder, parquet or hub id) to train on, with the
    datasets library's slicing (e.g. train[:80%]); "" takes train."""
    valid_split: str = ""
    """Split to validate on (e.g. train[-10%:]); "" takes valid, else validation."""
    test_split: str = ""
    """Split to test on; "" takes test."""
    pack: bool = False
    """Pack short training examples into rows (batch_size then counts rows) of pack_length tokens;
    each example attends only to itself and keeps its own relative positions (RoPE models), and its
    loss is unchanged. Evaluation batches stay unpacked."""
    pack_length: int = 0
    """Tokens per packed row (data.pack), at least the longest example; 0: max_seq_length where it was
    given, else the length that trains the data fastest per target token on this model (the run says
    it at start and records it here, so a resume packs alike)."""


def full_needs_dense(what: str) -> str:
    """The one-line refusal of full fine-tuning on a quantized base (train, and plan before it)."""
    return (f"adapter.fine_tune_type=full: {what} is quantized, and full fine-tuning trains the weights "
            "themselves; pass --fine-tune-type lora (or dora), or give a dense model (the original, or "
            "mlx_lm.convert --hf-path MODEL --mlx-path DENSE --dequantize)")


@dataclass(kw_only=True)
class AdapterConfig:
    """What is trained: LoRA/DoRA adapters or the full weights."""

    fine_tune_type: Literal["lora", "dora", "full"] = "lora"
    """lora, dora or full (train the weights of the chosen blocks)."""
    num_layers: int = 16
    """How many transformer blocks, counted from the last, to train; -1 trains all."""
    keys: list[str] | None = None
    """Module paths inside a block to adapt, e.g. [self_attn.q_proj, self_attn.v_proj];
    unset adapts every linear layer."""
    rank: int = 8
    """LoRA/DoRA rank (unused by full fine-tuning)."""
    scale: float = 20.0
    """Multiplier on the adapter output (mlx-lm's scale, not peft's alpha)."""
    dropout: float = 0.0
    """Dropout on the adapter input, in [0, 1)."""
    base_path: Literal["auto", "quantized", "dequantized"] = "auto"
    """How a quantized base multiplies: auto picks quantized_matmul for few tokens and
    dequantize + dense matmul for many, by a measurement at start-up; or force either."""
    dora_fold: bool | Literal["auto"] = "auto"
    """On an NVIDIA GPU, whether DoRA's training step folds each layer's row scale into its weights
    (one product on the adapted weight, docs/performance.md): "auto" folds a quantized base always and
    dense bases while their folded copies take at most 1/8 of the GPU's memory; true always, false never."""
    init_from: str = ""
    """Trained adapters to start from: a run folder or its adapters.safetensors (stock mlx-lm's
    too), of this kind and shape; the optimizer and the step start fresh (mlx-lm's
    resume_adapter_file). --resume continues a run instead."""


@dataclass(kw_only=True)
class OptimizerConfig:
    """The optimizer and its settings."""

    name: Literal["adam", "adamw", "sgd", "adafactor", "muon"] = "adam"
    """adam, adamw, sgd, adafactor or muon (the mlx.optimizers classes)."""
    learning_rate: float = 1e-5
    """Peak learning rate; a schedule starts from it (after warmup)."""
    weight_decay: float | None = None
    """Weight decay; unset keeps the optimizer's own default (adam has none)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the mlx optimizer, e.g. {betas: [0.9, 0.98], eps: 1e-6}."""


@dataclass(kw_only=True)
class ScheduleConfig:
    """How the learning rate changes over the run."""

    name: Literal["constant", "cosine_decay", "linear_schedule", "exponential_decay", "step_decay"] = "constant"
    """constant or an mlx.optimizers.schedulers function name."""
    arguments: list[float] | None = None
    """Arguments of the schedule function, the initial rate first (as mlx-lm's
    lr_schedule.arguments); unset derives them from learning_rate and iters."""
    warmup: int = 0
    """Steps of linear warmup before the schedule starts."""
    warmup_init: float = 0.0
    """Learning rate at the first warmup step."""


@dataclass(kw_only=True)
class TrainConfig:
    """The training loop."""

    iters: int = 1000
    """Optimizer steps to run."""
    batch_size: int = 4
    """Global batch: examples per step summed over all data-parallel ranks."""
    grad_accumulation_steps: int = 1
    """Batches whose gradients are summed before each optimizer update."""
    grad_checkpoint: bool = False
    """Recompute activations in the backward pass to save memory."""
    max_grad_norm: float = 0.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    skip_nonfinite_steps: int = 0
    """Bad steps (non-finite gradient norm, or no target tokens) to skip, update not applied, before
    the next one stops the run with exit 65; 0: the first one stops it."""
    divergence_reports: int = 5
    """Train reports in a row whose loss sits at ln(vocabulary size) (every token predicted alike) or
    far above the first report's, after which the run stops as diverged (exit 65); 0 trains on."""
    seed: int = 0
    """Seed for shuffling, initialisation and dropout."""
    steps_per_report: int = 10
    """Steps between training-loss reports."""
    steps_per_eval: int = 200
    """Steps between validation runs."""
    val_batches: int = 25
    """Validation batches per evaluation; -1 uses the whole validation set, 0 skips validation."""
    save_every: int = 100
    """Steps between adapter checkpoints."""
    test: bool = False
    """Evaluate on test.jsonl after training."""
    test_batches: int = 500
    """Test batches to evaluate; -1 uses the whole test set."""
    compile: bool = True
    """Compile the training step with mx.compile."""


@dataclass(kw_only=True)
class OutputConfig:
    """Where results go."""

    adapter_path: str = "adapters"
    """Folder for adapter weights, checkpoints and the saved config."""
    resume: bool = False
    """Continue from the latest checkpoint in adapter_path."""
    overwrite: bool = False
    """Replace an earlier run found in adapter_path instead of refusing to start."""
    keep_last_n: int = 0
    """Numbered checkpoints to keep, newest first, pruned after each successful save (the
    one just written always stays); 0, the default, keeps all: nothing is deleted unless asked."""
    report_to: list[str] | str | None = None
    """Where else reports go, besides metrics.jsonl: tensorboard, wandb, or both (a list or
    "tensorboard,wandb"); written by rank 0 into the adapter folder (extras meshtune[tensorboard], meshtune[wandb])."""
    project_name: str = ""
    """The Weights & Biases project of a run with report_to wandb (empty: meshtune)."""


@dataclass(kw_only=True)
class ParallelConfig:
    """How the run is spread over the machines of a distributed group."""

    dp: int = 0
    """Data-parallel ranks; 0 derives world size / pp."""
    pp: int = 1
    """Pipeline stages the model is split into."""
    pipeline_stages: int = 0
    """The same as pp under its long name (0: unset); give one of the two."""
    schedule: Literal["naive", "gpipe", "1f1b"] = "1f1b"
    """Pipeline schedule: naive, gpipe or 1f1b."""
    micro_batches: int = 0
    """Micro-batches per local batch in the pipeline; 0 uses pp."""
    stage_layers: list[int] | None = None
    """Transformer blocks per pipeline stage, e.g. [5, 3]: pp counts of at least 1 that
    add up to the model's blocks; unset balances stages by parameter count (the
    embedding counts on the first stage, final norm and head on the last)."""
    grad_sync: Literal["after_backward", "overlap"] = "after_backward"
    """after_backward: bucketed all-reduce once the backward is done (stock mlx-lm);
    overlap: buckets in reverse layer order on a communication stream, each free to
    run as soon as its gradients exist."""
    bucket_mb: float = 25.0
    """Gradient bucket size in MB for the all-reduce."""
    transport: Literal["mlx", "sockets"] = "mlx"
    """How gradients travel between data-parallel ranks: mlx (the backend's all_sum) or
    sockets (ring backend only: meshtune's ring all-reduce over blocking TCP on its own
    thread; MLX's ring busy-polls a core, which a one-core-per-rank run cannot spare
    for overlap). Token counts, losses and agreements stay on the MLX group."""

    def __post_init__(self) -> None:
        # One name from here on: the long one read as pp before anything builds the mesh.
        if isinstance(self.pipeline_stages, int) and self.pipeline_stages > 0 and self.pp == 1:
            self.pp = self.pipeline_stages


@dataclass(kw_only=True)
class RuntimeConfig:
    """Process-level settings."""

    system_blas: bool = True
    """Use a system OpenBLAS on Linux when one is present."""
    watchdog_s: float = 60.0
    """With several ranks: seconds without a finished step (or eval batch) before this
    rank gives up on its peers and exits with code 75; 0 disables."""
    fast_cpu_activations: bool = True
    """On the CPU, compute SwiGLU's SiLU with a vectorised exp (float32, ~1e-7 relative)
    instead of MLX's element-by-element one; false keeps mlx-lm's activation."""
    memory_limit_gb: float = 0.0
    """GB one rank may use. Before its first step, a run whose plan (meshtune plan's estimate for its
    layout and its longest row) needs more than 1.2x that stops with one line naming the flags that
    make it fit; 0 takes this device's (a GPU's memory, else the RAM available), -1 skips the check."""
    keep_freed_memory: bool = True
    """On Linux (glibc), keep freed memory in the process so each step's large arrays
    reuse the previous step's pages instead of page-faulting fresh ones (meshtune/runtime/heap.py);
    the process then holds its peak memory. False leaves malloc's defaults."""
    overlap_steps: bool | Literal["auto"] = "auto"
    """Build and dispatch each micro-batch's step (and each evaluation batch) while the
    device still runs the one before (one in flight), instead of waiting for it first: the
    host's part of a step (building the graph, launching its kernels) then hides behind the device's.
    "auto": on a GPU (`meshtune bench adapters` times it; docs/performance.md), off on the
    CPU; true or false forces it. The
    results are the same either way; a step in flight can hold up to one more step's
    activations while the next one is dispatched, so false where device memory is tight."""


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "adapter": AdapterConfig,
    "optimizer": OptimizerConfig,
    "schedule": ScheduleConfig,
    "train": TrainConfig,
    "output": OutputConfig,
    "parallel": ParallelConfig,
    "runtime": RuntimeConfig,
}

# Keyword arguments of the mlx 0.32 optimizer constructors besides
# learning_rate, so a misspelt option fails at load time rather than after
# the model has loaded.
OPTIMIZER_OPTIONS: dict[str, frozenset[str]] = {
    "adam": frozenset({"betas", "eps", "bias_correction"}),
    "adamw": frozenset({"betas", "eps", "weight_decay", "bias_correction"}),
    "sgd": frozenset({"momentum", "weight_decay", "dampening", "nesterov"}),
    "adafactor": frozenset({"eps", "clip_threshold", "decay_rate", "beta_1", "weight_decay",
                            "scale_parameter", "relative_step", "warmup_init"}),
    "muon": frozenset({"momentum", "weight_decay", "nesterov", "ns_steps"}),
}

