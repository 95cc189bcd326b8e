"""Where the host's time goes in meshtune's 1B training step, LoRA against DoRA, by native function.

Development probe (adapters issue). On an H200 the step is the host's (probe_dora_step.py --host: the GPU
waits), and DoRA's host time exceeds LoRA's by more than its graph's size suggests. This runs one
configuration's steps, as `meshtune bench adapters` runs them, for --seconds, to be sampled by py-spy
with native frames (one process a configuration), py-spy attached after the warm-up (sampling a process from its
start, through MLX's kernel compilation, stalled it for minutes on an H200):
    python3 scripts/probes/host_profile.py --kind lora --pyspy lora.txt --steps-file lora.txt.steps
    python3 scripts/probes/host_profile.py --kind dora --pyspy dora.txt --steps-file dora.txt.steps
    python3 scripts/probes/host_profile.py --fold lora.txt dora.txt   # samples a step, by function, side by side
The steps done are printed (and written beside the profile as <profile>.steps when --steps-file is given),
so the fold prints samples per step: comparable between the two processes.
"""
import argparse
import re
import sys
import time
from collections import Counter
from pathlib import Path

# Frames named by what they do: the first pattern a frame matches names it (inclusive counts: a sample counts
# once for every name on its stack).
GROUPS = [
    ("compiled call (build)", r"compile_replace|compile_trace|detail::compile\b|CompilerCache"),
    ("mlx eval (dispatch)", r"mlx::core::eval_impl|mlx::core::async_eval|mlx::core::eval\b"),
    ("CustomKernel::eval_gpu", r"CustomKernel::eval_gpu"),
    ("Matmul/AddMM eval_gpu", r"(Matmul|AddMM)::eval_gpu"),
    ("Compiled::eval_gpu (fused)", r"Compiled::eval_gpu"),
    ("cublas", r"cublas"),
    ("CUDA graph (cudaGraph*)", r"cudaGraph|cuGraph"),
    ("libcuda", r"\(libcuda"),
    ("encoder add_kernel_node", r"add_kernel_node"),
    ("encoder commit", r"CommandEncoder::commit"),
    ("set_input/output_array", r"set_(input|output)_array"),
    ("mlx allocator", r"core::allocator::|CudaAllocator|BufferCache|malloc_async"),
    ("array destruction", r"array::~array|ArrayDesc::~ArrayDesc|~ArrayDesc"),
    ("array construction", r"array::array|ArrayDesc::ArrayDesc|make_arrays"),
    ("malloc (libc)", r"^(malloc|free|_int_malloc|_int_free|cfree|operator new|operator delete)"),
    ("python tree ops", r"tree_flatten|tree_unflatten|tree_map|tree_visit|tree_replace"),
]


def fold(paths: list[str]) -> None:
    """Print samples a step by group and by the hottest native functions, one column a profile."""
    columns = []
    for path in paths:
        steps = int(Path(path + ".steps").read_text()) if Path(path + ".steps").exists() else 1
        groups, funcs, leaves, total = Counter(), Counter(), Counter(), 0
        for line in open(path):
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            n = int(n)
            if "timed_loop (" not in stack:
                continue  # imports, tracing, warm-up
            total += n
            # An unnamed frame keeps its library only (addresses differ between processes).
            frames = [re.sub(r"^0x[0-9a-f]+ ", "", re.sub(r" \((.*\.so[.0-9]*)\)$", r" [\1]", f)) for f in stack.split(";")]
            libs = stack.split(";")
            for name, pattern in GROUPS:
                if any(re.search(pattern, f) for f in libs):
                    groups[name] += n
            for f in set(frames):
                funcs[f] += n
            leaves[frames[-1]] += n
        columns.append((Path(path).stem, steps, total, groups, funcs, leaves))
    head = "".join(f"{c[0][:14]:>16}" for c in columns)
    print(f"samples a step (inclusive; share of all)   {head}")
    print(f"{'all':42s} " + "".join(f"{c[2] / c[1]:16.1f}" for c in columns))
    for name, _ in GROUPS:
        print(f"{name:42s} " + "".join(f"{c[3][name] / c[1]:7.2f} ({c[3][name] / max(c[2], 1):5.1%})" for c in columns))
    for title, at, count in (("inclusive", 4, 90), ("self: the sampled frame", 5, 40)):
        keys = Counter()
        for c in columns:
            for f, n in c[at].most_common(count):
                keys[f] = max(keys[f], n / c[1])
        print(f"\nhottest functions ({title}), samples a step")
        for f, _ in keys.most_common(count):
            print(f"  {_short(f):100s} " + "".join(f"{c[at][f] / c[1]:10.2f}" for c in columns))


def _short(name: str) -> str:
    """A C++ name without its template and parameter lists, at most 100 characters."""
    if "::" not in name:
        return name[:100]
    while True:
        shorter = re.sub(r"<[^<>]*>", "", name)
        if shorter == name:
            break
        name = shorter
    return re.sub(r"\([^()]*\)(?= |$)", "()", name)[:100]


def timed_loop(step, seconds: float) -> tuple[int, float]:
    """(steps, seconds) of steps run for `seconds`: the fold counts only samples inside this function."""
    done, tic = 0, time.perf_counter()
    while time.perf_counter() - tic < seconds:
        step()
        done += 1
    step.finish()
    return done, time.perf_counter() - tic


def attach_pyspy(out: str, seconds: float, rate: int):
    """py-spy sampling this process with native frames into `out` (raw) for `seconds` and a margin, started now."""
    import os
    import subprocess

    cmd = ["py-spy", "record", "--native", "-r", str(rate), "-d", str(int(seconds) + 10), "-f", "raw", "-o", out,
           "--pid", str(os.getpid())]
    spy = subprocess.Popen(cmd)
    time.sleep(5)  # attached, its symbols read, before the timed steps
    return spy


def run(kind: str, base: str, seconds: float, steps_file: str | None, rest: list[str],
        pyspy: str | None = None, rate: int = 100) -> None:
    import mlx.core as mx

    from meshtune.bench import adapters as B

    a = B._settings(["--preset", "1b", *rest])
    shape, dtype = B.shape_of(a), (mx.float32 if B._on_cpu() else mx.bfloat16)
    step = B.build_step("meshtune", kind, base, a, shape, dtype)
    for _ in range(5):
        step()
    step.finish()
    spy = attach_pyspy(pyspy, seconds, rate) if pyspy else None
    done, elapsed = timed_loop(step, seconds)
    if spy is not None:
        try:
            spy.wait(timeout=40)
        except Exception:
            spy.kill()
            print("py-spy did not finish; killed", flush=True)
    print(f"{kind} {base}: {done} steps in {elapsed:.1f} s, {elapsed / done * 1e3:.2f} ms a step (sampled)", flush=True)
    if steps_file:
        Path(steps_file).write_text(str(done))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--kind", choices=["lora", "dora"])
    p.add_argument("--base", default="bf16")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--steps-file")
    p.add_argument("--pyspy", help="attach py-spy (on PATH) after warm-up, raw native profile to this file")
    p.add_argument("--rate", type=int, default=100)
    p.add_argument("--fold", nargs="+", help="raw py-spy profiles to fold (each with its .steps file beside it)")
    args, rest = p.parse_known_args()
    if args.fold:
        fold(args.fold)
    else:
        run(args.kind, args.base, args.seconds, args.steps_file, rest, args.pyspy, args.rate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
