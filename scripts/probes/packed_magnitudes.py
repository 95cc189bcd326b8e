"""Adam with every DoRA magnitude m updated as one packed vector: one fused update a step, not one a layer.

Development probe (adapters issue): not used by meshtune. A compiled DoRA step carries one
fused Adam update per layer for m (112 for the 1B bench model, each on a vector of a few
thousand floats; scripts/probes/graph_nodes.py), launches whose work is tiny. Here the
magnitudes' gradients and values are packed (one kernel each on CUDA, parallel/pack_kernel.py),
updated once, and sliced back; Adam is elementwise, so the result is the per-layer one.
probe_dora_step.py times it ("Adam on m packed"); tests/test_probe_packed_magnitudes.py
checks it against plain Adam.
"""
import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from meshtune.cuda import on_cuda
from meshtune.parallel.pack_kernel import pack_cuda


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
        start = 0
        for k in keys:
            n = values[k].size
            updated[k] = new[start:start + n].astype(values[k].dtype)
            start += n
        return tree_unflatten(list(updated.items()))
