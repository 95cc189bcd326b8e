"""Training: the loop, the strategy interface it calls, and what every strategy shares (loss, update,
evaluation, optimizers, checkpoints, metrics)."""

# Exit code of a run stopped by a non-finite step (loop.NonFiniteStep); here, without MLX, for the launcher.
NONFINITE_EXIT_CODE = 65  # EX_DATAERR: a step went non-finite; --resume from the last good checkpoint
OUT_OF_MEMORY_EXIT_CODE = 71  # EX_OSERR: an allocation failed; the advice line says what makes the run fit
STOPPED_EXIT_CODE = 3  # stopped on request (SIGTERM/SIGINT): a checkpoint saved, --resume continues

# The chunked head loss's shape (head_loss.py); here, without MLX, for the planner (plan/memory.py).
HEAD_CHUNK_TOKENS = 1024
"""Tokens per chunk: 1024 x 151,936 bfloat16 logits are 0.3 GB, and a 1024-row matmul runs the
head at the GPU's full rate."""
HEAD_THEN_LOGITS = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "phi3", "phimoe",
                              "gemma", "gemma3_text", "olmo2", "starcoder2", "glm4", "smollm3", "deepseek_v3"})
"""mlx-lm model types whose Model.__call__ is `head(self.model(inputs, cache))` and nothing else
(no logit scaling or soft-capping), the head being `lm_head` or the tied embedding's `as_linear`."""

# Chunked attention's shape (attention.py); here, without MLX, for the planner (plan/memory.py).
ATTENTION_CHUNK = 512
"""Query rows a chunk: 16 heads x 512 x 32,768 float32 scores are 1 GB."""
ATTENTION_CHUNKED_FROM = 2000
"""Model inputs from which attention.attention chunks (a 2,048-token row's 2,047 included). On the
2-core CPU (8 heads, 4 kv heads, head dim 64, float32, compiled) a causal forward and backward took
0.46 s chunked against 0.82 s whole at 2,048 tokens, and 1.8-2.1 s against 3.8 s at 4,096 (a probe's
figures); rows under 2,000 inputs keep mlx-lm's own attention."""

# Which Adam updates run in place (update.py); here, without MLX, for the planner (plan/estimate.py).
IN_PLACE_FROM = 1 << 20
"""Elements from which a parameter's Adam update runs in place (update._gated_adam); smaller ones take
one kernel, where launching two more costs more than the copy saves."""
