# Call 2: stash ORT part 2; bench/bench.py on the GPU, PyTorch fp16 (a stream per session), 1 and 2 workers.
cp .gpu/part.* /tmp/stash/ && ls -la /tmp/stash | tail -1
source .gpu/env.sh
M=saved_models/bert-base-random
timeout 520 python3 bench/bench.py --model_dir $M --engines pytorch --device cuda --precision fp16 --sessions 2 \
   --batching "auto,auto:--workers 2" --concurrency 1,8,64,256 --server_requests 1024 --batch_sizes 1,8,32,64 --raw_pairs 128 \
   --server_args "--length_buckets 64,128,256,384" --json $OUT/bench_torch.json 2>&1 | tee $OUT/bench_torch.log | grep -v "^\s*$" | tail -45
