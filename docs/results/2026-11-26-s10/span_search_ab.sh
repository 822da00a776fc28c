#!/bin/bash
# Issue 10's command, alternating the numpy span search (QA_SPAN_SEARCH=numpy) and the C one, in
# one tree (run from its root, the extension built in place).
out=docs/results/2026-11-26-s10
for pair in ${PAIRS:-1 2}; do
  for search in numpy c; do
    echo "== pair $pair, span search $search, $(git rev-parse --short HEAD), $(date -u +%H:%M:%S)"
    QA_SPAN_SEARCH=$search .venv/bin/python bench/frontend.py --model_dir saved_models \
      --seconds 12 --rounds 3 --floor_seconds 4 --json $out/frontend_${search}_$pair.json
  done
done
