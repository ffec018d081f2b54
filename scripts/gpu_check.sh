#!/usr/bin/env bash
# The whole single-GPU check in one run, for a GPU host lent for minutes: the Pallas kernel's GPU tests, the
# attention benchmark against cuDNN, and the step benchmark of gpt_125m and gpt_1_3b in bfloat16.
#
#   bash scripts/gpu_check.sh RESULTS_DIR
#
# Each part has its own time limit (a hung compile costs one part, not the run) and writes its JSON (and log)
# under RESULTS_DIR; a part that fails leaves its log and the run goes on, so one run shows every failure.
# Needs jax with CUDA (`pip install -e ".[cuda]"`, or an image with jax[cuda]) and msjax importable.
# Each bench.py row runs one process: XLA keeps the memory of an earlier configuration's buffers otherwise.
set -u
RESULTS=${1:?usage: gpu_check.sh RESULTS_DIR}
mkdir -p "$RESULTS"
PY=${PYTHON:-python3}

part() {  # part NAME LIMIT_S COMMAND...: runs COMMAND under a time limit, its output to NAME.log and the console
    local name=$1 limit=$2; shift 2
    if [[ -n "${PARTS:-}" && " $PARTS " != *" $name "* ]]; then return; fi  # PARTS="a b": only those parts
    local t0=$SECONDS
    echo "== $name (limit ${limit} s): $*"
    timeout --kill-after=10 "$limit" "$@" > "$RESULTS/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$RESULTS/$name.log"
    echo "== $name: exit $rc after $((SECONDS - t0)) s"
    echo "{\"part\": \"$name\", \"exit\": $rc, \"seconds\": $((SECONDS - t0))}" >> "$RESULTS/parts.jsonl"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  $PY -c "import jax, jaxlib, flax; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax',
flax.__version__, jax.devices())"; } 2>&1 | tee "$RESULTS/machine.txt"

# Eight pytest workers share the GPU (each test is mostly Triton compiling on the host's cores, ~14 s a test one at
# a time on an H100 host), each allocating GPU memory as it needs it instead of XLA's default 75% up front.
part kernel_tests 180 env XLA_PYTHON_CLIENT_PREALLOCATE=false $PY -m pytest -q --tb=line -p no:cacheprovider \
    -n 8 --dist load -m gpu tests/pallas_kernels/test_sliding_window_attention.py --junitxml="$RESULTS/kernel_tests.xml"
part attention 150 $PY scripts/bench_attention.py --json "$RESULTS/attention.json"
BENCH=(--steps=10 --model.dtype=bfloat16 --mesh.data=1)  # gpt_1_3b at batch 8 without remat: out of memory on 80 GB
part gpt_125m 80 $PY scripts/bench.py --config=gpt_125m --train.global_batch=16 --model.remat=none \
    "${BENCH[@]}" --json="$RESULTS/bench_gpt_125m.json"
# With a profiler trace of 10 more steps (where the step's time goes), archived: a trace nests five folders deep.
part gpt_1_3b 130 $PY scripts/bench.py --config=gpt_1_3b --train.global_batch=4 --model.remat=none \
    "${BENCH[@]}" --json="$RESULTS/bench_gpt_1_3b.json" --trace="$RESULTS/trace"
[[ -d "$RESULTS/trace" ]] && tar -czf "$RESULTS/trace.tgz" -C "$RESULTS" trace && rm -rf "$RESULTS/trace"
part gpt_1_3b_dots 100 $PY scripts/bench.py --config=gpt_1_3b --train.global_batch=8 --model.remat=dots \
    "${BENCH[@]}" --json="$RESULTS/bench_gpt_1_3b_dots.json"
