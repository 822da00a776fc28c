# Call 1: stash ORT part 1; deps; bert-base-random fp16; PyTorch on CUDA: default stream (old) vs a stream per session (new).
mkdir -p /tmp/stash && cp .gpu/part.* /tmp/stash/ && ls -la /tmp/stash | tail -1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
source .gpu/env.sh
python3 -c "import sys,torch,transformers,tokenizers,onnxruntime as o;print(sys.version.split()[0],torch.__version__,torch.cuda.is_available(),transformers.__version__,tokenizers.__version__,o.__version__)"
M=saved_models/bert-base-random
(time timeout 200 python3 prepare_model.py --random_bert_base --fp16 --fp16_min_agreement 0 --model_dir $M) 2>&1 | tail -4
cp engines/torch_engine.py /tmp/torch_engine_new.py
for round in 1 2; do
 for v in old new; do
  if [ $v = old ]; then cp .gpu/torch_engine_old.py engines/torch_engine.py; else cp /tmp/torch_engine_new.py engines/torch_engine.py; fi
  echo "== round $round: $v, closed loop"
  timeout 150 python3 bench/gpu.py --model_dir $M --engines pytorch --workers 1 --modes auto --precisions fp16 --batch_sizes 32 --concurrency 64,256 --seconds 5 --raw_pairs 64 --json $OUT/torch_${v}_$round.json --plot $OUT/torch_${v}_$round.png 2>&1 | grep "server pytorch\|raw\|killed\|Error" | cut -c1-220
  echo "== round $round: $v, lean pipelined"
  timeout 120 python3 bench/gpu.py --model_dir $M --engines pytorch --workers 1 --modes auto --precisions fp16 --batch_sizes 32 --concurrency 32 --pipeline 16 --load pipelined --seconds 6 --raw_pairs 32 --json $OUT/torchp_${v}_$round.json --plot $OUT/torchp_${v}_$round.png 2>&1 | grep "server pytorch\|killed\|Error" | cut -c1-220
 done
done
cp /tmp/torch_engine_new.py engines/torch_engine.py
