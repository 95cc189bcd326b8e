"""`meshtune plan`: memory per rank and traffic per step for each way to lay a run on N ranks.

`plan(cfg, ranks, memory_gb, link)` reads the model's config.json and safetensors headers
(model_facts.py; no weights load, no MLX), lists the layouts (layouts.py), estimates each
rank's memory by part (memory.py, estimate.py) and recommends one; report.py prints it.
The estimate is a formula of the shapes; docs/plan.md gives its measured error.
"""

from __future__ import annotations

from typing import Any

from .estimate import layout_figures
from .layouts import candidates, parse_link
from .memory import attention_kind, trained
from .model_facts import DTYPE_BYTES, EMBEDDINGS, block_of, read_model

__all__ = ["parse_link", "plan"]


def plan(cfg: Any, ranks: int, memory_gb: float, link: str, seq_len: int | None = None,
         nvidia: bool | None = None, links: int = 1, seq_len_from: str | None = None) -> dict[str, Any]:
    """Every candidate layout of `cfg` on `ranks` ranks with `memory_gb` each, and the recommended one.

    `link` is one link's rate and `links` how many each rank has (a hostfile's addresses per host): MLX's
    ring stripes every all-reduce across them, so a rank sends at `links` times the rate.

    `nvidia`: the ranks are NVIDIA GPUs, whose attention has a fused backward in bfloat16 and float16;
    None: as this machine is (its CUDA driver asked, no MLX). `seq_len_from`: where a `seq_len` the caller
    worked out comes from (plan/data_lengths.py), in words; None: the --seq-len flag."""
    if ranks < 1:
        raise ValueError(f"--ranks {ranks}: give at least 1 rank")
    if not memory_gb > 0:
        raise ValueError(f"--memory-gb {memory_gb}: give the memory of one rank in GB, e.g. --memory-gb 64")
    if links < 1:
        raise ValueError(f"--links {links}: give the links (cables) each rank has, at least 1")
    link_bytes_s = parse_link(link) * links
    longest = cfg.data.max_seq_length
    packed = cfg.data.pack_length if cfg.data.pack else None  # a packed run's rows are this long
    seq = (packed or longest) if seq_len is None else seq_len
    if seq < 1:
        raise ValueError(f"--seq-len {seq}: give the tokens per example, e.g. --seq-len 512")
    if seq > longest:  # a run cuts every example to max_seq_length: no batch is wider
        raise ValueError(f"--seq-len {seq} is longer than data.max_seq_length={longest}, to which a run cuts every "
                         f"example; give --seq-len {longest} or less, or raise --max-seq-length")
    facts = read_model(cfg.resolved_model_path())
    if nvidia is None:
        from ..runtime.gpu_batches import compute_capability

        nvidia = compute_capability() is not None
    fused = nvidia and facts.activation_dtype_bytes == 2  # MLX's cuDNN attention: bfloat16 and float16
    items = trained(facts, cfg.adapter)
    costs, first, last = _split_costs(facts, items)
    layouts = candidates(ranks, batch_size=cfg.train.batch_size, blocks=facts.num_blocks,
                         micro_batches=cfg.parallel.micro_batches, stage_layers=cfg.parallel.stage_layers,
                         block_costs=costs, first_extra=first, last_extra=last,
                         grad_checkpoint=cfg.train.grad_checkpoint, transport=cfg.parallel.transport)
    rows = []
    for layout in layouts:
        row = {"layout": layout.name, "dp": layout.dp, "pp": layout.pp, "ranks": layout.ranks,
               "stage_layers": layout.stage_layers, "micro_batches": layout.micro_batches, "problem": layout.problem}
        if not layout.problem or "grad_checkpoint" in layout.problem:
            row.update(layout_figures(layout, facts, cfg, items, seq=seq, link_bytes_s=link_bytes_s,
                                      fused_backward=fused))
            row["fits"] = row["total"] <= memory_gb * 1e9
        else:
            row["fits"] = False
        rows.append(row)
    given = seq_len is not None and seq_len_from is None  # --seq-len itself
    choice, reason = recommend(rows, ranks, memory_gb, shorter="--seq-len" if given else "--max-seq-length")
    one = rows[0]  # one process: where it does not fit, the pipeline stages that divide the weights enough
    stages = None if one.get("fits") else stages_to_fit(facts, cfg, items, seq, memory_gb, link_bytes_s, fused,
                                                        (costs, first, last))
    if stages is not None and choice is None:
        reason += f"; {stages} pipeline stages fit ({stages} ranks, --parallel.pp {stages})"
    return {
        "model": str(facts.path), "blocks": facts.num_blocks, "weights_by_kind": facts.weight_bytes(),
        "trainable_params": sum(i.params for i in items), "fine_tune_type": cfg.adapter.fine_tune_type,
        "optimizer": cfg.optimizer.name, "batch_size": cfg.train.batch_size, "seq_len": seq,
        "seq_len_from": seq_len_from or ("--seq-len" if seq_len is not None else
                                         "data.pack_length" if packed else "data.max_seq_length"),
        "grad_checkpoint": cfg.train.grad_checkpoint, "schedule": cfg.parallel.schedule,
        "attention": attention_kind(seq, fused),
        "ranks": ranks, "memory_gb": memory_gb, "link": link, "links": links, "link_bytes_per_s": link_bytes_s,
        "layouts": rows, "recommended": choice, "reason": reason, "stages_to_fit": stages,
    }


