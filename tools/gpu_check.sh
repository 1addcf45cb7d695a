#!/usr/bin/env bash
# tools/gpu_check.sh: the CUDA backend's checks, for whoever has a GPU.
#
#   tools/gpu_check.sh            build, then run (on a machine with the Debian packages, nvcc
#                                 and a GPU)
#   tools/gpu_check.sh build      configure and build the CUDA tests and benchmark into
#                                 build/gpu-check (Release; needs nvcc, Eigen, Catch2, Google
#                                 Benchmark; nlohmann/json adds the checkpoint tests), and
#                                 copy beside them the one shared library a bare
#                                 GPU machine may lack (libbenchmark), so the folder can be
#                                 carried to one
#   tools/gpu_check.sh run [DIR]  run them from build/gpu-check: the parity tests (exit 77 and
#                                 "skipped" without a GPU, never "passed"), then the benchmarks;
#                                 results into DIR (default build/gpu-check/results):
#                                 cuda_tests.txt, example.txt (examples/07_cuda_memory),
#                                 cuda_bench.txt, cuda_bench.json, device.txt
#   tools/gpu_check.sh sanitize [DIR]
#                                 the tests under compute-sanitizer memcheck (leaks too) and
#                                 initcheck, with a short parity sweep (2 cases per mode):
#                                 memcheck.txt, initcheck.txt
#   tools/gpu_check.sh lease [DIR]
#                                 one lent machine's call, each step under a time limit: the
#                                 tests, the blocks', models' and trainer's tests again with
#                                 call graphs on (graphs_tests.txt), the fused and decode
#                                 kernels' tests, the per-pair
#                                 launches', the warp-tiled attention's and the fused norms'
#                                 under memcheck and racecheck
#                                 (fused_memcheck.txt, fused_racecheck.txt), the block,
#                                 model and trainer tests under memcheck
#                                 (training_memcheck.txt), then the memory,
#                                 decode and Trainer-step benchmarks (BENCH_FILTER overrides
#                                 which); a table last
#   tools/gpu_check.sh peers [DIR]
#                                 titans-pytorch's NeuralMemory, then its MAC transformer of
#                                 depth 1 (--mac), against bench_cuda on the same GPU
#                                 (tools/compare_pytorch_gpu.py): needs the wheels that
#                                 tools/peer_wheels.py puts in .whl here, carried with the build
#   tools/gpu_check.sh profile [DIR]
#                                 each kernel's device time in one memory training step
#                                 (BM_CudaMemoryTrain) at B = 1 and B = 256 (Nsight Compute):
#                                 ncu_train_B1.txt, ncu_train_B256.txt and the top 25 of each
#
# The figures in docs/performance.md ("CUDA backend") come from `run`.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${repo_root}/build/gpu-check"

do_build() {
  # NCCL (the test "cuda nccl: one rank") only with GPU_CHECK_NCCL=ON: its library (hundreds
  # of MB) does not travel with the build, so the device must have it.
  cmake -S "${repo_root}" -B "${build}" -DCMAKE_BUILD_TYPE=Release -DTITANS_ENABLE_CUDA=ON \
    -DTITANS_BUILD_EXAMPLES=ON -DTITANS_IO=AUTO -DTITANS_HEADER_CHECK=OFF -DTITANS_INSTALL=OFF \
    -DTITANS_ENABLE_NCCL="${GPU_CHECK_NCCL:-OFF}"
  cmake --build "${build}" -j "$(nproc)" --target titans_cuda_tests bench_cuda 07_cuda_memory
  local lib
  lib="$(ldd "${build}/bench/bench_cuda" | awk '/libbenchmark/ {print $3}')"
  if [ -n "${lib}" ]; then
    cp -L "${lib}" "${build}/bench/"
  fi
}

