#!/usr/bin/env bash
# tools/check_layering.sh [include-dir]: the include direction of the headers (docs/design.md,
# "Layers"). Every header of include/titans/ belongs to one layer, and may include headers of
# its own layer or of a lower one, never of a higher one:
#
#   0 base       the top-level headers (types, error, config, view, activation, fwd, limits)
#   1 detail     detail/: internal helpers of every layer above
#   2 contract   backend/*.hpp (what a backend is: traits, transfers, the host edge), threads.hpp
#   3 families   memory/, attention/, layers/: configurations, parameters, the kernels'
#                declarations (kernels_decl.hpp) and the layers; no family includes another
#   4 kernels    backend/<name>/: each backend's specialisations of the families' kernels
#   5 models     models/: blocks and the model
#   6 train      train/: optimiser, schedule, losses, trainer
#   6 text       text/: bytes as tokens, corpora, batches, sampling, generation
#   7 io         io/: files
#   7 mpi        mpi/: MPI as a data-parallel run's engine
#   7 nccl       nccl/: NCCL as a data-parallel run's engine on GPUs
#   8 umbrella   titans.hpp
#
# Prints every include that goes up (or across families), and every friend declaration naming
# a class defined in another top folder, and exits 1 if there is one.
set -euo pipefail
root="${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/include/titans}"
cd "${root}"

layer_of() {  # layer_of <path relative to include/titans> -> "<rank> <name>"
    case "$1" in
        titans.hpp) echo "8 umbrella" ;;
        threads.hpp) echo "2 contract" ;;
        */*/*) case "$1" in backend/*) echo "4 kernels:${1#backend/}" ;; *) echo "? ?" ;; esac ;;
        detail/*) echo "1 detail" ;;
        backend/*) echo "2 contract" ;;
        memory/* | attention/* | layers/*) echo "3 ${1%%/*}" ;;
        models/*) echo "5 models" ;;
        train/*) echo "6 train" ;;
        text/*) echo "6 text" ;;
        io/*) echo "7 io" ;;
        mpi/*) echo "7 mpi" ;;
        nccl/*) echo "7 nccl" ;;
        */*) echo "? ?" ;;
        *) echo "0 base" ;;
    esac
}

bad=0
while IFS= read -r -d '' file; do
    rel="${file#./}"
    read -r rank name <<<"$(layer_of "${rel}")"
    if [ "${rank}" = "?" ]; then
        echo "${rel}: in no layer (add its folder to tools/check_layering.sh)"; bad=1; continue
    fi
    dir="$(dirname "${rel}")"
    while IFS= read -r inc; do
        target="$(realpath -m --relative-to=. "${dir}/${inc}")"
        read -r trank tname <<<"$(layer_of "${target}")"
        if [ "${trank}" = "?" ] || [ "${trank}" -gt "${rank}" ]; then
            echo "${rel} (${name}) includes ${target} (${tname}): a higher layer"; bad=1
        elif [ "${trank}" -eq 3 ] && [ "${rank}" -eq 3 ] && [ "${tname}" != "${name}" ]; then
            echo "${rel} (${name}) includes ${target} (${tname}): another family"; bad=1
        elif [ "${trank}" -eq 4 ] && [ "${rank}" -eq 4 ] \
             && [ "${tname%%/*}" != "${name%%/*}" ]; then
            echo "${rel} (${name}) includes ${target} (${tname}): another backend"; bad=1
        fi
    done < <(sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p' "${file}")
done < <(find . -type f \( -name '*.hpp' -o -name '*.cuh' \) -print0 | sort -z)

# No friend across folders: a class befriended in a header is defined in the same top folder
# (backend/ counts as one: its kernels befriend the states of their own backend).
folder_of() { case "$1" in */*) echo "${1%%/*}" ;; *) echo "." ;; esac; }
while IFS= read -r -d '' file; do
    rel="${file#./}"
    while IFS= read -r friend; do
        [ -n "${friend}" ] || continue
        defined="$(grep -rlE "^[[:space:]]*(struct|class)[[:space:]]+${friend}\b[^;]*$" . \
                   --include='*.hpp' --include='*.cuh' | sed 's|^\./||' || true)"
        ok=0
        for d in ${defined}; do
            [ "$(folder_of "${d}")" = "$(folder_of "${rel}")" ] && ok=1
        done
        if [ "${ok}" -ne 1 ]; then
            echo "${rel}: befriends ${friend}, not a class of its folder"; bad=1
        fi
    done < <(sed -n 's/^[[:space:]]*friend[[:space:]]\{1,\}\(struct\|class\)[[:space:]]\{1,\}\([A-Za-z_:]*::\)\{0,1\}\([A-Za-z_][A-Za-z0-9_]*\).*/\3/p' "${file}")
done < <(find . -type f \( -name '*.hpp' -o -name '*.cuh' \) -print0 | sort -z)

if [ "${bad}" -ne 0 ]; then
    echo "check_layering: includes against the layer order, or friends across folders (see the"
    echo "header of this script)"
    exit 1
fi
echo "check_layering: every include goes to the same or a lower layer; no friend across folders"
