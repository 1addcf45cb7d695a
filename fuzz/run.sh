#!/usr/bin/env bash
# fuzz/run.sh [seconds_per_target]: build the libFuzzer targets (CMake preset `fuzz`, clang) and
# run each one for N seconds (default 30) on a COPY of its seed corpus fuzz/corpus/<name>/, so
# the repository stays clean: the working corpus, the logs and any crash artifacts are under
# build/fuzz/fuzz_run/<name>/. Prints the executions per target; exits non-zero on any crash,
# leak, timeout, OOM or sanitizer report.
#
# The random seed is fixed (TITANS_FUZZ_SEED, default 1): libFuzzer's mutations are then the
# same sequence on every machine, so a run that passes locally passes in CI when CI executes no
# more inputs; set another seed (or 0: libFuzzer draws one) to explore further.
#
# To reproduce an artifact:  build/fuzz/fuzz/titans_fuzz_<name> <artifact file>
set -euo pipefail

seconds=${1:-30}
seed=${TITANS_FUZZ_SEED:-1}
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${repo_root}"

cmake --preset fuzz
cmake --build --preset fuzz

build_dir="${repo_root}/build/fuzz"
targets=(safetensors checkpoint optimizer)
status=0
summary=()
for t in "${targets[@]}"; do
  bin="${build_dir}/fuzz/titans_fuzz_${t}"
  work="${build_dir}/fuzz_run/${t}"
  rm -rf "${work}"
  mkdir -p "${work}/corpus" "${work}/artifacts"
  cp "${repo_root}/fuzz/corpus/${t}/"* "${work}/corpus/"
  echo "==> fuzzing ${t} for ${seconds}s, seed ${seed} (corpus: $(ls "${work}/corpus" | wc -l) files, log: ${work}/log.txt)"
  set +e
  "${bin}" "${work}/corpus" \
    -max_total_time="${seconds}" -seed="${seed}" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="${work}/artifacts/" >"${work}/log.txt" 2>&1
  rc=$?
  set -e
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "${work}/log.txt" | tail -n 1 | grep -o '[0-9]*$' || true)
  rate=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "${work}/log.txt" | tail -n 1 | grep -o '[0-9]*$' || true)
  cov=$(grep -o 'cov: [0-9]*' "${work}/log.txt" | tail -n 1 | grep -o '[0-9]*$' || true)
  line="${t}: ${execs:-?} executions (${rate:-?} exec/s, cov ${cov:-?}), exit ${rc}"
  artifacts=$(ls -A "${work}/artifacts")
  if [ "${rc}" -ne 0 ] || [ -n "${artifacts}" ]; then
    status=1
    line="${line}: FAILED, artifacts in ${work}/artifacts/: ${artifacts:-none}"
    echo "---- last lines of ${work}/log.txt"
    tail -n 60 "${work}/log.txt"
  fi
  echo "${line}"
  summary+=("${line}")
done

echo
echo "==> fuzz summary (${seconds}s per target)"
for s in "${summary[@]}"; do echo "    ${s}"; done
exit "${status}"
