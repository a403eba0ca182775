#!/bin/bash
# Second device call of the A/B (issue #25): the decode step at batch 1 and 32 x context 1024 again, alternating
# before, after, before, after (the first call's single-step p50 differed by up to 3% at 1k while back-to-back
# agreed within 0.6%: is that the tree or the run?). Same commands as ab.sh's decode arm.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
mkdir -p $OUT/r2
for round in 1 2; do
  for arm in before after; do
    dir=$([ $arm = before ] && echo _ab/before || echo .)
    (cd $dir && PYTHONPATH=/tmp/site:. timeout 120 python3 -m bench.cli decode --model qwen2.5-7b --batches 1,32 \
       --contexts 1024 --hf none --out $OUT/r2/decode-$arm-$round) > $OUT/r2/decode-$arm-$round.log 2>&1
    echo "$arm-$round rc $?: $(grep 'engine ' $OUT/r2/decode-$arm-$round.log | tr '\n' ' ')"
    tar -C $OUT -czf $OUT/ab2.tgz r2
  done
done
rm -rf $OUT/r2
