"""Parallelism: one module per kind (data_parallel today; pipeline to come)."""
