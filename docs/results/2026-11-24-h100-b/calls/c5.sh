# Call 5: PyTorch fp16 on CUDA: the cost model before (old) and after (new) the load factor, bench/bench.py, alternating.
source .gpu/env.sh
M=saved_models/bert-base-random
(time timeout 150 python3 prepare_model.py --random_bert_base --model_dir $M) 2>&1 | tail -3
cp scheduling/cost_model.py /tmp/cost_model_new.py
for round in 1 2; do
 for v in old new; do
  if [ $v = old ]; then cp .gpu/cost_model_old.py scheduling/cost_model.py; else cp /tmp/cost_model_new.py scheduling/cost_model.py; fi
  echo "== round $round: $v"
  timeout 200 python3 bench/bench.py --model_dir $M --engines pytorch --device cuda --precision fp16 --sessions 2 \
   --batching "auto,auto:--workers 2" --concurrency 64,256 --server_requests 2048 --batch_sizes 32 --raw_pairs 64 \
   --server_args "--length_buckets 64,128,256,384" --json $OUT/torch_cost_${v}_$round.json 2>&1 | grep "^| pytorch | auto" 
 done
done
cp /tmp/cost_model_new.py scheduling/cost_model.py
