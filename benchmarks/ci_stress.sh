#!/usr/bin/env bash
# Issue 20's flakiness bar: .ci/run's last stage (the campaign beside the heavy tests, as CI runs
# them) RUNS times in a row, stopping at the first failure; one summary line per run with its
# seconds and the load average at its end. Load the machine as you choose while it runs (the
# closing note of issue 20 says how it was loaded) and run it from the repository root:
#
#     bash benchmarks/ci_stress.sh [RUNS=5] [LOG_DIR=ci-stress]
set -u
runs=${1:-5}
logs=${2:-ci-stress}
mkdir -p "$logs"
for i in $(seq 1 "$runs"); do
  start=$(date +%s)
  python -m pytest -q -m campaign -p no:cacheprovider >"$logs/run$i-campaign.log" 2>&1 &
  campaign=$!
  python -m pytest -q -m heavy -n 2 --dist loadfile -p no:cacheprovider >"$logs/run$i-heavy.log" 2>&1
  heavy_rc=$?
  wait "$campaign"
  campaign_rc=$?
  echo "run $i heavy rc=$heavy_rc campaign rc=$campaign_rc $(( $(date +%s) - start ))s load=$(cut -d' ' -f1-3 /proc/loadavg)" \
       "| $(tail -1 "$logs/run$i-heavy.log") | $(tail -1 "$logs/run$i-campaign.log")" | tee -a "$logs/summary.txt"
  if [ "$heavy_rc" -ne 0 ] || [ "$campaign_rc" -ne 0 ]; then exit 1; fi
done
echo "all $runs runs passed" | tee -a "$logs/summary.txt"
