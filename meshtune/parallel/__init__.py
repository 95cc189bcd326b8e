"""Parallelism: the layout (`Mesh`) and one strategy module per kind (data_parallel.py, pipeline.py)."""
