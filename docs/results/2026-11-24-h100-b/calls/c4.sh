# Call 4: the last ORT part; onnxruntime-gpu 1.30.0 assembled; bench/bench.py ONNX fp16 on the GPU, 1, 2 and 4 workers.
cp .gpu/part.* /tmp/stash/ && cd /tmp/stash && cat part.1 part.2 part.3 part.4 > ort.tar.xz && sha256sum ort.tar.xz | cut -c1-16
mkdir -p /tmp/ortgpu && tar -xJf ort.tar.xz -C /tmp/ortgpu && cd - >/dev/null
source .gpu/env.sh
python3 -c "import onnxruntime as o; print(o.__version__, o.get_available_providers())"
M=saved_models/bert-base-random
timeout 480 python3 bench/bench.py --model_dir $M --engines onnx --device cuda --precision fp16 --sessions 2 \
   --batching "auto,auto:--workers 2,auto:--workers 4" --concurrency 1,8,32,64,256 --server_requests 2048 --raw_pairs 256 \
   --server_args "--length_buckets 64,128,256,384" --json $OUT/bench_onnx.json 2>&1 | tee $OUT/bench_onnx.log | grep -v "^\s*$" | tail -50
