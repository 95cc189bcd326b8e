"""The fastest row-norm block in a dora_kernel_cost.py output, as a shell line for the next run on the same machine.

Development probe (adapters issue): python pick_norm_block.py kernel_cost.txt > best.env
Reads the "W' block w,q,g" rows (the folded step's kernel: warps, rows a warp, groups a block)
and prints `export MESHTUNE_DORA_NORM_BLOCK=w,q,g` for the lowest eval time (kernels.py reads it).
"""
import re
import sys

rows = []
for line in open(sys.argv[1], encoding="utf-8", errors="replace"):
    hit = re.match(r"\s*W' block (\d+,\d+,\d+)\s+([\d.]+)\s+([\d.]+)", line)
    if hit:
        rows.append((float(hit.group(3)), hit.group(1)))
if not rows:
    sys.exit("pick_norm_block: no \"W' block\" rows in " + sys.argv[1])
best_ms, best = min(rows)
print(f"export MESHTUNE_DORA_NORM_BLOCK={best}  # {best_ms:.2f} ms; " + ", ".join(f"{b} {ms:.2f}" for ms, b in rows))
