"""Adam with every DoRA magnitude m updated as one packed vector: one fused update a step, not one a layer.

Development probe (adapters issue): not used by meshtune. A compiled DoRA step carries one
fused Adam update per layer for m (112 for the 1B bench model, each on a vector of a few
thousand floats; scripts/probes/graph_nodes.py), launches whose work is tiny. Here the
magnitudes' gradients and values are packed (one kernel each on CUDA, parallel/pack_kernel.py),
updated once, and cut back into the layers' vectors by nested splits (split_views: a Split node
per 10 parts, where slices made a node a layer); Adam is elementwise, so the result is the per-layer one.
probe_dora_step.py times it ("Adam on m packed"); tests/test_probe_packed_magnitudes.py
checks it against plain Adam.

It saves no graph node (`python scripts/probes/graph_nodes.py --cuda --packed-m`: DoRA 4957 nodes against 4943
with per-layer Adam, LoRA 4729): in a compiled step each m's Adam update is one fused kernel together with
train.apply's division of its gradient by the token count; packed, the division stays one kernel a layer
(CompiledBroadcastDivide, 112) and the packs and splits come on top. Only magnitudes held packed through the
whole step (the model's m as views of one trained vector) would take those 112 nodes out.
"""
import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from meshtune.cuda import on_cuda
from meshtune.parallel.pack_kernel import pack_cuda


def split_views(x, sizes):
    """x (1-D) cut into consecutive parts of `sizes`, views of it, from nested splits of at most
    kernels.SPLIT_PARTS parts each (MLX makes a Slice node a part beyond that many: kernels.layer_views)."""
    from meshtune.adapters.kernels import SPLIT_PARTS

    if len(sizes) == 1:
        return [x]
    if len(sizes) <= SPLIT_PARTS:
        bounds = [sum(sizes[:i]) for i in range(1, len(sizes))]
        return mx.split(x, bounds)
    # Groups of SPLIT_PARTS parts at the bottom (a Split node each), the groups themselves cut the same way above.
    groups = [sizes[i:i + SPLIT_PARTS] for i in range(0, len(sizes), SPLIT_PARTS)]
    parts = split_views(x, [sum(g) for g in groups])
    return [view for part, g in zip(parts, groups) for view in split_views(part, g)]


def _pack(arrays):
    if on_cuda():
        return pack_cuda(arrays, mx.float32)
    return mx.concatenate([a.reshape(-1).astype(mx.float32) for a in arrays])


class PackedMagnitudesAdam(optim.Adam):
    """optim.Adam, the DoRA magnitudes (parameters named m, one axis) updated as one vector."""

    def apply_gradients(self, gradients, parameters):
        grads = tree_flatten(gradients)
        keys = [k for k, g in grads if k.split(".")[-1] == "m" and g.ndim == 1]
        if not keys:
            return super().apply_gradients(gradients, parameters)
        chosen = set(keys)
        # The rest first: that sets this step's learning rate and count, which the packed update uses too.
        updated = dict(tree_flatten(super().apply_gradients(
            tree_unflatten([(k, g) for k, g in grads if k not in chosen]), parameters)))
        values = dict(tree_flatten(parameters))
        grads = dict(grads)
        p = _pack([values[k] for k in keys])
        if "packed_m" not in self.state:
            self.state["packed_m"] = {}
            self.init_single(p, self.state["packed_m"])
        new = self.apply_single(_pack([grads[k] for k in keys]), p, self.state["packed_m"])
        for k, view in zip(keys, split_views(new, [values[k].size for k in keys])):
            updated[k] = view.reshape(values[k].shape).astype(values[k].dtype)
        return tree_unflatten(list(updated.items()))
