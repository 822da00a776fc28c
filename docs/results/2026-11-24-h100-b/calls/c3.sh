# Call 3: stash ORT part 3; the front end alone on 16 cores (zero engine), 1, 2 and 4 workers, 2 rounds.
cp .gpu/part.* /tmp/stash/ && ls -la /tmp/stash | tail -1
source .gpu/env.sh
M=saved_models/bert-base-random
timeout 400 python3 bench/frontend.py --model_dir $M --workers 1 2 4 --rounds 2 --seconds 6 --processes 4 --connections 32 --json $OUT/frontend16.json 2>&1 | tee $OUT/frontend16.log | grep -v "^20..-" | tail -16
echo "== PyTorch 1 worker: the cost model after 64 closed-loop clients"
python3 server.py --port 7731 --model_dir $M --inference_engine_type pytorch --device cuda --precision fp16 --length_buckets 64,128,256,384 > /tmp/pt.log 2>&1 & P=$!
for i in $(seq 90); do sleep 1; grep -q "serving on" /tmp/pt.log && break; done
python3 - <<'PY'
import json, sys
sys.path.insert(0, ".")
from client import Client
with Client("127.0.0.1", 7731) as c:
    s = c.stats(timeout=30)
    print("AFTER WARM-UP", json.dumps({k: v for k, v in s.items() if k in ("batching", "serving", "models")})[:3000])
PY
timeout 60 python3 stress_test.py --port 7731 --num_simultaneous_clients 64 --num_total_clients 64 --num_request_per_client 40 --no_progress 2>&1 | tail -3
python3 - <<'PY'
import json, sys
sys.path.insert(0, ".")
from client import Client
with Client("127.0.0.1", 7731) as c:
    s = c.stats(timeout=30)
    print("AFTER LOAD", json.dumps(s)[:6000])
PY
kill -TERM $P; wait $P
