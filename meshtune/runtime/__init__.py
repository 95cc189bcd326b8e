"""Process-level helpers the engine runs on: the BLAS choice and heap settings on Linux CPUs, the fast SiLU,
CUDA's kernel cache, MESHTUNE_* environment switches, output-folder checks and the lost-rank watchdog."""
