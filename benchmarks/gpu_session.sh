#!/bin/bash
# One prepared GPU session: install carried wheels (WHEELS=DIR, optional), print the machine, run
# gpu_check.py on CASES with one profiled step per case, summarize, and pack the profiles (one file:
# tools that bring results back may limit the file count).
#   CASES=zero1,fsdp2_zero3 OUT=gpu_out benchmarks/gpu_session.sh [--cpu-dry-run]
set -u
T0=$(date +%s)
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
if [ -n "${WHEELS:-}" ]; then
  python -m pip install --quiet --no-deps --no-index --target /tmp/gpu_session_site "$WHEELS"/*.whl 2>&1 | tail -2
  export PYTHONPATH=/tmp/gpu_session_site${PYTHONPATH:+:$PYTHONPATH}
  export PATH=/tmp/gpu_session_site/bin:$PATH
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python -c "import torch, lightning, sys; print('torch', torch.__version__, 'lightning', lightning.__version__, 'python', sys.version.split()[0], torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python benchmarks/gpu_check.py --case-timeout "${CASE_TIMEOUT:-300}" ${CASES:+--cases "$CASES"} --profile-dir "$OUT/prof" "$@" \
  > "$OUT/gpu_check.jsonl" 2> "$OUT/gpu_check.err"
echo "gpu_check exit $? after $(( $(date +%s) - T0 )) s"
python - "$OUT/gpu_check.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    if not line.startswith("{"):
        print(line.rstrip())
        continue
    d = json.loads(line)
    if d.get("case") == "gpu_check":
        print(json.dumps({k: d.get(k) for k in ("passed", "failed", "disagree", "max_rel_diff", "peers")}))
        continue
    p = d.get("profile") or {}
    syncs = {k: v["count"] for k, v in (p.get("host_syncs") or {}).items()}
    print(d["case"], d.get("ok"), d.get("losses"), d.get("step_s"), d.get("peak_gpu_gib"), "busy", p.get("gpu_busy_fraction"),
          "peak", p.get("peak_cuda_allocated_gib"), p.get("peak_cuda_during"), "syncs", syncs, (d.get("error") or "")[:200])
PY
tail -3 "$OUT/gpu_check.err"
(cd "$OUT" && tar czf prof.tgz prof && rm -rf prof)
echo "total $(( $(date +%s) - T0 )) s"
