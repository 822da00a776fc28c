source .gpu/env.sh
M=saved_models/bert-base-random
python3 server.py --port 7741 --model_dir $M --inference_engine_type pytorch --device cuda --precision fp16 --length_buckets 64,128,256,384 > /tmp/p7.log 2>&1 & P=$!
for i in $(seq 60); do sleep 1; grep -q "serving on" /tmp/p7.log && break; done
cat > /tmp/cm.py <<'PY'
import json, sys
sys.path.insert(0, ".")
from client import Client
with Client("127.0.0.1", 7741) as c:
    s = c.stats(timeout=30)
    print(sys.argv[1], "hist", s["batch_size_histogram"], "engine p50", round(s["engine_time"]["p50_ms"], 1))
    print(" cost", {k: round(v, 1) for k, v in s["batching"]["cost_model_ms"].items()})
PY
python3 /tmp/cm.py warm
timeout 40 python3 stress_test.py --port 7741 --num_simultaneous_clients 1 --num_total_clients 1 --num_request_per_client 150 --no_progress 2>&1 | grep "mean batch"
python3 /tmp/cm.py after1
timeout 40 python3 stress_test.py --port 7741 --num_simultaneous_clients 64 --num_total_clients 64 --num_request_per_client 8 --no_progress 2>&1 | grep "mean batch"
python3 /tmp/cm.py after64
kill -TERM $P; wait $P
