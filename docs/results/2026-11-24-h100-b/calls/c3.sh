# Call 3: stash ORT part 3; the front end alone on 16 cores (zero engine), 1, 2 and 4 workers, 2 rounds.
cp .gpu/part.* /tmp/stash/ && ls -la /tmp/stash | tail -1
source .gpu/env.sh
M=saved_models/bert-base-random
timeout 400 python3 bench/frontend.py --model_dir $M --workers 1 2 4 --rounds 2 --seconds 6 --processes 4 --connections 32 --json $OUT/frontend16.json 2>&1 | tee $OUT/frontend16.log | grep -v "^20..-" | tail -16
