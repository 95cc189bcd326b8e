"""Decode tokens/s of the adapters bench's four generation configurations per base, as the bench times them.

Development probe (adapters issue): the generation half of `meshtune bench adapters`
alone (interleaved rounds, `meshtune.bench.adapters.time_generate`), for a check that
cannot wait for the eight training configurations.
    python scripts/probes/generate_rounds.py [--preset 1b] [--rounds 5]
"""
import sys

from meshtune.bench import adapters as B

a = B._settings(sys.argv[1:])
dense = B.dense_dtype_name(a)
shape = B.shape_of(a)
print(f"{B.describe_device()}; {shape.describe()}; {a.gen_tokens} tokens, median of {B.generation_rounds(a)} rounds")
for base in B.BASES:
    tok_s = B.time_generate(base, a, shape, B.DTYPES[dense])
    for impl in B.IMPLS:
        lora, dora = tok_s[f"{impl}_lora_{base}"], tok_s[f"{impl}_dora_{base}"]
        print(f"{base:5s} {impl:9s} LoRA {lora:8.1f}  DoRA {dora:8.1f} tok/s  DoRA/LoRA {dora / lora:.2f}x")
    B._release()
