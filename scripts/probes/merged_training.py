"""Whether DoRA trains the same with the merged fold's bfloat16 W' = rs (W + s (A B)^T) as without it, on the CPU.

Development probe (adapters issue). The merged fold (kernels.MERGED_FOLD, CUDA) rounds the whole adapted weight to
the base's dtype each step, so an adapter update smaller than half an ulp of a weight element is not seen by the
forward until it grows; the unmerged fold rounds rs W and keeps LoRA's branch beside it. Here each form is emulated
in MLX ops on the CPU (the same W', rs and norm the launch writes, then adapted_linear as the step calls it) on a
small bfloat16 Qwen3-shaped model, DoRA on every linear layer, trained with Adam on a learnable synthetic sequence
task (each next token a fixed function of the last); the three forms start from the same weights and batches.

    python scripts/probes/merged_training.py [--steps 150] [--lr 1e-3]
"""
import argparse

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

from meshtune.adapters import dora as D
from meshtune.adapters.adapted_linear import adapted_linear
from meshtune.bench.models import Shape, add_adapters, build_model

ORIGINAL = D.DoRALinear.__call__


def folded(merged: bool):
    """DoRALinear's training call with W' as the folded step's launch writes it (merged or rs W), in MLX ops."""
    def call(self, x):
        w = self.linear.weight
        w32 = w.astype(mx.float32)
        a, b = mx.stop_gradient(self.lora_a), mx.stop_gradient(self.lora_b)
        dense = w32 + self.scale * (a @ b).T
        norm = mx.sqrt((dense * dense).sum(-1))
        rs = (mx.stop_gradient(self.m) / norm).astype(w.dtype).astype(mx.float32)
        w_prime = (rs[:, None] * (dense if merged else w32)).astype(w.dtype)
        return adapted_linear(x, w_prime, self.lora_a, self.lora_b, self.scale, magnitude=self.m, w_sq=self._w_sq,
                              norm=norm, row_scale=rs, merged=merged)
    return call


def batch(key, size, length, vocab):
    """Sequences t_{k+1} = (5 t_k + 3) mod vocab from random starts."""
    start = mx.random.randint(0, vocab, (size, 1), key=key)
    seq = start
    cols = [start]
    for _ in range(length - 1):
        seq = (5 * seq + 3) % vocab
        cols.append(seq)
    return mx.concatenate(cols, axis=1)


def train(form, args):
    shape = Shape(arch="qwen3", layers=2, hidden=128, intermediate=256, heads=4, kv_heads=2, vocab=args.vocab)
    model = build_model(shape, mx.bfloat16, quantized=False, seed=0)
    add_adapters(model, impl="meshtune", kind="dora", num_layers=-1, rank=8, scale=20.0)
    model.train()
    D.DoRALinear.__call__ = ORIGINAL if form == "MLX ops (CPU path)" else folded(form == "merged fold")
    opt = optim.Adam(learning_rate=args.lr)

    def loss_fn(model, tokens):
        logits = model(tokens[:, :-1]).astype(mx.float32)
        return nn.losses.cross_entropy(logits, tokens[:, 1:]).mean()

    loss_and_grad = nn.value_and_grad(model, loss_fn)
    losses = []
    keys = mx.random.split(mx.random.key(1), args.steps)
    for i in range(args.steps):
        loss, grads = loss_and_grad(model, batch(keys[i], 8, 33, args.vocab))
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        losses.append(loss.item())
    D.DoRALinear.__call__ = ORIGINAL
    held_out = batch(mx.random.key(99), 32, 33, args.vocab)
    model.eval()
    return losses, loss_fn(model, held_out).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--vocab", type=int, default=256)
    args = p.parse_args()
    results = {form: train(form, args) for form in ("MLX ops (CPU path)", "unmerged fold", "merged fold")}
    marks = sorted({0, args.steps // 10, args.steps // 4, args.steps // 2, args.steps - 1})
    print(f"bfloat16 DoRA, rank 8, scale 20, Adam lr {args.lr}, {args.steps} steps of 8 x 32 tokens; training loss at steps "
          + ", ".join(str(m + 1) for m in marks) + ", then held-out loss (eval forward: unfolded)")
    for form, (losses, held) in results.items():
        print(f"  {form:<20}" + "".join(f"{losses[m]:9.4f}" for m in marks) + f"   held-out {held:.4f}")


if __name__ == "__main__":
    main()
