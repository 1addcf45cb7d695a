#!/usr/bin/env bash
# bench/decode_contention.sh: bench_decode on a quiet machine and under load, each with the
# library's default threads and with OMP_NUM_THREADS=1, then one table (tools/decode_report.py).
#
#   bash bench/decode_contention.sh [BUILD_DIR] [OUT_DIR] [-- extra bench_decode flags]
#
# Load: 0, 1 and 2 busy-loop processes (`while :; do :; done`), started by this script before
# a run and stopped after it (also on Ctrl-C). Every run writes OUT_DIR/busy<K>_<threads>.json;
# the report compares each benchmark's time with its OMP_NUM_THREADS=1 time under the same load
# (the issue's target: within 1.2x) and the decode rates with the chunked rate of the same run.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
build="${1:-$here/../build/release}"
out="${2:-$build/decode_contention}"
shift $(( $# >= 2 ? 2 : $# ))
[[ "${1:-}" == "--" ]] && shift
bench="$build/bench/bench_decode"
[[ -x "$bench" ]] || { echo "no $bench: cmake --build --preset release --target bench_decode" >&2; exit 1; }
mkdir -p "$out"

busy_pids=()
stop_busy() {
  for p in "${busy_pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${busy_pids[@]}"; do wait "$p" 2>/dev/null || true; done
  busy_pids=()
}
trap stop_busy EXIT INT TERM

for busy in 0 1 2; do
  for threads in default 1; do
    for ((i = 0; i < busy; ++i)); do
      bash -c 'while :; do :; done' &
      busy_pids+=($!)
    done
    sleep 0.5
    echo "== $busy busy loop(s), threads: $threads" >&2
    env_args=()
    [[ "$threads" == 1 ]] && env_args=(OMP_NUM_THREADS=1)
    env "${env_args[@]}" "$bench" --benchmark_format=json \
        --benchmark_out="$out/busy${busy}_${threads}.json" "$@" > /dev/null
    stop_busy
  done
done
python3 "$here/../tools/decode_report.py" "$out"
