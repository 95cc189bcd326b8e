"""Whether one process's models of the same code differ in the host's build time (the compiled call), on the CPU
with the CUDA path stubbed (step_graph.py's stand-ins): three models each of LoRA and DoRA, 16 blocks at a small
width, timed in 8 interleaved rounds of 10 calls; each model's median, least and most ms a call.

Development probe (adapters issue): python scripts/probes/build_copies.py
"""
import sys, time, statistics
sys.path.insert(0, __import__("os").path.dirname(__file__))
import step_graph as G
import mlx.core as mx
from meshtune import cuda
from meshtune.adapters import kernels as K, step_norms
from meshtune.bench.models import Shape
K._kernel, K.on_cuda, cuda.on_cuda = G.stand_in, (lambda: True), (lambda: True)
step_norms._gpu_memory = lambda: 140 * 2**30
shape = Shape(arch="qwen3", layers=16, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=256)
class Batch: batch_size, seq_len = 1, 16
inst = {}
for kind in ["lora", "dora"]*3:
    step, state, tokens, lengths = G.meshtune_step(kind, Batch, shape, mx.float32)
    for _ in range(3):
        ce,n,_,_=step(tokens,lengths,None,None,True); mx.eval(state,ce,n)
    inst[f"{kind}{len(inst)//2}"] = (step, state, tokens, lengths)
times = {k: [] for k in inst}
for r in range(8):
    for k,(step,state,tokens,lengths) in inst.items():
        t=time.perf_counter()
        for _ in range(10):
            ce,n,_,_=step(tokens,lengths,None,None,True)
        times[k].append((time.perf_counter()-t)/10*1e3)
        mx.eval(state,ce,n)
for k,v in times.items(): print(k, "build ms median %.2f  min %.2f max %.2f" % (statistics.median(v), min(v), max(v)))
