set -u
mkdir -p $OUT/ab
B=build/device/bin/replay-ops; L=build/ab/replay-ops-lane
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
build/ab/test_pointwise_gpu-lane --gtest_filter='*Dropout*' > $OUT/ab/test_lane.txt 2>&1; echo "test rc=$?"; tail -3 $OUT/ab/test_lane.txt
for i in 1 2 3 4 5 6 7 8; do
  if [ $((i%2)) = 1 ]; then order="base lane"; else order="lane base"; fi
  for v in $order; do
    bin=$B; [ $v = lane ] && bin=$L
    $bin --only 'dropout' --json $OUT/ab/${v}_$i.json > $OUT/ab/${v}_$i.log 2>&1 || echo "$v $i failed"
  done
done
python3 - <<'PY'
import json, glob, os
out = os.environ["OUT"] + "/ab"
for v in ("base", "lane"):
    rows = {}
    for f in sorted(glob.glob(f"{out}/{v}_*.json")):
        for r in json.load(open(f))["results"]:
            rows.setdefault(r["name"].split(".", 1)[1], []).append(r["stream"]["median_ms"] * 1e3)
    for n, xs in rows.items():
        print(v, n, " ".join("%.2f" % x for x in xs), "| min %.2f med %.2f" % (min(xs), sorted(xs)[len(xs)//2]))
PY
tar czf $OUT/ab.tgz -C $OUT ab
