"""How many operations a compiled meshtune step dispatches, by primitive, LoRA against DoRA.

Development probe (adapters issue), runs on the CPU: the bench's 16-layer model shape at a
small width (the count does not depend on width), meshtune's step compiled as training
compiles it, the graph of one call exported with mx.export_to_dot and its nodes counted.
With --cuda the CUDA code path is traced, each CUDA kernel standing in as one
`CustomTransforms` node (adapted_linear's own custom function is one more a layer, for
LoRA too), which is what a GPU would dispatch. Also the graph's arrays and edges (a stand-in's
edges count its forward's outputs as inputs too, so they overstate a CUDA kernel's).
    python scripts/probes/graph_nodes.py [--cuda] [--layers 16] [--outputs]
With --outputs, also the arrays the nodes make by the primitive making them (session 30, --cuda: DoRA's step
makes 5961 against LoRA's 5177: m's Adam updates +336 (three outputs each), the stand-ins +468 (the two
m/B-gradient kernels a layer, two outputs each, and the norm launches' 20 outputs), +378 Split parts
(the layers' views of the launches' W', A and B', and the nested splits' groups), against -224 AsType, -112 Matmul
and -112 Transpose).
"""
import argparse
import os
import re
import sys
import tempfile
from collections import Counter

import mlx.core as mx

sys.path.insert(0, os.path.dirname(__file__))


class StandIn:
    """One node per call in place of an mx.fast.cuda_kernel: a custom function (one
    CustomTransforms node, depending on every input) whose outputs are constants."""

    def __call__(self, *, inputs, output_shapes, output_dtypes, **_):
        @mx.custom_function
        def kernel(*xs):
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

        @kernel.vjp
        def kernel_vjp(primals, cotangents, outputs):
            return [mx.zeros_like(x) for x in primals]

        return kernel(*inputs)


def stand_in_cuda_kernels():
    """Trace meshtune's CUDA code path here: every CUDA kernel a StandIn."""
    from meshtune import multi_adam
    from meshtune.adapters import kernels
    from meshtune.parallel import pack_kernel
    kernels.on_cuda = multi_adam.on_cuda = lambda: True
    kernels._kernel = pack_kernel.kernel = multi_adam._kernel = lambda *a, **k: StandIn()


def count(kind, layers, cuda, optimizer=None, quantized=False):
    """(nodes by primitive, {"arrays": n, "edges": n}) of one compiled step's graph."""
    from _steps import meshtune_step
    from meshtune.bench import adapters as B
    from meshtune.bench.models import Shape

    a = B._settings(["--preset", "tiny"])
    shape = Shape(arch="qwen3", layers=layers, hidden=128, intermediate=384, heads=4, kv_heads=2, vocab=512)
    extra = {"optimizer": optimizer} if optimizer else {}
    extra["quantized"] = quantized
    step, state, tokens, lengths = meshtune_step(kind, a, shape, mx.bfloat16 if cuda else mx.float32, **extra)
    mx.eval(state)
    out = step(tokens, lengths, None, None, True)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "g.dot")
        mx.export_to_dot(path, *[x for x in (out[0], out[1]) if isinstance(x, mx.array)],
                         *[v for v in _leaves(state)])
        text = open(path).read()
    names = re.findall(r'label\s*=\s*"([A-Za-z_]+)', text)
    edges = re.findall(r'^"?(\w+)"? -> "?(\w+)"?$', text, re.M)
    # arrays: every end of an edge that is not an operation's node (the graph's inputs among them)
    nodes = set(re.findall(r'\{ (\d+) \[label', text))
    arrays = {end for edge in edges for end in edge if end not in nodes}
    op_of = dict(re.findall(r'\{ (\d+) \[label\s*=\s*"([A-Za-z_]+)', text))  # an operation's node: its primitive
    outputs = Counter(op_of[src] for src, dst in edges if dst in arrays and src in op_of)
    return (Counter(n for n in names if not n.startswith("array")),
            {"arrays": len(arrays), "edges": len(edges), "outputs": outputs})


def _leaves(tree):
    from mlx.utils import tree_flatten
    return [v for _, v in tree_flatten(tree) if isinstance(v, mx.array)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cuda", action="store_true")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--outputs", action="store_true", help="also the output arrays by the primitive making them")
    p.add_argument("--quantized", action="store_true",
                   help="4-bit bases (group 64) on the dequantized path, as at the 1B step's token count")
    p.add_argument("--packed-m", action="store_true",
                   help="DoRA's step with packed_magnitudes.PackedMagnitudesAdam (every m updated as one vector)")
    args = p.parse_args()
    if args.cuda:
        stand_in_cuda_kernels()
    optimizer = None
    if args.packed_m:
        import packed_magnitudes
        optimizer = packed_magnitudes.PackedMagnitudesAdam
        if args.cuda:
            packed_magnitudes.on_cuda = lambda: True
    if args.quantized:
        from meshtune.adapters import base_path
        base_path.set_base_path("dequantized")
    counted = {k: count(k, args.layers, args.cuda, optimizer if k == "dora" else None, args.quantized)
               for k in ("lora", "dora")}
    res = {k: nodes for k, (nodes, _) in counted.items()}
    keys = sorted(set(res["lora"]) | set(res["dora"]), key=lambda k: -(res["dora"][k] - res["lora"][k]))
    print(f"compiled step, {args.layers} layers{', 4-bit bases' if args.quantized else ''}, "
          f"{'CUDA path (a kernel: one CustomTransforms)' if args.cuda else 'CPU path'}: nodes")
    print(f"{'primitive':28s} {'lora':>6s} {'dora':>6s}")
    for k in keys:
        print(f"{k:28s} {res['lora'][k]:6d} {res['dora'][k]:6d}")
    print(f"{'total':28s} {sum(res['lora'].values()):6d} {sum(res['dora'].values()):6d}")
    for k in ("arrays", "edges"):  # what the compiled call builds besides the nodes
        print(f"{k:28s} {counted['lora'][1][k]:6d} {counted['dora'][1][k]:6d}")
    if args.outputs:  # the arrays the nodes make, by the primitive making them, where LoRA's and DoRA's differ
        out = {k: counted[k][1]["outputs"] for k in counted}
        print("output arrays by primitive, where they differ")
        for k in sorted(set(out["lora"]) | set(out["dora"]), key=lambda k: -(out["dora"][k] - out["lora"][k])):
            if out["dora"][k] != out["lora"][k]:
                print(f"{k[:60]:60s} {out['lora'][k]:6d} {out['dora'][k]:6d}")
        print(f"{'total':60s} {sum(out['lora'].values()):6d} {sum(out['dora'].values()):6d}")


if __name__ == "__main__":
    main()
