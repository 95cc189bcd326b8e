#!/usr/bin/env bash
# The two-GPU tables of the data-parallel and pipeline issues, on a device machine of
# kind nvidia-h200-x2 after `source /root/mlxcuda/install.sh` (see the brief):
#     scripts/gpu_tables.sh scaling  "$OUT"   # bench scaling --in-process, 2 ranks over NCCL, started by meshtune launch
#     scripts/gpu_tables.sh scaling-mlx-launch "$OUT"  # the same, ranks started by mlx.launch
#     scripts/gpu_tables.sh adapters "$OUT"   # one GPU: the adapters issue's table (bench adapters --preset 1b), its kernels checked first (~8 min)
#     scripts/gpu_tables.sh kernels "$OUT"    # one GPU: the CUDA kernels' tests, then the folded kernel's pieces and knobs timed (~4 min)
#     scripts/gpu_tables.sh probes "$OUT"     # one GPU: the adapters issue's open question, DoRA's step (~5 min)
#     scripts/gpu_tables.sh host "$OUT"       # one GPU: DoRA's host time, kernel dispatch and the step split (~5 min)
#     scripts/gpu_tables.sh graphs "$OUT"     # one GPU: the host split under MLX's CUDA-graph settings, a process each, in turn (~6 min)
#     scripts/gpu_tables.sh profile "$OUT"    # one GPU: LoRA's and DoRA's steps under ncu, GPU time per kernel of one step (~2-4 min)
#     scripts/gpu_tables.sh candidates "$OUT" # one GPU: kernel candidates checked on the GPU, then timed alone (~5 min)
#     scripts/gpu_tables.sh candidate-steps "$OUT"  # one GPU: the 1B step with each candidate beside the current (~5 min)
#     scripts/gpu_tables.sh merged "$OUT"     # one GPU: the merged fold checked on the GPU, then the step merged and not (~6 min)
#     scripts/gpu_tables.sh scalar-pool "$OUT"  # one GPU: inputs of 8 bytes or less against padded ones, ncu GPU time (~2 min)
#     scripts/gpu_tables.sh multi-adam "$OUT"  # one GPU: multi_adam's CUDA tests, then the bench twice (~8 min)
#     scripts/gpu_tables.sh b-in-sums "$OUT"  # one GPU: B's product in the sums' pass checked, then the step with and without it (~5 min)
#     scripts/gpu_tables.sh nsys-host "$OUT"  # one GPU: LoRA's and DoRA's host time by primitive under nsys (NVTX), a process each (~3 min)
#     scripts/gpu_tables.sh pyspy-host "$OUT"  # one GPU: LoRA's and DoRA's host time by native function under py-spy, a process each (~4 min)
#     scripts/gpu_tables.sh pinning "$OUT"    # one GPU: the host split with the threads as started and pinned, a process each (~6 min)
#     scripts/gpu_tables.sh copies "$OUT"     # one GPU: three models each of LoRA and DoRA in one process, the host split (~4 min)
#     scripts/gpu_tables.sh pipeline "$OUT"   # bench pipeline, 2 stages over NCCL
#     scripts/gpu_tables.sh four-scaling  "$OUT"   # kind nvidia-h200-x4: bench scaling on 1, 2 and 4 GPUs (~150 s)
#     scripts/gpu_tables.sh four-pipeline "$OUT"   # kind nvidia-h200-x4: bench pipeline P=4, and DP2 x PP2 (~450 s)
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0), as the device notes require.
set -u
what=$1
out=${2:-.}
export NCCL_NVLS_ENABLE=0
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), 'cuda', mx.cuda.is_available())"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case $what in
  scaling)
    # One process first: its step is the 1-rank column of the 2-GPU table. The ranks are
    # started by meshtune launch (blocking output threads); scaling-mlx-launch uses mlx.launch.
    timeout 240 python3 -m meshtune.cli bench scaling --in-process --preset 1b --json 2>&1 \
      | tee "$out/scaling_1xh200.txt"
    timeout 300 python3 -m meshtune.cli launch -n 2 --backend nccl -- \
      python3 -m meshtune.cli bench scaling --in-process --preset 1b --backend nccl \
      --one-rank-json "$out/scaling_1xh200.txt" --json 2>&1 | tee "$out/scaling_2xh200_own_launch.txt" ;;
  scaling-mlx-launch)
    # The same 2-rank table with the ranks started by mlx.launch (busy-polling output threads):
    # on 2 x H200 LoRA's weak scaling was 86.2% this way, 90.1% under meshtune launch, same machine.
    timeout 240 python3 -m meshtune.cli bench scaling --in-process --preset 1b --json 2>&1 \
      | tee "$out/scaling_1xh200.txt"
    timeout 300 mlx.launch -n 2 --backend nccl --env NCCL_NVLS_ENABLE=0 --env "PYTHONPATH=$PYTHONPATH" -- \
      python3 -m meshtune.cli bench scaling --in-process --preset 1b --backend nccl \
      --one-rank-json "$out/scaling_1xh200.txt" --json 2>&1 | tee "$out/scaling_2xh200.txt" ;;
  adapters)
    # The CUDA kernels' tests first (a wrong kernel makes the table meaningless), then the table;
    # the bench reports each stage on stderr, so a run cut short still shows what it measured.
    timeout 100 python3 -m pytest -q -x tests/test_adapted_linear.py -k cuda 2>&1 | tail -3
    { echo "# python3 -m meshtune.cli bench adapters --preset 1b --steps 30 --rounds 3 --gen-tokens 32 --json  (one H200)"
      timeout 470 python3 -m meshtune.cli bench adapters --preset 1b --steps 30 --rounds 3 --gen-tokens 32 --json 2>&1; } \
      | tee "$out/adapters_h200.txt" ;;
  kernels)
    # One call (~4 min; `adapters` in the next, the two together pass a call's 10 minutes): the CUDA
    # tests, then the folded kernel's staging timed both ways (float4 loads, the default, and a float
    # at a time), its W' pass with 1 (the default), 2, 4 and 8 loads in flight, A's tiles of 256 rows
    # (127 registers: two blocks an SM, not one; scripts/probes/kernel_registers.py) and on a 4-bit
    # base dequantized first.
    timeout 120 python3 -m pytest -q tests/test_adapted_linear.py -k cuda --tb=short 2>&1 | tail -20
    timeout 240 python3 scripts/probes/dora_kernel_cost.py --reps 5 \
      --only "launch|row norms, a launch a shape|row norms and|W' with|W' written|W' 8 warps|norms alone|4-bit|m's sums" \
      2>&1 | tee "$out/dora_kernel_cost.txt" ;;
  probes)
    # One GPU, ~5 min: DoRA's kernels alone, every layer its own arrays (as in a step); DoRA's step with
    # each variant (PROBE_VARIANTS), checked against the current code first, 120 steps in 12 interleaved
    # rounds, overlapped as the loop takes them (PROBE_ARGS adds flags, e.g. "--batch-size 8": from
    # batch 4 up both steps are GPU-bound, docs/bench/overlapped_batches_h200.txt). The dispatch probe
    # (scripts/probes/dispatch_cost.py) and the second-stream probe (stream_overlap.py) run on their own.
    timeout 120 python3 scripts/probes/dora_kernel_cost.py --reps 5 \
      --only "launch|row norms, a launch a shape|row norms and|W' with A|norms alone|m's sums|cotangent kernels|base product" \
      2>&1 | tee "$out/dora_kernel_cost.txt"
    timeout 400 python3 scripts/probe_dora_step.py --bases bf16 --steps 120 --rounds 12 ${PROBE_ARGS:-} \
      --only "${PROBE_VARIANTS:-current,W' written 4 loads in flight,tiles of 256 rows of A,tiles of 256 and W' 4 loads in flight,A staged a float at a time}" \
      2>&1 | tee "$out/probe_dora_step.txt" ;;
  host)
    # One GPU, ~5 min: the overlapped step is the host's on an H200 (probe_dora_step --host: the wait for the step
    # before is ~0), so DoRA's extra is host time. What a custom kernel costs to dispatch, alone and as the step's 4
    # norm launches; then the step split into build, dispatch and wait for DoRA with its norms held (no launches) and
    # with the layers casting A and B' themselves (kernels._WRITE_FACTORS off), beside the current code and LoRA.
    timeout 150 python3 scripts/probes/kernel_dispatch.py 2>&1 | tee "$out/kernel_dispatch.txt"
    held="bound: folded with W' held (no norm launches)"  # (one quote: not inside the \${...:-...} below)
    timeout 400 python3 scripts/probe_dora_step.py --bases bf16 --steps 30 --rounds 3 --host \
      --only "${PROBE_VARIANTS:-current,factors cast by the layers,$held}" \
      2>&1 | grep -v '^check' | tee "$out/probe_host.txt" ;;
  graphs)
    # One GPU, ~6 min: is DoRA's extra host time MLX's CUDA-graph machinery (a graph committed every 20 ops by
    # default: its key built, the cached exec updated or instantiated, then launched)? The host split for LoRA and the
    # current DoRA under each of GRAPH_SETTINGS (MLX's own environment variables; "-" for MLX's defaults), each in its
    # own process, taken in turn (a process's step varies by +-30% from the next one's: compare within a pair).
    for setting in ${GRAPH_SETTINGS:-- MLX_MAX_OPS_PER_BUFFER=100 - MLX_MAX_OPS_PER_BUFFER=100}; do
      [ "$setting" = - ] && setting=""
      echo "== ${setting:-MLX defaults}" | tee -a "$out/probe_graphs.txt"
      env $setting timeout 300 python3 scripts/probe_dora_step.py --bases ${GRAPH_BASES:-bf16} --steps 30 --rounds 3 \
        --host --only current 2>&1 | grep -v '^check' | tee -a "$out/probe_graphs.txt"
    done ;;
  candidates)
    # One GPU, ~5 min: the kernel candidates, checked against the current
    # kernels on the GPU first (the one-launch m and B gradients, to the bit), then the folded launch shape by
    # shape (bf16, 4-bit) and the pieces over a 1B step's layers.
    timeout 200 python3 -m pytest -q tests/test_adapted_linear.py -k "cuda or fold or packed or kernel" 2>&1 \
      | tail -3 | tee "$out/tests.txt"
    (cd scripts/probes && timeout 60 python3 folded_launch_shapes.py --reps 9 \
      && timeout 40 python3 folded_launch_shapes.py --reps 5 --bits 4) 2>&1 | tee "$out/shapes.txt"
    (cd scripts/probes && timeout 90 python3 dora_kernel_cost.py --reps 7 --only \
      "launch floor|folded step|the staged|4-bit packed|m's and B's") 2>&1 \
      | tee "$out/cost.txt" ;;
  merged)
    # One GPU, ~6 min fresh: the merged fold (kernels.MERGED_FOLD, W' = rs (W + s (A B)^T) and one product a layer)
    # checked on the GPU at the 1B shapes, then the 1B bf16 step merged and not, beside LoRA, the host split.
    timeout 240 python3 -m pytest -q tests/test_adapted_linear.py -k "merged or fold or packed or cuda" 2>&1 \
      | tail -3 | tee "$out/tests_merged.txt"
    timeout 300 python3 scripts/probe_dora_step.py --bases ${PROBE_BASES:-bf16} --steps 40 --rounds 4 --host \
      --only "current,folded not merged (before)" 2>&1 | tee "$out/probe_merged.txt" ;;
  candidate-steps)
    # One GPU, ~5 min: the 1B bf16 step with each candidate, interleaved with the current code and LoRA.
    timeout 300 python3 scripts/probe_dora_step.py --bases ${PROBE_BASES:-bf16} --steps 60 --rounds 6 \
      --only "current,m and B gradients in one launch (last block),Adam on m packed" 2>&1 \
      | tee "$out/probe_dora_step.txt" ;;
  copies)
    # One GPU, ~4 min: whether one process's models of the same code differ in host time as its processes did
    # (docs/bench/adapters_h200_24.txt, block 5): three of LoRA's and three of DoRA's, timed in the same rounds.
    timeout 330 python3 scripts/probe_dora_step.py --bases ${PROBE_BASES:-bf16} --steps 60 --rounds 6 --host \
      --only current --copies 3 2>&1 | tee "$out/probe_dora_step_copies.txt" ;;
  b-in-sums)
    # One GPU, ~6 min: B's product in the sums' pass (kernels.B_PRODUCT_IN_SUMS) checked against cuBLAS's product, then
    # DoRA's step with it and with the matmul as before, beside LoRA, two models each (PROBE_BASES=4bit for 4-bit).
    # The one-launch form (the chunks added by each strip's last block) and four columns a thread beside them.
    timeout 150 python3 -m pytest -q tests/test_adapted_linear.py -k "b_product or b_sums or fold or packed" 2>&1 | tail -3
    timeout 420 python3 scripts/probe_dora_step.py --bases ${PROBE_BASES:-bf16} --steps 40 --rounds 4 --host --copies 2 \
      --only "current,B's product by a matmul (before),B in the sums in one launch (last block),B sums 32 floats a thread" 2>&1 \
      | tee "$out/probe_b_in_sums.txt" ;;
  multi-adam)
    # One GPU: multi_adam's CUDA tests (the grouped Adam update against mlx's, eager and compiled), then the bench with it
    # (~6-8 min a run: give each its own call, BENCH_RUNS=1 then BENCH_RUNS=2); --combine the runs here.
    timeout 90 python3 -m pytest -q tests/test_multi_adam.py 2>&1 | tail -3 | tee "$out/tests_multi_adam.txt"
    for run in ${BENCH_RUNS:-1 2}; do
      MESHTUNE_MULTI_ADAM=1 timeout 540 python3 -m meshtune.cli bench adapters --preset 1b --steps 120 --rounds 12 --gen-tokens 32 --json \
        > "$out/adapters_h200_run$run.txt" 2>&1
      grep "timed the steps" "$out/adapters_h200_run$run.txt"
    done ;;
  nsys-host)
    # One GPU, ~3 min, where nsys is installed: LoRA's and DoRA's 1B steps, a process each, under nsys (NVTX and CUDA API
    # only); MLX's CUDA build marks each primitive's eval_gpu with an NVTX range, so the per-range sums attribute the
    # host's time a step by primitive. The reports stay in /tmp; their summaries come back.
    NSYS=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys 2>/dev/null | head -1)
    [ -n "$NSYS" ] || { echo "no nsys on this machine"; exit 1; }
    for kind in lora dora; do
      timeout 150 "$NSYS" profile -t nvtx,cuda --sample=none --cpuctxsw=none --force-overwrite=true -o /tmp/steps_$kind \
        python3 scripts/probes/one_kind_steps.py --kind $kind --steps ${NSYS_STEPS:-30} 2>&1 | grep -v "^\[bench\|Collecting\|Generating\|Processing"
      timeout 90 "$NSYS" stats -r nvtx_sum,cuda_api_sum --force-export=true /tmp/steps_$kind.nsys-rep \
        > "$out/nsys_$kind.txt" 2>&1
      head -40 "$out/nsys_$kind.txt"
    done ;;
  pyspy-host)
    # One GPU, ~4 min on a warm machine (the first process compiles MLX's kernels), py-spy on PATH (its wheel installed
    # beside MLX's: prepare-mlx-cuda py-spy): LoRA's and DoRA's 1B steps, a process each, PYSPY_PASSES times in turn,
    # sampled with native frames for PYSPY_SECONDS after the warm-up (py-spy attached by the probe: sampling a process
    # from its start stalled it past 10 minutes); the raw profiles come back, and their fold: samples a step by native
    # function (scripts/probes/host_profile.py). Sampling slows the step 3-4x: read the fold as shares, not ms.
    for pass in $(seq ${PYSPY_PASSES:-2}); do
      for kind in lora dora; do
        timeout 130 python3 scripts/probes/host_profile.py --kind $kind --seconds ${PYSPY_SECONDS:-15} \
          --rate ${PYSPY_RATE:-100} --pyspy "$out/pyspy_${kind}_$pass.txt" --steps-file "$out/pyspy_${kind}_$pass.txt.steps" 2>&1
      done
    done
    profiles=()
    for f in "$out"/pyspy_{lora,dora}_{1..9}.txt; do [ -e "$f" ] && profiles+=("$f"); done  # what py-spy wrote
    python3 scripts/probes/host_profile.py --fold "${profiles[@]}" 2>&1 | tee "$out/pyspy_host_fold.txt" | head -150 ;;
  pinning)
    # One GPU, ~6 min: whether the process-to-process spread of the host's time (adapters_h200_24.txt, block 5) is
    # where its threads run: the machine's CPUs and the GPU's node, then processes in turn with the threads as
    # started and with the main thread alone on a core of the GPU's node (scripts/probes/pinning.py).
    python3 -c "import sys; sys.path.insert(0, 'scripts/probes'); import pinning; print(pinning.describe())"
    nvidia-smi topo -m 2>&1 | head -8
    for pin in ${PIN_MODES:-none main none main}; do
      echo "== --pin $pin"
      timeout 110 python3 scripts/probe_dora_step.py --bases bf16 --steps 40 --rounds 4 --host --only current \
        --pin $pin 2>&1 | grep -v "^check"
    done 2>&1 | tee "$out/probe_pinning.txt" ;;
  scalar-pool)
    # GPU time (ncu, each launch alone) of scalar_pool.py's four pieces, a process each, then step_kernels.py's
    # totals pair by pair: m's and B's gradients with their constants padded against 4 bytes, and an Adam-shaped
    # update with lr padded against a 4-byte scalar.
    for piece in 1 2 3 4; do
      (cd scripts/probes && timeout 120 ncu --csv --metrics gpu__time_duration.sum --cache-control none \
        --clock-control none --profile-from-start off python3 scalar_pool.py --profile $piece \
        > "$out/ncu_scalar_pool_$piece.csv" 2>/dev/null)
    done
    { python3 scripts/probes/step_kernels.py --summary "$out/ncu_scalar_pool_1.csv" "$out/ncu_scalar_pool_2.csv"
      python3 scripts/probes/step_kernels.py --summary "$out/ncu_scalar_pool_4.csv" "$out/ncu_scalar_pool_3.csv"
    } 2>&1 | tee "$out/scalar_pool_ncu.txt"
    (cd scripts/probes && timeout 100 python3 scalar_pool.py --reps 9) 2>&1 | tee -a "$out/scalar_pool_ncu.txt" ;;
  profile)
    # DoRA's GPU time a step, kernel by kernel beside LoRA's (PROFILE_BASE=4bit for the quantized base).
    # ncu times each launch alone (serialised; caches and clocks as they are) from profile_step's
    # cudaProfilerStart on (the model's set-up and the compiling step are not profiled), over 2 steps,
    # and kernel_diff takes one step's launches from them (between two cross-entropy backward kernels).
    # nsys wrote only a .qdstrm on this machine (no importer), so it is not used.
    for kind in lora dora; do
      (cd scripts/probes && timeout 200 ncu --csv --metrics gpu__time_duration.sum --cache-control none \
        --clock-control none --profile-from-start off \
        python3 profile_step.py --kind "$kind" --base "${PROFILE_BASE:-bf16}" --warmup 1 --steps 2 \
        > "$out/ncu_$kind.csv" 2>"$out/ncu_$kind.err")
      tail -2 "$out/ncu_$kind.err"; wc -l "$out/ncu_$kind.csv"
    done
    python3 scripts/probes/kernel_diff.py "$out/ncu_lora.csv" "$out/ncu_dora.csv" --cycle cross_entropy_vjp \
      | tee "$out/kernel_diff.txt" ;;
  four-scaling)
    # The four-GPU issue: 1 process, then 2 and 4 ranks against it.
    timeout 200 python3 -m meshtune.cli bench scaling --in-process --preset 1b --json 2>&1 | tee "$out/scaling_1xh200.txt"
    for n in 2 4; do
      timeout 240 python3 -m meshtune.cli launch -n $n --backend nccl -- \
        python3 -m meshtune.cli bench scaling --in-process --preset 1b --backend nccl \
        --one-rank-json "$out/scaling_1xh200.txt" --json 2>&1 | tee "$out/scaling_${n}xh200.txt"
    done ;;
  four-pipeline)
    timeout 330 python3 -m meshtune.cli bench pipeline --preset 1b --seq-len 1024 --batch-size 16 --stages 4 \
      --micro-batches 4,8,16 --iters 6 --json 2>&1 | tee "$out/pipeline_4xh200.txt"
    timeout 250 python3 -m meshtune.cli bench pipeline --preset 1b --seq-len 1024 --batch-size 16 --stages 2 \
      --data-parallel 2 --micro-batches 4,8 --iters 6 --json 2>&1 | tee "$out/pipeline_dp2pp2_4xh200.txt" ;;
  pipeline)
    timeout 540 python3 -m meshtune.cli bench pipeline --preset 1b --seq-len 1024 --batch-size 16 \
      --micro-batches 2,4,8 --iters 8 --json 2>&1 | tee "$out/pipeline_2xh200.txt" ;;
esac