def stages_to_fit(facts: Any, cfg: Any, items: list[Any], seq: int, memory_gb: float, link_bytes_s: float,
                  fused: bool, split: tuple[list[float], float, float]) -> int | None:
    """The fewest pipeline stages (one rank each) whose fullest stage fits `memory_gb`; None when none does."""
    costs, first, last = split
    for pp in range(2, facts.num_blocks + 1):
        layout = candidates(pp, batch_size=cfg.train.batch_size, blocks=facts.num_blocks,
                            micro_batches=cfg.parallel.micro_batches, stage_layers=None, block_costs=costs,
                            first_extra=first, last_extra=last, grad_checkpoint=False,
                            transport="mlx")[-1]  # dp 1 x pp
        if layout.problem:
            continue
        if layout_figures(layout, facts, cfg, items, seq=seq, link_bytes_s=link_bytes_s,
                          fused_backward=fused)["total"] <= memory_gb * 1e9:
            return pp
    return None


def _split_costs(facts: Any, items: list[Any]) -> tuple[list[float], float, float]:
    """Blocks' parameter counts with adapters in place, the embedding's and the norm + head's (stage.py's split)."""
    costs = [float(c) for c in facts.block_params()]
    embed = head = norm = 0.0
    for t in facts.tensors:
        if block_of(t.name) is not None:
            continue
        count = t.nbytes // DTYPE_BYTES.get(t.dtype, 4)
        if "lm_head" in t.name:
            head += count
        elif any(e in t.name for e in EMBEDDINGS):
            embed += count
        else:
            norm += count
    for i in items:
        if i.extra and i.block is not None and i.block < len(costs):
            costs[i.block] += i.params
        elif i.extra and "lm_head" in i.name:
            head += i.params
        elif i.extra:
            embed += i.params
    return costs, embed, norm + (head if head else embed)


def recommend(rows: list[dict[str, Any]], ranks: int, memory_gb: float,
              shorter: str = "--max-seq-length") -> tuple[str | None, str]:
    """The fastest layout that fits, and why: most ranks used, then least bubble, then least traffic time."""
    fitting = [r for r in rows if r["fits"] and not r["problem"]]
    if not fitting:
        smallest = min((r for r in rows if "total" in r), key=lambda r: r["total"], default=None)
        need = (f"; the smallest, {smallest['layout']}, needs {smallest['total'] / 1e9:.2f} GB per rank"
                if smallest else "")
        return None, (f"no layout fits in {memory_gb:g} GB per rank{need}: more ranks, a smaller --batch-size "
                      f"or {shorter}, fewer --num-layers, or a quantized model")
    best = min(fitting, key=lambda r: (-r["ranks"], r["bubble"], r["comm_ms"], r["total"]))
    size = f"{best['total'] / 1e9:.2f} GB" if best["total"] >= 1e8 else f"{best['total'] / 1e6:.2f} MB"
    why = [f"fits: {size} of {memory_gb:g} GB per rank"]
    if best["ranks"] < ranks:
        full = [r for r in rows if r["ranks"] == ranks]
        refused = [f"{r['layout']}: {r['problem']}" for r in full if r["problem"]]
        why.append(f"no layout using all {ranks} ranks " + ("is valid (" + "; ".join(refused) + ")"
                                                             if len(refused) == len(full) else "fits"))
    elif ranks > 1:
        why.append(f"uses all {ranks} ranks")
    same = [r for r in fitting if r["ranks"] == best["ranks"] and r is not best]
    if best["bubble"] == 0 and best["pp"] == 1 and best["ranks"] > 1:
        why.append("no pipeline bubble")
    elif best["pp"] > 1:
        why.append(f"bubble {best['bubble']:.0%}")
    if same:
        why.append(f"least idle + traffic time of {len(same) + 1} fitting layouts "
                   f"({best['comm_ms']:.2f} ms/step on the link)")
    return best["layout"], "; ".join(why)
