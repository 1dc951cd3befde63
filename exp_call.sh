#!/bin/bash
# device call 3: GPU suite on the streamed kernels, A/B base (not streamed) / streamed 2 K1 CTAs per SM / 3
nvidia-smi -L
timeout 300 python3 -m pytest -q -rfs -p no:cacheprovider tests > $OUT/suite.log 2>&1
tail -3 $OUT/suite.log; grep -E '^FAILED' $OUT/suite.log | head -20
timeout 420 python3 benchmarks/ab_prefill.py --arm base=ab_base@. --arm s2=. --arm s3=ab_s3@. --rounds 2 --out $OUT/ab -- --only spec,serving,cp --no-fla --quick 2>&1 | tail -60
