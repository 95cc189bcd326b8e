"""One rank of a pipeline test (started by tests/*/test_pipeline.py through meshtune launch)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/, where conftest is
from support import tiny_llama  # noqa: E402

from meshtune.adapters import apply_adapters  # noqa: E402
from meshtune.runtime.mesh import Mesh  # noqa: E402
from meshtune.parallel.pipeline.executor import Pipeline  # noqa: E402


def make_model_and_batch(kind: str = "lora"):
    """The tied tiny model: LoRA on the blocks, LoRA also on the tied table, or everything trained."""
    model = tiny_llama(layers=4, dim=32, vocab=64, seed=0)
    if kind == "full":
        model.unfreeze()
    else:
        keys = ["self_attn.q_proj", "mlp.down_proj", "model.embed_tokens"] if kind == "lora-embed" else None
        apply_adapters(model, fine_tune_type="lora", num_layers=-1, keys=keys, rank=4, scale=10.0, dropout=0.0)
    for _, m in model.named_modules():
        if "lora_b" in m:
            m.lora_b = mx.random.normal(m.lora_b.shape, key=mx.random.key(1)) * 0.01
    tokens = mx.random.randint(1, 64, (4, 17), key=mx.random.key(2)).astype(mx.int32)
    lengths = mx.array([[2, 17], [5, 12], [1, 9], [3, 16]], dtype=mx.int32)
    mx.eval(model.parameters(), tokens, lengths)
    return model, tokens, lengths


def main() -> None:
    schedule_name, micro_batches, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    kind = sys.argv[4] if len(sys.argv) > 4 else "lora"
    transfer = sys.argv[5] if len(sys.argv) > 5 else None  # "all_sum": the NCCL path, forced on ring
    model, tokens, lengths = make_model_and_batch(kind)
    mesh = Mesh.from_world(mx.distributed.init(), pp=2)
    pipeline = Pipeline(model, optim.SGD(learning_rate=0.1), mesh, schedule=schedule_name, micro_batches=micro_batches,
                        transfer=transfer)
    print(f"TRANSFER {pipeline.stage.links.mode}", flush=True)
    losses, local = [], []
    for _ in range(2):  # the loss before each update, on every rank (only the last stage's sums are non-zero)
        [(loss_sum, tokens_n)], _ = pipeline.step(iter([SimpleNamespace(tokens=tokens, lengths=lengths)]))
        local.append([loss_sum.item(), tokens_n.item()])
        losses.append((mesh.all_sum(loss_sum) / mesh.all_sum(tokens_n)).item())
    print("LOCAL " + json.dumps(local), flush=True)  # this rank's own sums, before the all_sum above
    mx.save_safetensors(str(out / f"rank{mesh.rank}.safetensors"), dict(tree_flatten(model.trainable_parameters())))
    print("LOSSES " + json.dumps(losses), flush=True)


if __name__ == "__main__":
    main()
