"""The ratios `meshtune bench adapters` judges, their targets, and the verdict printed beside each.

Shared by one invocation's table (adapters.py) and several invocations' combined
table (adapters_runs.py).
"""

from __future__ import annotations

# meshtune's targets from the issue: (ratio key, bound, "<=" or ">=").
TARGETS = (("qlora_over_lora_step", 1.25, "<="), ("dora_over_lora_step_bf16", 1.10, "<="),
           ("dora_over_lora_step_4bit", 1.10, "<="), ("dora_over_lora_generate_4bit", 0.8, ">="))
# The judged ratios (meshtune's keys; stock's carry a "stock_" prefix) and their rows' text ({dense}: the dense dtype).
RATIO_ROWS = (("qlora_over_lora_step", "step, 4-bit LoRA / {dense} LoRA"),
              ("dora_over_lora_step_bf16", "step, DoRA / LoRA, {dense}"),
              ("dora_over_lora_step_4bit", "step, DoRA / LoRA, 4-bit"),
              ("dora_over_lora_generate_4bit", "generate tok/s, DoRA / LoRA, 4-bit"),
              ("dora_over_lora_generate_bf16", "generate tok/s, DoRA / LoRA, {dense}"))


def met_target(value: float, bound: float, op: str) -> bool:
    """Whether `value` meets `bound` under `op` ("<=" or ">=")."""
    return value <= bound if op == "<=" else value >= bound


# The 4-bit / dense LoRA target is set for a GPU (the issue's); on a CPU the figure is stated beside stock's.
CPU_QLORA_NOTE = " (the target is the GPU's; on the CPU the figure stands beside stock's)"


def target_verdict(key: str, value: float, on_cpu: bool = False) -> str:
    """'<= 1.10x met' (or missed) for a ratio with a target, '' for one without; `on_cpu` adds CPU_QLORA_NOTE to its row."""
    for target, bound, op in TARGETS:
        if target == key:
            note = CPU_QLORA_NOTE if on_cpu and key == "qlora_over_lora_step" else ""
            return f"{op} {bound:.2f}x {'met' if met_target(value, bound, op) else 'missed'}{note}"
    return ""
