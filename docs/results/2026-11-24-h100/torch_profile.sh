# The last GPU call of 2026-11-24 (fifth session), as it ran on the H100 from the repository root.
# .gpu/env.sh there put the carried pinned packages (transformers 4.57.1, tokenizers 0.22.1, py-spy)
# on PYTHONPATH over the image's. Figures: docs/benchmarks.md, finding 5.
source .gpu/env.sh
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/deps/py_spy*.whl; ls /tmp/site/bin
M=saved_models/bert-base-random
(time timeout 100 python3 prepare_model.py --random_bert_base --model_dir $M) 2>&1 | tail -3
cat > /tmp/lean.py <<'PY'
import sys, json
sys.path.insert(0, ".")
from bench.pipeload import run_pipelined
from stress_test import load_pairs
if __name__ == "__main__":
    r = run_pipelined("127.0.0.1", int(sys.argv[1]), load_pairs(None), connections=32, pipeline=16, processes=2, seconds=float(sys.argv[2]))
    print("LOAD", sys.argv[3], round(r["throughput_rps"], 1), r["errors"], flush=True)
PY
run() {  # $1 label, rest: server flags
  L=$1; shift
  python3 server.py --port 7720 --model_dir $M --inference_engine_type pytorch --device cuda --precision fp16 "$@" > /tmp/s_$L.log 2>&1 & P=$!
  for i in $(seq 60); do sleep 1; grep -q "serving on" /tmp/s_$L.log && break; done
  grep -o "engine: pytorch.*" /tmp/s_$L.log | head -1 | cut -c1-150
  python3 /tmp/lean.py 7720 2 warm >/dev/null 2>&1
  python3 /tmp/lean.py 7720 8 $L & LP=$!
  sleep 2; [ "$L" = base ] && /tmp/site/bin/py-spy record -p $P -d 4 -r 200 -f raw -o $OUT/torch_$L.txt --nonblocking >/dev/null 2>&1
  [ "$L" = base ] && /tmp/site/bin/py-spy record -p $P -d 1 -r 200 --gil -f raw -o $OUT/torch_gil_$L.txt --nonblocking >/dev/null 2>&1
  wait $LP; kill -TERM $P; wait $P
}
run base
run t1 --threads_per_session 1
run s1 --num_inference_sessions 1 --threads_per_session 1
