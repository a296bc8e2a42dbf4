set -u
mkdir -p $OUT/ab
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
for S in 8l2 12l4 12l8; do
  timeout 120 build/ab/test_pointwise_gpu-s$S --gtest_filter='*Dropout*' > $OUT/ab/test_s$S.txt 2>&1; echo "s$S test rc=$?"; tail -1 $OUT/ab/test_s$S.txt
done
vs="base s8l2 s12l4 s12l8"
for i in 1 2 3 4 5 6; do
  order=$vs; [ $((i%2)) = 0 ] && order=$(echo $vs | tr ' ' '\n' | tac | tr '\n' ' ')
  for v in $order; do
    bin=build/device/bin/replay-ops; [ $v != base ] && bin=build/ab/replay-ops-$v
    timeout 60 $bin --only 'dropout' --json $OUT/ab/${v}_$i.json > $OUT/ab/${v}_$i.log 2>&1 || echo "$v $i failed rc=$?"
  done
done
python3 - <<'PY'
import json, glob, os
out = os.environ["OUT"] + "/ab"
for v in ("base", "s8l2", "s12l4", "s12l8"):
    rows = {}
    for f in sorted(glob.glob(f"{out}/{v}_*.json")):
        for r in json.load(open(f))["results"]:
            rows.setdefault(r["name"].split(".", 1)[1], []).append(r["stream"]["median_ms"] * 1e3)
    for n, xs in rows.items():
        s = sorted(xs)
        print(v, n, " ".join("%.2f" % x for x in xs), "| min %.2f med %.2f" % (s[0], s[len(s)//2]))
PY
tar czf $OUT/ab.tgz -C $OUT ab