do_run() {
  local out="${1:-${build}/results}"
  mkdir -p "${out}"
  export LD_LIBRARY_PATH="${build}/bench${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
  { nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
    uptime; } > "${out}/device.txt" 2>&1
  local rc=0
  "${build}/tests/titans_cuda_tests" --warn NoTests > "${out}/cuda_tests.txt" 2>&1 || rc=$?
  tail -n 3 "${out}/cuda_tests.txt"
  grep "worst relative error" "${out}/cuda_tests.txt" || true
  if [ "${rc}" -eq 77 ]; then
    echo "gpu_check: no CUDA device here: tests skipped, benchmarks not run"
    return 77
  fi
  "${build}/examples/07_cuda_memory" | tee "${out}/example.txt" || rc=$?
  "${build}/bench/bench_cuda" --benchmark_counters_tabular=true \
    --benchmark_filter="${BENCH_FILTER:-.}" \
    --benchmark_out="${out}/cuda_bench.json" --benchmark_out_format=json \
    | tee "${out}/cuda_bench.txt"
  return "${rc}"
}

do_sanitize() {
  local out="${1:-${build}/results}" tool rc=0
  mkdir -p "${out}"
  for tool in memcheck initcheck; do
    local extra=()
    [ "${tool}" = memcheck ] && extra=(--leak-check full)
    TITANS_CUDA_PARITY_CASES=2 compute-sanitizer --tool "${tool}" "${extra[@]}" --error-exitcode 9 \
      "${build}/tests/titans_cuda_tests" > "${out}/${tool}.txt" 2>&1 || rc=$?
    echo "${tool}: $(grep 'ERROR SUMMARY' "${out}/${tool}.txt" || echo 'no summary') (exit ${rc})"
  done
  return "${rc}"
}

do_lease() {
  local out="${1:-${build}/results}" rc=0
  mkdir -p "${out}"
  export LD_LIBRARY_PATH="${build}/bench${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
  { nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
    uptime; } > "${out}/device.txt" 2>&1
  cat "${out}/device.txt"
  timeout 300 "${build}/tests/titans_cuda_tests" --warn NoTests --durations yes \
    > "${out}/cuda_tests.txt" 2>&1 || rc=$?
  echo "tests: exit ${rc}"; tail -n 3 "${out}/cuda_tests.txt"
  grep "worst relative error" "${out}/cuda_tests.txt" || true
  grep -B3 -A12 "FAILED" "${out}/cuda_tests.txt" | head -n 60 || true
  # The blocks', models' and trainer's tests with call graphs on (call_graph.cuh): the real
  # CUDA graph calls (build, node updates, launches), which the emulator stands in for.
  TITANS_CALL_GRAPHS=1 timeout 120 "${build}/tests/titans_cuda_tests" --warn NoTests \
    "cuda graphs*,cuda blocks*,cuda model*,cuda trainer*" > "${out}/graphs_tests.txt" 2>&1 \
    || echo "graphs tests: exit $?"
  echo "graphs tests: $(tail -n 2 "${out}/graphs_tests.txt" | tr '\n' ' ')"
  grep -B3 -A12 "FAILED" "${out}/graphs_tests.txt" | head -n 40 || true
  local tool
  for tool in memcheck racecheck; do
    TITANS_CUDA_PARITY_CASES=1 timeout 120 compute-sanitizer --tool "${tool}" --error-exitcode 9 \
      "${build}/tests/titans_cuda_tests" \
      "cuda memory: fused*,cuda memory: decode*,cuda launch*,cuda attention: warp*,cuda layers: fused*" \
      > "${out}/fused_${tool}.txt" 2>&1 \
      || echo "fused ${tool}: exit $?"
    echo "fused ${tool}: $(grep 'ERROR SUMMARY\|RACECHECK SUMMARY' "${out}/fused_${tool}.txt" || echo 'no summary')"
  done
  # Every block kind's and the model's training (MAC's staged reverse, the segment attention's
  # backward, the glue, AdamW) under memcheck: issue 30's device check.
  TITANS_CUDA_PARITY_CASES=1 timeout 180 compute-sanitizer --tool memcheck --error-exitcode 9 \
    "${build}/tests/titans_cuda_tests" \
    "cuda blocks*,cuda model*,cuda trainer*,cuda attention train*,cuda memory train*" \
    > "${out}/training_memcheck.txt" 2>&1 || echo "training memcheck: exit $?"
  echo "training memcheck: $(grep 'ERROR SUMMARY' "${out}/training_memcheck.txt" || echo 'no summary')"
  timeout 300 "${build}/bench/bench_cuda" --benchmark_counters_tabular=true \
    --benchmark_filter="${BENCH_FILTER:-BM_CublasSgemm|BM_CudaMemory|BM_CudaDecode|BM_CudaAttention|BM_CudaTrainStep|BM_CudaModelDecode}" \
    --benchmark_out="${out}/cuda_bench.json" --benchmark_out_format=json \
    > "${out}/cuda_bench.txt" 2>&1 || echo "bench: exit $?"
  grep -v "^\*\*\*\|^-\|^Run on\|^CPU Caches\|^  L[123]\|^Load Average" "${out}/cuda_bench.txt"
  # Where one forward's time goes: each kernel's device time (Nsight Compute, clocks as found).
  if command -v ncu > /dev/null; then
    timeout 150 ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
      "${build}/bench/bench_cuda" --benchmark_min_time=0.01 \
      --benchmark_filter="${NCU_FILTER:-BM_CudaMemory/B:256/N:512/tf32:1/fused:1}" \
      > "${out}/ncu.txt" 2>&1 || echo "ncu: exit $?"
    awk '/\)x\(/ { name = substr($0, 1, 110) } /gpu__time_duration.sum/ { print $NF, $(NF-3), name }' \
      "${out}/ncu.txt" | sort -rn | head -n 25
  fi
  return "${rc}"
}

