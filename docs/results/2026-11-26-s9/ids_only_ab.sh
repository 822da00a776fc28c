#!/bin/bash
# Alternate bench/frontend.py between the tree before (/tmp/base) and this one.
for r in 1 2 3; do
  for tree in /tmp/base /work/main; do
    echo "== round $r tree $tree $(cd $tree && git rev-parse --short HEAD) $(date -u +%H:%M:%S)"
    (cd $tree && /work/main/.venv/bin/python bench/frontend.py --model_dir saved_models/qa --seconds 8 --floor_seconds 3 --json /tmp/res/ab_$(basename $tree)_$r.json 2>&1 | grep -E "worker|scaling")
  done
done
