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
#   tools/gpu_check.sh pack [FROM]
#                                 the test, benchmark and example binaries of a build made
#                                 here (default build/release; the GPU test runner built
#                                 first if that build left it out) into build/gpu-carry with
#                                 libbenchmark and libgomp (about 40 MB): carry that folder to
#                                 a lent machine and run the steps below there with
#                                 GPU_CHECK_BUILD=build/gpu-carry, no build on its minutes
#   tools/gpu_check.sh lease [DIR]
#                                 one lent machine's call, all inside LEASE_SECONDS (540), each
#                                 step under its own limit, in this order: the tests; the
#                                 blocks', models' and trainer's tests again with call graphs
#                                 and the fused feed-forward on (graphs_tests.txt); the
#                                 memory, decode, attention, model decode and Trainer-step
#                                 benchmarks (BENCH_FILTER overrides which); the headline memory's kernels under Nsight Compute
#                                 (ncu.txt); the fused and decode kernels', the per-pair
#                                 launches', the warp-tiled attention's and the fused norms'
#                                 tests under memcheck and racecheck (fused_memcheck.txt,
#                                 fused_racecheck.txt); the block, model and trainer tests
#                                 under memcheck (training_memcheck.txt)
#   tools/gpu_check.sh peers [DIR]
#                                 titans-pytorch's NeuralMemory, then its MAC transformer of
#                                 depth 1 (--mac), against bench_cuda on the same GPU
#                                 (tools/compare_pytorch_gpu.py): needs the wheels that
#                                 tools/peer_wheels.py puts in .whl here, carried with the build
#   tools/gpu_check.sh profile [DIR]
#                                 each kernel's device time in one memory training step
#                                 (BM_CudaMemoryTrain) at B = 1 and B = 256 (Nsight Compute):
#                                 ncu_train_B1.txt, ncu_train_B256.txt and the top 25 of each
#   tools/gpu_check.sh decode [DIR]
#                                 where a decoded token's time goes: the few-row
#                                 feed-forward's, few-row product's and split decode
#                                 attention's tests, the decode, few-row product and decode
#                                 attention benchmarks, each kernel's device time at B = 1
#                                 (the memory, and at B = 1024 too; the model with its products on cuBLAS, the
#                                 feed-forward in one launch, the products in
#                                 rows_product_kernel, those and the split attention),
#                                 the headline forward's kernels (the checks' flat walk, also
#                                 alone: BM_CudaChecks; the row kernels' bandwidth,
#                                 occupancy, stalls), racecheck on
#                                 the three kernels (about 9 minutes)
#   tools/gpu_check.sh cluster [DIR]
#                                 the fused kernel as clusters of blocks a pair
#                                 (memory_cluster.cuh): its tests, the headline forward with
#                                 one block a pair and as clusters in the same run, each
#                                 kernel's device time (Nsight Compute), racecheck and memcheck
#                                 on its test (about 5 minutes)
#   tools/gpu_check.sh next [DIR]
#                                 what no GPU has timed yet, in one call of about 7 minutes
#                                 (LEASE_SECONDS, default 540, bounds it): the newer kernels'
#                                 tests, racecheck on the cluster kernel, the benchmarks that
#                                 set their defaults, the cluster forward's and a B = 256
#                                 training step's kernels (Nsight Compute), then the suite.
#                                 The one call to make when a session is lent a GPU (15
#                                 minutes of device time, starts included)
#
# The figures in docs/performance.md ("CUDA backend") come from `run`.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# GPU_CHECK_BUILD: the build folder the run steps use (default build/gpu-check; `pack` fills
# build/gpu-carry, which a lent machine can use without building).
build="${GPU_CHECK_BUILD:-${repo_root}/build/gpu-check}"
case "${build}" in /*) ;; *) build="${repo_root}/${build}" ;; esac

# The binaries the run steps need, from a build folder made here (default build/release, as CI's
# `cmake --build --preset release` leaves it, or build/gpu-check), into build/gpu-carry with
# the shared libraries a bare GPU machine may lack: about 40 MB, under the device tool's 64 MiB
# carry, so that a lent machine's minutes go to the checks (run there with
# GPU_CHECK_BUILD=build/gpu-carry; nvcc 13.0 here and there, sm_90 code).
do_pack() {
  local from="${1:-${repo_root}/build/release}" to="${repo_root}/build/gpu-carry" f lib
  rm -rf "${to}"
  mkdir -p "${to}/tests" "${to}/bench" "${to}/examples"
  # A build configured where no GPU was seen (CI's) leaves the GPU test runner out
  # (TITANS_CUDA_TESTS=AUTO): turn it on and build it and the CUDA binaries.
  if [ ! -x "${from}/tests/titans_cuda_tests" ]; then
    cmake "${from}" -DTITANS_CUDA_TESTS=ON > /dev/null
    cmake --build "${from}" -j 2 --target titans_cuda_tests bench_cuda 07_cuda_memory
  fi
  for f in tests/titans_cuda_tests bench/bench_cuda examples/07_cuda_memory; do
    [ -x "${from}/${f}" ] || { echo "pack: ${from}/${f} not built" >&2; return 1; }
    cp "${from}/${f}" "${to}/${f}"
  done
  for lib in $(ldd "${to}/bench/bench_cuda" "${to}/tests/titans_cuda_tests" \
                 | awk '/libbenchmark|libgomp/ {print $3}' | sort -u); do
    cp -L "${lib}" "${to}/bench/"
  done
  if ldd "${to}/tests/titans_cuda_tests" | grep -q libnccl; then
    echo "pack: this build links NCCL, which does not travel: the lease looks for the device's"
    echo "      (python3's nvidia-nccl); else pack a build made with -DTITANS_ENABLE_NCCL=OFF"
  fi
  du -sh "${to}"
}

# The device's NCCL for a packed build that links it (the image has it as a Python package).
nccl_path() {
  python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' \
    2> /dev/null || true
}

do_build() {
  # NCCL (the test "cuda nccl: one rank") only with GPU_CHECK_NCCL=ON: its library (hundreds
  # of MB) does not travel with the build, so the device must have it.
  cmake -S "${repo_root}" -B "${build}" -DCMAKE_BUILD_TYPE=Release -DTITANS_ENABLE_CUDA=ON \
    -DTITANS_BUILD_EXAMPLES=ON -DTITANS_IO=AUTO -DTITANS_HEADER_CHECK=OFF -DTITANS_INSTALL=OFF \
    -DTITANS_ENABLE_NCCL="${GPU_CHECK_NCCL:-OFF}" -DTITANS_CUDA_TESTS=ON
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

# lease: the steps in order of what a lent machine is for (the tests, the tests with call
# graphs, the timings, where the time goes, then the sanitizers), each under its own limit and
# all under LEASE_SECONDS (default 540, inside the device tool's 600 s a command): a step that
# would start with under 20 s left is skipped and says so.
lease_left() { echo $(( ${LEASE_SECONDS:-540} - ($(date +%s) - lease_t0) )); }
lease_step() {  # lease_step <seconds wanted> <name> <command...>: under min(wanted, left)
  local want=$1 name=$2 left
  shift 2
  left=$(lease_left)
  (( left < want )) && want=${left}
  if (( want < 20 )); then
    echo "${name}: skipped (the lease's ${LEASE_SECONDS:-540} s are spent)"
    return 0
  fi
  # (a step is a function here: exported, and run by a bash under timeout)
  timeout "${want}" bash -c '"$@"' lease_step "$@" || echo "${name}: exit $?"
}

lease_tests() {
  "${build}/tests/titans_cuda_tests" --warn NoTests --durations yes > "${out}/cuda_tests.txt" 2>&1
}
# The blocks', models' and trainer's tests with call graphs on (call_graph.cuh): the real CUDA
# graph calls (build, node updates, launches), which the emulator stands in for; and with the
# feed-forward of few rows in one launch (feed_forward_rows.cuh).
lease_graphs() {
  TITANS_CALL_GRAPHS=1 TITANS_FUSED_FFN=1 "${build}/tests/titans_cuda_tests" --warn NoTests \
    "cuda graphs*,cuda blocks*,cuda model*,cuda trainer*" > "${out}/graphs_tests.txt" 2>&1
}
lease_bench() {
  "${build}/bench/bench_cuda" --benchmark_counters_tabular=true \
    --benchmark_filter="${BENCH_FILTER:-BM_CublasSgemm|BM_CudaMemory|BM_CudaDecode|BM_CudaAttention|BM_CudaTrainStep|BM_CudaModelDecode}" \
    --benchmark_out="${out}/cuda_bench.json" --benchmark_out_format=json \
    > "${out}/cuda_bench.txt" 2>&1
}
# Where one forward's time goes: each kernel's device time (Nsight Compute, clocks as found).
lease_ncu() {
  ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
    "${build}/bench/bench_cuda" --benchmark_min_time=0.01 \
    --benchmark_filter="${NCU_FILTER:-BM_CudaMemory/B:256/N:512/tf32:1/fused:1}" \
    > "${out}/ncu.txt" 2>&1
}
lease_fused_sanitizer() {  # <memcheck | racecheck>
  TITANS_CUDA_PARITY_CASES=1 compute-sanitizer --tool "$1" --error-exitcode 9 \
    "${build}/tests/titans_cuda_tests" \
    "cuda memory: fused*,cuda memory: decode*,cuda launch*,cuda attention: warp*,cuda layers: fused*" \
    > "${out}/fused_$1.txt" 2>&1
}
# Every block kind's and the model's training (MAC's staged reverse, the segment attention's
# backward, the glue, AdamW) under memcheck: issue 30's device check.
lease_training_memcheck() {
  TITANS_CUDA_PARITY_CASES=1 compute-sanitizer --tool memcheck --error-exitcode 9 \
    "${build}/tests/titans_cuda_tests" \
    "cuda blocks*,cuda model*,cuda trainer*,cuda attention train*,cuda memory train*" \
    > "${out}/training_memcheck.txt" 2>&1
}

do_lease() {
  out="${1:-${build}/results}"
  lease_t0=$(date +%s)
  export out build BENCH_FILTER NCU_FILTER
  export -f lease_tests lease_graphs lease_bench lease_ncu lease_fused_sanitizer \
    lease_training_memcheck
  local tool
  mkdir -p "${out}"
  rm -f "${out}"/cuda_tests.txt "${out}"/graphs_tests.txt "${out}"/cuda_bench.* "${out}"/ncu.txt \
    "${out}"/fused_*.txt "${out}"/training_memcheck.txt
  local nccl
  nccl="$(nccl_path)"
  export LD_LIBRARY_PATH="${build}/bench${nccl:+:${nccl}}${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
  { nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
    uptime; } > "${out}/device.txt" 2>&1
  cat "${out}/device.txt"
  lease_step 240 tests lease_tests
  tail -n 3 "${out}/cuda_tests.txt" 2>/dev/null || true
  grep "worst relative error" "${out}/cuda_tests.txt" 2>/dev/null || true
  grep -B3 -A12 "FAILED" "${out}/cuda_tests.txt" 2>/dev/null | head -n 60 || true
  lease_step 90 "graphs tests" lease_graphs
  echo "graphs tests: $(tail -n 2 "${out}/graphs_tests.txt" 2>/dev/null | tr '\n' ' ')"
  grep -B3 -A12 "FAILED" "${out}/graphs_tests.txt" 2>/dev/null | head -n 40 || true
  lease_step 200 bench lease_bench
  grep -v "^\*\*\*\|^-\|^Run on\|^CPU Caches\|^  L[123]\|^Load Average" "${out}/cuda_bench.txt" \
    2>/dev/null || true
  if command -v ncu > /dev/null; then
    lease_step 100 ncu lease_ncu
    awk '/\)x\(/ { name = substr($0, 1, 110) } /gpu__time_duration.sum/ { print $NF, $(NF-3), name }' \
      "${out}/ncu.txt" 2>/dev/null | sort -rn | head -n 25
  fi
  for tool in memcheck racecheck; do
    lease_step 90 "fused ${tool}" lease_fused_sanitizer "${tool}"
    echo "fused ${tool}: $(grep 'ERROR SUMMARY\|RACECHECK SUMMARY' "${out}/fused_${tool}.txt" 2>/dev/null || echo 'no summary')"
  done
  lease_step 120 "training memcheck" lease_training_memcheck
  echo "training memcheck: $(grep 'ERROR SUMMARY' "${out}/training_memcheck.txt" 2>/dev/null || echo 'no summary')"
  echo "lease: $(( $(date +%s) - lease_t0 )) s"
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
      --benchmark_filter="BM_CudaMemoryTrain/B:${b}/fbwd:1/cl:0/" > "${out}/ncu_${tag}.txt" 2>&1 \
      || echo "ncu ${tag}: exit $?"
    echo "${tag}: the 25 kernels of most device time (ms, launches, name)"
    awk '/\)x\(/ { name = substr($0, 1, 110) } /gpu__time_duration.sum/ { print $NF, $(NF-3), name }' \
      "${out}/ncu_${tag}.txt" | sort -rn | head -n 25
  done
}

# Where a decoded token's time goes (issue 33's decode targets): the few-row feed-forward's
# tests (with it on, the models' and blocks' too), the decode benchmarks, each kernel's device
# time over a decode run at B = 1 (the memory alone, the 4-block model with the feed-forward on
# cuBLAS and in one launch; Nsight Compute, clocks as found), and racecheck on the few-row
# feed-forward's kernel: ffn_tests.txt, decode_bench.txt, ncu_decode.txt, ncu_model.txt,
# ncu_model_ffn.txt, ffn_racecheck.txt; and the headline forward's kernels (ncu_forward.txt:
# the non-finite checks' flat walk; ncu_forward_detail.txt: its row kernels' bandwidth,
# occupancy and stalls). About 9 minutes.
# An Nsight Compute per-kernel summary as one line a kernel: its total device time (mean x
# launches, microseconds), its mean, its launches and its name; the largest total first.
ncu_totals() {
  awk '/\)x\(/ { name = substr($0, 1, 90); match($0, /Invocations [0-9]+/)
                   n = substr($0, RSTART + 12, RLENGTH - 12) + 0 }
       /gpu__time_duration.sum/ { v = $NF; u = $(NF - 3)
         if (u == "ms") v *= 1000; else if (u == "ns") v /= 1000; else if (u == "s") v *= 1e6
         printf "%11.1f us %9.2f us %7d x %s\n", v * n, v, n, name }' "$1" | sort -rn
}
# A step's start, for its caller's locals out, t and b: the results folder (argument, default
# build/results) made, the packed libraries on the library path, the test runner and the
# benchmark's paths.
step_start() {
  out="${1:-${build}/results}"
  mkdir -p "${out}"
  export LD_LIBRARY_PATH="${build}/bench${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
  t="${build}/tests/titans_cuda_tests"
  b="${build}/bench/bench_cuda"
}
# ncu_kernels <name> <filter> <n>: each kernel's device time in the benchmarks matching filter
# (Nsight Compute) into ncu_<name>.txt in the results folder, the n of most time echoed.
ncu_kernels() {
  timeout 40 ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
    "${b}" --benchmark_min_time=0.01 --benchmark_filter="$2" > "${out}/ncu_$1.txt" 2>&1 \
    || echo "ncu $1: exit $?"
  echo "ncu $1: the $3 kernels of most device time (total, mean, launches, name)"
  ncu_totals "${out}/ncu_$1.txt" | head -n "$3"
}
# tests_to <file> <seconds> <filter>: the test runner's cases matching filter (the caller's
# environment), the output to <file> in the results folder, its last two lines echoed.
tests_to() {
  timeout "$2" "${t}" --warn NoTests "$3" > "${out}/$1" 2>&1 || echo "$1: exit $?"
  echo "$1: $(tail -n 2 "${out}/$1" | tr '\n' ' ')"
}
do_decode() {
  local out t b
  step_start "${1:-}"
  TITANS_FUSED_FFN=1 tests_to ffn_tests.txt 50 "cuda layers: few-row FFN*,cuda model*,cuda blocks*"
  TITANS_ROWS_PRODUCT=1 TITANS_SPLIT_DECODE=1 tests_to rows_tests.txt 60 \
    "cuda layers: few-row product*,cuda attention: split*,cuda model*,cuda blocks*,cuda memory: the non-finite*,cuda launch: clusters"
  timeout 100 "${b}" --benchmark_counters_tabular=true --benchmark_repetitions=2 \
    --benchmark_min_time=0.25 --benchmark_filter='BM_CudaModelDecode|BM_CudaDecode/B:1(024)?/|BM_CudaRowsProduct|BM_CudaDecodeAtt|BM_CudaChecks' \
    > "${out}/decode_bench.txt" 2>&1 || echo "decode bench: exit $?"
  grep "^BM_" "${out}/decode_bench.txt" || true
  local f m=BM_CudaModelDecode/B:1/pooled:1/graphs:0
  for f in decode:BM_CudaDecode/B:1/decode:1/rows:0 decode1024:BM_CudaDecode/B:1024/decode:1/rows:0 \
           model:${m}/ffn:0/opt:0 \
           model_ffn:${m}/ffn:1/opt:0 model_rows:${m}/ffn:0/opt:1 model_opt:${m}/ffn:0/opt:3 \
           forward:BM_CudaMemory/B:256/N:512/tf32:1/fused:1; do
    ncu_kernels "${f%%:*}" "${f#*:}" 20
  done
  # Why the headline forward's row kernels run 3-4x their bytes' time (the conv 1.63 ms, the
  # checks 1.33, 2026-11-30): bandwidth, occupancy and stall reasons, each kernel's first two.
  timeout 60 ncu --clock-control none -k 'regex:conv_tile|flag_rows|l2_rows|copy_rows' -c 8 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    "${b}" --benchmark_min_time=0.01 --benchmark_filter='BM_CudaMemory/B:256/N:512/tf32:1/fused:1/' \
    > "${out}/ncu_forward_detail.txt" 2>&1 || echo "ncu forward detail: exit $?"
  grep -E "^  [a-z_]+.*\(|Memory Throughput|Achieved Occupancy|Registers Per|Duration|Stall" \
    "${out}/ncu_forward_detail.txt" | head -n 60 || true
  TITANS_CUDA_PARITY_CASES=1 timeout 40 compute-sanitizer --tool racecheck --error-exitcode 9 \
    "${t}" "cuda layers: few-row FFN*,cuda layers: few-row product*,cuda attention: split decode*" \
    > "${out}/ffn_racecheck.txt" 2>&1 || echo "ffn racecheck: exit $?"
  echo "ffn racecheck: $(grep 'RACECHECK SUMMARY' "${out}/ffn_racecheck.txt" || echo 'no summary')"
}

# The fused kernel as clusters of blocks a pair (memory_cluster.cuh): its test on the GPU, under
# racecheck and memcheck (one case a sweep), the headline forward with one block a pair
# (fused:1) and as clusters (fused:3) in the same run, and each kernel's device time.
do_cluster() {
  local out t b
  step_start "${1:-}"
  tests_to cluster_tests.txt 60 \
    "cuda memory: fused cluster,cuda memory: cluster huge values,cuda memory: fused chunks,cuda launch: clusters"
  timeout 60 "${b}" --benchmark_counters_tabular=true --benchmark_repetitions=3 \
    --benchmark_min_time=0.25 --benchmark_filter='BM_CublasSgemm|BM_CudaMemory/B:(64|256)/N:(1024|512)/tf32:1/fused:[13]' \
    > "${out}/cluster_bench.txt" 2>&1 || echo "cluster bench: exit $?"
  grep "^BM_" "${out}/cluster_bench.txt" || true
  local f
  for f in 1 3; do
    ncu_kernels "cluster_${f}" "BM_CudaMemory/B:256/N:512/tf32:1/fused:${f}/" 10
  done
  local tool
  for tool in racecheck memcheck; do
    TITANS_CUDA_PARITY_CASES=1 timeout 60 compute-sanitizer --tool "${tool}" --error-exitcode 9 \
      "${t}" "cuda memory: fused cluster" > "${out}/cluster_${tool}.txt" 2>&1 \
      || echo "cluster ${tool}: exit $?"
    echo "cluster ${tool}: $(grep -E 'SUMMARY' "${out}/cluster_${tool}.txt" || echo 'no summary')"
  done
}

# next: what no GPU has timed yet, in one device call of about 6 minutes (a session is lent
# 15): the decode kernel as clusters of blocks a pair (set_decode_cluster) and at 80 registers
# a thread: the memory's, models' and blocks' tests as they are and with
# TITANS_DECODE_CLUSTER=1 (clusters of 4 wherever a decode kernel runs over at most 128
# pairs), racecheck on the cluster kernel's test, the decode benchmarks (B 1 with clusters of
# 2, 4, 8 and without; B 16, 1024; the model's token with and without clusters), each kernel's
# device time of a decoded token at B 1 as clusters and at B 1024, and the cluster kernel's
# throughput, occupancy and warp states: next_tests.txt, cluster_tests.txt,
# decode_racecheck.txt, next_bench.txt, cluster_bench.txt, ncu_decode_cluster.txt,
# ncu_decode1024.txt, ncu_detail.txt.
do_next() {
  local out t b t0
  t0=$(date +%s)
  step_start "${1:-}"
  { nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
    uptime; } > "${out}/device.txt" 2>&1
  tests_to next_tests.txt 60 "cuda memory: decode*,cuda model*,cuda memory: the non-finite*,cuda launch*"
  TITANS_DECODE_CLUSTER=1 tests_to cluster_tests.txt 90 "cuda memory*,cuda model*,cuda blocks*"
  grep -h -B3 -A12 "FAILED" "${out}/next_tests.txt" "${out}/cluster_tests.txt" | head -n 40 || true
  timeout 40 compute-sanitizer --tool racecheck --error-exitcode 9 \
    "${t}" "cuda memory: decode kernel as clusters - float" > "${out}/decode_racecheck.txt" 2>&1 \
    || echo "decode cluster racecheck: exit $?"
  echo "decode cluster racecheck: $(grep -E 'SUMMARY' "${out}/decode_racecheck.txt" || echo 'no summary')"
  timeout 100 "${b}" --benchmark_counters_tabular=true --benchmark_repetitions=2 \
    --benchmark_min_time=0.2 \
    --benchmark_filter='BM_CudaDecode/B:(1|16|1024)/decode:1/|BM_CudaModelDecode/B:1/pooled:1/graphs:[01]/ffn:0/opt:[023]/' \
    > "${out}/next_bench.txt" 2>&1 || echo "next bench: exit $?"
  grep "^BM_" "${out}/next_bench.txt" | grep -v "_mean\|_stddev\|_cv" || true
  TITANS_DECODE_CLUSTER=1 timeout 50 "${b}" --benchmark_counters_tabular=true \
    --benchmark_repetitions=2 --benchmark_min_time=0.2 \
    --benchmark_filter='BM_CudaModelDecode/B:1/pooled:1/graphs:[01]/ffn:0/opt:[23]/' \
    > "${out}/cluster_bench.txt" 2>&1 || echo "cluster bench: exit $?"
  grep "^BM_" "${out}/cluster_bench.txt" | grep -v "_mean\|_stddev\|_cv" || true
  ncu_kernels decode_cluster "BM_CudaDecode/B:1/decode:1/rows:0/cluster:4/" 12
  ncu_kernels decode1024 "BM_CudaDecode/B:1024/decode:1/rows:0/cluster:0/" 12
  timeout 60 ncu --clock-control none -k 'regex:decode_' -c 2 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    "${b}" --benchmark_min_time=0.01 \
    --benchmark_filter='BM_CudaDecode/B:1/decode:1/rows:0/cluster:4/' \
    > "${out}/ncu_detail.txt" 2>&1 || echo "ncu detail: exit $?"
  grep -E "^  [a-z_]+.*\(|Memory Throughput|Achieved Occupancy|Registers Per|Duration|Warp Cycles" \
    "${out}/ncu_detail.txt" | head -n 30 || true
  echo "next: $(( $(date +%s) - t0 )) s"
}

do_peers() {
  local out="${1:-${build}/results}"
  mkdir -p "${out}"
  export LD_LIBRARY_PATH="${build}/bench${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/titans-peers \
    "${repo_root}"/.whl/*.whl
  local s0 limit="${PEERS_SECONDS:-600}"
  s0=$(date +%s)
  PYTHONPATH=/tmp/titans-peers timeout $(( limit < 300 ? limit : 300 )) python3 \
    "${repo_root}/tools/compare_pytorch_gpu.py" --bench "${build}/bench/bench_cuda" \
    | tee "${out}/peers.txt" || echo "peers: exit $?"
  # The one-layer MAC model against titans-pytorch's MAC transformer of depth 1.
  limit=$(( limit - ($(date +%s) - s0) ))
  (( limit > 30 )) || { echo "peers MAC: no time left"; return 0; }
  PYTHONPATH=/tmp/titans-peers timeout $(( limit < 300 ? limit : 300 )) python3 \
    "${repo_root}/tools/compare_pytorch_gpu.py" --bench "${build}/bench/bench_cuda" --mac \
    | tee "${out}/peers_mac.txt" || echo "peers MAC: exit $?"
}

case "${1:-all}" in
  build) do_build ;;
  run) do_run "${2:-}" ;;
  sanitize) do_sanitize "${2:-}" ;;
  lease) do_lease "${2:-}" ;;
  pack) do_pack "${2:-}" ;;
  peers) do_peers "${2:-}" ;;
  profile) do_profile "${2:-}" ;;
  decode) do_decode "${2:-}" ;;
  cluster) do_cluster "${2:-}" ;;
  next) do_next "${2:-}" ;;
  all) do_build && do_run ;;
  *) echo "usage: tools/gpu_check.sh [build | pack [FROM] | run [DIR] | sanitize [DIR] | lease [DIR] | peers [DIR] | profile [DIR] | decode [DIR] | cluster [DIR] | next [DIR]]" >&2
     exit 2 ;;
esac
