#!/usr/bin/env bash
# Copies a seeds.py results directory into docs/: docs/benchmarks/seeds.md (the report, with its
# plot links pointing into docs/benchmarks/seeds/) and docs/benchmarks/seeds/{*.png,results.json}.
# usage: bench/seeds/publish.sh RESULTS_DIR
set -euo pipefail
run=${1:?usage: $0 RESULTS_DIR}
repo=$(cd "$(dirname "$0")/../.." && pwd)
dst="$repo/docs/benchmarks"
mkdir -p "$dst/seeds"
cp "$run"/*.png "$dst/seeds/"
if [ -f "$run/results.json" ]; then cp "$run/results.json" "$dst/seeds/"; else cp "$run/results.partial.json" "$dst/seeds/"; fi
sed -E 's/\]\(([a-z0-9_-]+\.png)\)/](seeds\/\1)/' "$run/report.md" >"$dst/seeds.md"
echo "wrote $dst/seeds.md and $dst/seeds/"
