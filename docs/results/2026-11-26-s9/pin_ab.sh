#!/bin/bash
# Per-thread CPU per request, 2 workers: each worker pinned to a core of its own (PIN=1) or not.
cd /work/main
for r in 1 2 3; do
  for pin in 1 0; do
    echo "== round $r PIN=$pin $(git rev-parse --short HEAD) $(date -u +%H:%M:%S)"
    if [ $pin = 1 ]; then PIN=1 .venv/bin/python /tmp/s9/threads.py 2 8 2>&1 | grep -E "rps|total|pinned"
    else .venv/bin/python /tmp/s9/threads.py 2 8 2>&1 | grep -E "rps|total"; fi
  done
done
