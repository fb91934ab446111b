#!/usr/bin/env bash
# The fingerprint benchmark of this checkout side by side with an earlier commit's: three
# alternating runs each (same venv, same machine, same load), printing the worst full-fingerprint
# / torch.sum ratio per dtype of each run (bench_fingerprint.py --json). Usage:
#     benchmarks/fingerprint_vs_commit.sh f6b0f98
set -euo pipefail
commit=${1:?usage: $0 COMMIT}
here=$(cd "$(dirname "$0")/.." && pwd)
old=$(mktemp -d)
trap 'git -C "$here" worktree remove --force "$old" >/dev/null 2>&1 || true' EXIT
git -C "$here" worktree add -q --detach "$old" "$commit"
python=${PYTHON:-$here/.venv/bin/python}
for i in 1 2 3; do
  for which in old new; do
    dir=$here; [ "$which" = old ] && dir=$old
    (cd "$dir" && PYTHONPATH="$dir" "$python" benchmarks/bench_fingerprint.py --runs 5 --sizes-mb 64 256 --threads 1 --path auto --json 2>/dev/null \
      | "$python" -c "import json,sys; d=json.load(sys.stdin); print('$which', $i, 'fp32', d['fingerprint_vs_sum_fp32']['value'], 'bf16', d['fingerprint_vs_sum_bf16']['value'])")
  done
done
