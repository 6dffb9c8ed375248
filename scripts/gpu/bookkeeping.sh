#!/usr/bin/env bash
# Bookkeeping benchmarks (issues 2 and 9) on the device machine's CPU, which is quieter
# than a shared dev box. No GPU is used. From the repo root: bash scripts/gpu/bookkeeping.sh
# Prints: bench manager (kvdist vs a deque+dict pure-Python block manager on a serving
# trace) and bench scale (1.1M-block cache: create time, memory per block, step cost).
set -u
if [ -d .whl ]; then source scripts/gpu/env.sh || exit 1; fi  # this workplace's carried wheels
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1  # no progress bars in the log
echo "== node: $(nproc) cores, $(python3 -c 'import platform; print(platform.processor() or platform.machine())')," \
     "python $(python3 -c 'import sys; print(sys.version.split()[0])')"
echo "== bench manager"
python3 -m kvdist bench manager
echo "== bench scale"
python3 -m kvdist bench scale
