#!/usr/bin/env bash
# One prepared check for a machine with an NVIDIA GPU and the CUDA toolkit (the device tool's
# H200 image: torch preinstalled, nothing downloadable). Builds fastckpt._C and fastckpt._reentrant
# against that machine's torch for arch 9.0, runs the whole test suite (the cuda-marked tests, and the
# rest under that image's torch, older than CI's pin), then the GPU benchmarks, and writes into the folder given
# as $1 at most seven files (the device tool returns at most 8): summary.txt, the benchmarks' results.md
# and ops/train/offload/llm CSVs, and logs.tar.gz (every step's log, the tests' JUnit XML, every benchmark
# output: per-workload CSVs and plots). The step deadlines add up to under 9 minutes. Usage: scripts/gpu_check.sh "$OUT"
set -uo pipefail
out="${1:?usage: scripts/gpu_check.sh OUTPUT_DIR}"
mkdir -p "$out"
out=$(cd "$out" && pwd)
logs=$(mktemp -d)
bench="$logs/bench"  # benchmark outputs: tarred whole, the main tables also copied to $out
mkdir -p "$bench"
cd "$(dirname "$0")/.."
export FASTCKPT_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-16}"
export PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
status=()
# Packages the image lacks travel as wheels in .whl/ (git-ignored; name it in the device tool's `carry`):
# liger-kernel, for the llm section's Liger row. Fetch them here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl liger-kernel==0.8.5
if compgen -G ".whl/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fastckpt-site .whl/*.whl \
    && export PYTHONPATH="/tmp/fastckpt-site${PYTHONPATH:+:$PYTHONPATH}"
fi

step() {  # step NAME TIMEOUT_S CMD...: run with a deadline, log to $logs/NAME.log, record its status
  local name=$1 limit=$2
  shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" >"$logs/$name.log" 2>&1
  local rc=$?
  status+=("$name: rc=$rc, $(( $(date +%s) - t0 )) s")
  return $rc
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; "$py" -c "import torch; print(torch.__version__, torch.version.cuda)"; git rev-parse HEAD 2>/dev/null; } >"$logs/env.log" 2>&1
if step build 150 "$py" setup.py build_ext --inplace; then
  step info 15 "$py" -m fastckpt.info
  # The suite takes ~2.5 minutes serially; the image has pytest-xdist, so spread it over 8 workers.
  parallel=()
  "$py" -c "import xdist" 2>/dev/null && parallel=(-n 8)
  step tests 125 "$py" -m pytest -q -p no:cacheprovider "${parallel[@]}" --junitxml="$logs/tests.xml"
  # The four workloads only: the planner and compile sections would not fit the deadline.
  step bench 80 "$py" -m benchmarks checkpoint --device cuda --workloads seed-cnn,gpt2,gpt2-long,llama --out "$bench"
  step bench_ops 50 "$py" -m benchmarks ops --device cuda --out "$bench"
  step bench_train 25 "$py" -m benchmarks train --device cuda --quick --out "$bench"
  step bench_offload 25 "$py" -m benchmarks offload --device cuda --quick --out "$bench"
  # The whole step of a bf16 Llama fine-tune (8 layers; needs transformers and peft in the image; with
  # liger-kernel from .whl/, Liger's fused linear cross entropy as a peer row).
  step bench_llm 45 "$py" -m benchmarks llm --device cuda --quick --out "$bench"
  # The seed CNN's four torch.cuda memory numbers, next to the classic write-up's 69.58 -> 40.80 MB.
  step cifar_cnn 20 "$py" examples/cifar10_cnn.py --device cuda --steps 10 --mode plain --mode torch \
    --mode fastckpt:recompute --mode fastckpt:int8 --mode fastckpt:int4
fi

{
  echo "== gpu_check summary =="
  cat "$logs/env.log"
  printf '%s\n' "${status[@]}"
  [ -f "$logs/tests.log" ] && tail -n 3 "$logs/tests.log"
  for log in info bench bench_ops bench_train bench_offload bench_llm cifar_cnn; do [ -f "$logs/$log.log" ] && grep -v '^USDT' "$logs/$log.log" | tail -n 40; done
  [ -f "$logs/build.log" ] && grep -m5 -E "error|FAILED" "$logs/build.log"
} 2>&1 | tee "$out/summary.txt"
for table in results.md ops_cuda.csv train_cuda.csv offload_cuda.csv llm_lora.csv; do
  [ -f "$bench/$table" ] && cp "$bench/$table" "$out/"
done
tar -czf "$out/logs.tar.gz" -C "$logs" .
true
