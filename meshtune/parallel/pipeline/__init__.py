"""Pipeline parallelism: the `Pipeline` strategy (executor.py) runs a schedule (schedules.py) of
micro-batch actions over the stages (stage.py, cut from a lazily loaded model by stage_cut.py, sized by
split.py), moving activations between them (p2p.py) and, with data parallelism, summing over the replicas
(peers.py); state.py keeps each stage's checkpoints, stage_model.py full fine-tuning's sharded model."""
