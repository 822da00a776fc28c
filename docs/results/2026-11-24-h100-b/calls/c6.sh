# Call 6: the trap's order (1 and 8 clients first, then 64 and 256), old and new cost model, 1 worker.
source .gpu/env.sh
M=saved_models/bert-base-random
cp scheduling/cost_model.py /tmp/cost_model_new.py
for v in old new; do
  if [ $v = old ]; then cp .gpu/cost_model_old.py scheduling/cost_model.py; else cp /tmp/cost_model_new.py scheduling/cost_model.py; fi
  echo "== $v"
  timeout 140 python3 bench/bench.py --model_dir $M --engines pytorch --device cuda --precision fp16 --sessions 2 \
   --batching "auto" --concurrency 1,8,64,256 --server_requests 768 --batch_sizes 32 --raw_pairs 32 \
   --server_args "--length_buckets 64,128,256,384" --json $OUT/torch_trap_${v}.json 2>&1 | grep "^| pytorch | auto" 
done
cp /tmp/cost_model_new.py scheduling/cost_model.py
