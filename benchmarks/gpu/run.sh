#!/usr/bin/env bash
# The GPU verification (issue 21): every step in its own process under its own time limit, figures merged into
# OUT/gpu.json as each step goes, then OUT/gpu.md. How to run it on the GPU machine: benchmarks/gpu/README.md.
#
#   bash benchmarks/gpu/run.sh [--out DIR] [--dry-run]
#
# --out: default benchmarks/results (a dry run: a new temporary folder, never the committed results).
# --dry-run: every step at toy size on the CPU. GPU_COMMIT names the commit where the tree has no .git.
# Exit code: 0 when every step ended ok or skipped, 1 otherwise (the report is written either way).
set -u
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
dry="" out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry="--dry-run" ;;
    --out) out="$2"; shift ;;
    *) echo "usage: $0 [--out DIR] [--dry-run]" >&2; exit 2 ;;
  esac
  shift
done
if [ -z "$out" ]; then
  if [ -n "$dry" ]; then out="$(mktemp -d "${TMPDIR:-/tmp}/gpu-dry-run.XXXXXX")"; else out="$repo/benchmarks/results"; fi
fi
mkdir -p "$out"
PYTHON="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 VLASLURM_TRACKING=off MLFLOW_DISABLE_TELEMETRY=true
exec > >(tee "$out/gpu.log") 2>&1

# What the GPU image lacks travels as wheels in .whl/ (README.md); installed beside the image's packages.
if [ -z "$dry" ] && compgen -G "$repo/.whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-site \
    "$repo"/.whl/*.whl && export PYTHONPATH="/tmp/gpu-site${PYTHONPATH:+:$PYTHONPATH}"
fi

commit="${GPU_COMMIT:-$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)}"
if [ -z "${GPU_COMMIT:-}" ] && [ -n "$(git -C "$repo" status --porcelain --untracked-files=no 2>/dev/null)" ]; then
  commit="$commit (with uncommitted changes)"
fi
"$PYTHON" "$here/report.py" init --out "$out" --commit "$commit" $dry

failed=0
# script, step name, time limit in seconds (the steps aim to end 3 s before it: --budget-s)
for entry in "s1_environment environment 20" "s2_weight_sync weight_sync 60" "s3_offload offload 45" \
             "s4_models models 90" "s5_trainer trainer 60" "s6_maniskill maniskill 30" "s7_pi0 pi0 45"; do
  read -r script name limit <<<"$entry"
  echo "== $name (limit $limit s)"
  timeout --kill-after=3 "$limit" "$PYTHON" "$here/$script.py" --out "$out" --budget-s "$((limit - 3))" $dry
  rc=$?
  if [ "$rc" -ne 0 ]; then
    failed=1
    "$PYTHON" "$here/report.py" mark --out "$out" "$name" "$rc" "$limit"
  fi
done
"$PYTHON" "$here/report.py" md --out "$out"
echo "wrote $out/gpu.json and $out/gpu.md"
exit "$failed"
