#!/bin/bash
# Per-thread CPU per request, 2 workers, and the in-process layout's CPU, HEAD against the
# ids-only attempt (/tmp/ids), alternating.
for r in 1 2; do
  for tree in /work/main /tmp/ids; do
    echo "== round $r $tree $(cd $tree && git rev-parse --short HEAD)$( [ $tree = /tmp/ids ] && echo '+ids_only_attempt.diff') $(date -u +%H:%M:%S)"
    (cd $tree && /work/main/.venv/bin/python /tmp/s9/threads.py 2 8 2>&1 | grep -E "rps|us/req")
    (cd $tree && /work/main/.venv/bin/python /tmp/per_process.py 1 8 nospy 2>&1 | tail -2)
  done
done
