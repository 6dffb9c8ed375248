#!/bin/bash
# What the KV cache events cost the step thread, counted in instructions (valgrind's
# callgrind; docs/design.md, "KV cache events"):
#   bash scripts/events_cost.sh [PAD ...]     (default: 0 100 1000)
# For each PAD, the environment padded by that many bytes (the heap's layout moves the
# counts by about 0.1 point from one layout to the next, so take several), the replay's
# instructions with events off and on (the cache's path: the pool writing the shared
# log, the publisher's process draining it), side by side, and the difference. Each
# pair takes ~4 minutes on two cores.
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
command -v valgrind >/dev/null || { echo "events_cost.sh: needs valgrind (apt-get install valgrind)"; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for pad in ${@:-0 100 1000}; do
  fill=$(head -c "$pad" /dev/zero | tr '\0' x)
  for mode in off proc-read; do
    KVDIST_PAD=$fill PYTHONPATH=$PWD PYTHONHASHSEED=0 valgrind --tool=callgrind --collect-atstart=no \
      --toggle-collect=starmap_next --callgrind-out-file="$tmp/$mode.out" \
      "$PY" scripts/events_cost.py $mode > "$tmp/$mode.log" 2>&1 &
  done
  wait
  off=$(awk '/Collected :/ {print $4}' "$tmp/off.log")
  on=$(awk '/Collected :/ {print $4}' "$tmp/proc-read.log")
  [ -n "$off" ] && [ -n "$on" ] || { echo "pad $pad: a run failed:"; tail -5 "$tmp"/*.log; exit 1; }
  awk -v p="$pad" -v a="$off" -v b="$on" \
    'BEGIN {printf "pad %5d: events off %.0f, on %.0f instructions: %+.2f%%\n", p, a, b, (b - a) / a * 100}'
done
