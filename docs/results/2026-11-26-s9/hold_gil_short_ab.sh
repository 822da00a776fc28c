#!/bin/bash
# in-process layout: encodes of short requests hold the GIL (QA_HOLD_BELOW chars) or not
cd /work/main
for r in 1 2 3; do
  for v in 0 600; do
    echo "== round $r QA_HOLD_BELOW=$v $(date -u +%H:%M:%S)"
    QA_HOLD_BELOW=$v .venv/bin/python /tmp/per_process.py 1 8 nospy 2>&1 | tail -2
  done
done
