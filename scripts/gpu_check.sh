#!/usr/bin/env bash
# The GPU checks, as one script for the device machine (one GPU, CUDA torch, no network):
#   .whl/ holds py-spy and inotify_simple wheels (elaunch's dependencies the image lacks).
#   1. the example under --nproc-per-node=gpu (nccl), a crash, the restart restoring from a
#      snapshot of CUDA tensors (ckpt.save through pinned memory), final accuracy;
#   2. the same without a crash, for the final parameters to compare (bit-identical);
#   3. benchmarks.checkpoint_cost on cuda: ckpt.save/load of 256 MiB and 1 GiB of CUDA tensors.
# Results go to $OUT (logs, JSON).
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
# The example needs scikit-learn (the digits data); wheels for this Python in .whl/sk/ if the image lacks it
if ! python3 -c "import sklearn" 2>/dev/null && ls .whl/sk/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/sk/*.whl \
    || echo "scikit-learn wheels do not fit this Python"
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{ nvidia-smi -L; python3 --version; python3 -c "import numpy; print('numpy', numpy.__version__)"
  python3 -c "import sklearn; print('sklearn', sklearn.__version__)" || echo "no sklearn: the example cannot run"
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count())"; } 2>&1 | tee "$OUT/env.txt"
run() {  # name, then the example's arguments
  local name=$1; shift
  ( time timeout 150 python3 -m elaunch --standalone --nproc-per-node=gpu --max-restarts=2 --rdzv-id "$name" \
      examples/ddp_digits.py --epochs 3 --run-dir "/tmp/$name" --final-params "$OUT/$name.params.json" "$@" ) \
      >"$OUT/$name.log" 2>&1
  echo "== $name: exit $?"; grep -E "resumed|restart|final|Error|error|nccl|NCCL" "$OUT/$name.log" | head -20
}
run crash --crash-at 0:2:5 --no-disk-checkpoint
run clean --no-disk-checkpoint
python3 - "$OUT" <<'PY'
import json, sys
a, b = (json.load(open(f"{sys.argv[1]}/{n}.params.json")) for n in ("crash", "clean"))
print("final parameters bit-identical:", a["sha256"] == b["sha256"], a["world_size"])
PY
[ -n "${SKIP_COST:-}" ] || timeout 240 python3 -m benchmarks.checkpoint_cost --device cuda --mib 256,1024 --repeat 3 \
  --json "$OUT/checkpoint_cost_cuda.json" 2>&1 | tee "$OUT/checkpoint_cost_cuda.txt" | grep -v Warning