# Where a memory training step's time goes, per kernel (Nsight Compute, one step each at
# B = 1 and B = 256; the backward's kernels were never profiled at B = 256).
do_profile() {
  local out="${1:-${build}/results}" b
  mkdir -p "${out}"
  export LD_LIBRARY_PATH="${build}/bench${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
  command -v ncu > /dev/null || { echo "profile: no ncu here"; return 1; }
  for b in "1/N:2048" "256/N:512"; do
    local tag="train_B${b%%/*}"
    timeout 240 ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
      "${build}/bench/bench_cuda" --benchmark_min_time=0.001 --benchmark_repetitions=1 \
      --benchmark_filter="BM_CudaMemoryTrain/B:${b}\$" > "${out}/ncu_${tag}.txt" 2>&1 \
      || echo "ncu ${tag}: exit $?"
    echo "${tag}: the 25 kernels of most device time (ms, launches, name)"
    awk '/\)x\(/ { name = substr($0, 1, 110) } /gpu__time_duration.sum/ { print $NF, $(NF-3), name }' \
      "${out}/ncu_${tag}.txt" | sort -rn | head -n 25
  done
}

do_peers() {
  local out="${1:-${build}/results}"
  mkdir -p "${out}"
  export LD_LIBRARY_PATH="${build}/bench${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/titans-peers \
    "${repo_root}"/.whl/*.whl
  PYTHONPATH=/tmp/titans-peers timeout 300 python3 "${repo_root}/tools/compare_pytorch_gpu.py" \
    --bench "${build}/bench/bench_cuda" | tee "${out}/peers.txt" || echo "peers: exit $?"
  # The one-layer MAC model against titans-pytorch's MAC transformer of depth 1.
  PYTHONPATH=/tmp/titans-peers timeout 300 python3 "${repo_root}/tools/compare_pytorch_gpu.py" \
    --bench "${build}/bench/bench_cuda" --mac | tee "${out}/peers_mac.txt"
}

case "${1:-all}" in
  build) do_build ;;
  run) do_run "${2:-}" ;;
  sanitize) do_sanitize "${2:-}" ;;
  lease) do_lease "${2:-}" ;;
  peers) do_peers "${2:-}" ;;
  profile) do_profile "${2:-}" ;;
  all) do_build && do_run ;;
  *) echo "usage: tools/gpu_check.sh [build | run [DIR] | sanitize [DIR] | lease [DIR] | peers [DIR] | profile [DIR]]" >&2
     exit 2 ;;
esac
