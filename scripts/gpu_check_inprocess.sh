#!/usr/bin/env bash
# The GPU check of issues 36 and 37, as one script for the device machine (one GPU, CUDA torch, no network):
#   .whl/ holds py-spy and inotify_simple wheels (elaunch's dependencies the image lacks).
#   0. probe: two ranks on the one GPU under nccl (scripts/gpu_shared.py: NCCL_HOSTID a rank); if NCCL refuses,
#      every part below runs one rank a job (no survivors then: the in-process parts say so);
#   1. issue 36: examples/fsdp2_dcp.py (FSDP2, DTensor shards on the GPU) under nccl, a rank SIGKILLs itself after
#      saving step 10 through SnapshotWriter, restored through SnapshotReader from memory: in process (the
#      survivors keep their processes, their NCCL communicators aborted and made again) and by a full restart;
#      final parameters against an uninterrupted run's;
#   2. issue 37: benchmarks.inprocess --device cuda: DDP under nccl, a worker SIGKILL and a raising rank, fault ->
#      training, in process and by elaunch's full restart; the in-process kill again with
#      TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (CleanUpOnly) beside the default 1 (TearDown, as torchrun sets it);
#   3. issue 37: examples/ddp_digits.py --in-process under nccl, a rank raising mid-epoch, against a clean run.
# KILL_REPS: faults in the bench_kill job (default 3; every fault after the first is a survivor's later restart).
# PARTS (space-separated; default all): probe fsdp_ip bench fsdp_compare bench_aeh digits, or the focused ones
# bench_kill, bench_kill_aeh0 (TORCH_NCCL_ASYNC_ERROR_HANDLING=0), bench_kill_nodump (NCCL's flight recorder off),
# bench_raise, bench_kill_warm, bench_kill_gdb (cuda-gdb's backtrace of every thread of a survivor stuck in
# ~ProcessGroupNCCL's join, the C++ watchdog's too). While a benchmark part runs, py-spy dumps its workers' stacks
# (Python and native) every 3 s into its folder, with every thread's name and state: where a survivor waits.
# DEVICE=cpu runs the same plumbing on a machine without a GPU (gloo), to check the script itself.
# Everything goes to $OUT: summary.txt, env.txt, the benchmark's JSON, logs.tgz (every log).
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
DEVICE=${DEVICE:-cuda}
BUDGET=${BUDGET:-400}  # seconds: a part that would start after this is skipped (the call's limit is the device's)
FSDP_SIZE=${FSDP_SIZE:---dim 512 --layers 7 --heads 8}  # 255 MiB of parameters and AdamW moments, as the benchmark
W=${W:-/tmp/gpu_check}; rm -rf "$W"; mkdir -p "$W"  # every log (logs.tgz)
T0=$(date +%s)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
fi
PY=${PY:-python3}
# --target puts the wheels' scripts (py-spy) in /tmp/site/bin: on PATH for the stack dumps, the script's and the agent's
export PATH=/tmp/site/bin:$PATH
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo} NCCL_IB_DISABLE=1 NCCL_DEBUG=${NCCL_DEBUG:-WARN} TORCH_CPP_LOG_LEVEL=${TORCH_CPP_LOG_LEVEL:-ERROR}
PARTS=" ${PARTS:-probe fsdp_ip bench fsdp_compare bench_aeh digits} "
want() { [[ "$PARTS" == *" $1 "* ]]; }
say() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/summary.txt"; }
left() { [ $(( $(date +%s) - T0 )) -lt "$BUDGET" ] || { say "skipped (budget): $1"; return 1; }; }
finish() { tar czf "$OUT/logs.tgz" -C "$(dirname "$W")" "$(basename "$W")" 2>/dev/null; say "end"; }
trap finish EXIT
{ nvidia-smi -L 2>&1; $PY --version
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(),
torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None)"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# -- 0. two ranks on one GPU ---------------------------------------------------------------------------------------
cat >"$W/probe.py" <<'PYEOF'
import os, torch, torch.distributed as dist
cuda = torch.cuda.is_available()
if cuda:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
dist.init_process_group("nccl" if cuda else "gloo")
t = torch.ones(4, device="cuda" if cuda else "cpu") * (dist.get_rank() + 1)
dist.all_reduce(t)
# one write a line: under PYTHONUNBUFFERED print writes the text and its newline apart, and two ranks share a log
os.write(1, f"rank {dist.get_rank()} of {dist.get_world_size()} (NCCL_HOSTID {os.environ.get('NCCL_HOSTID')}): "
            f"all_reduce -> {t[0].item()}\n".encode())
dist.destroy_process_group()
PYEOF
NPROC=${NPROC:-2}
if want probe; then
  timeout 90 $PY -m elaunch --standalone --nproc-per-node=2 --rdzv-id probe scripts/gpu_shared.py "$W/probe.py" \
    >"$W/probe.log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || NPROC=1
  say "probe, 2 ranks on one device: exit $rc -> $NPROC rank(s) a job"; grep -E "all_reduce|Error|NCCL WARN" "$W/probe.log" | head -5
fi
VICTIM=$(( NPROC - 1 ))

# -- 1. FSDP2 (issue 36) -------------------------------------------------------------------------------------------
fsdp() {  # name, then the example's arguments
  local name=$1; shift
  left "$name" || return
  local t=$(date +%s%N)
  timeout "${FSDP_TIMEOUT:-150}" $PY -m elaunch --standalone --nproc-per-node=$NPROC --max-restarts=3 --rdzv-id "$name" \
    --log-dir "$W/$name-logs" scripts/gpu_shared.py examples/fsdp2_dcp.py --steps 30 $FSDP_SIZE \
    --step-sleep 0.05 --final-params "$W/$name.sha" --journal "$W/$name.journal" --timings "$W/$name.timings" "$@" \
    >"$W/$name.log" 2>&1
  local rc=$?
  say "$name: exit $rc in $(( ($(date +%s%N) - t) / 1000000 )) ms; $(grep -E '^restored|^done' "$W/$name.log" | tr '\n' ' ')"
  grep -E "Error|error:|NCCL WARN|abort" "$W/$name.log" | head -5
}
want fsdp_ip && fsdp fsdp_kill_inprocess --in-process --crash-at "$VICTIM:10"
# the uninterrupted run to compare the final parameters with, before the benchmark parts can use up the budget
want fsdp_compare && fsdp fsdp_clean --in-process

# -- 2. DDP, fault -> training (issue 37) --------------------------------------------------------------------------
bench() {  # name, then benchmarks.inprocess's arguments
  local name=$1; shift
  left "$name" || return
  mkdir -p "$W/$name"
  ( while sleep 3; do  # the workers' stacks, Python and native, while the part runs
      for pid in $(pgrep -f "inprocess_train.py"); do
        echo "=== $(date +%T.%N) pid $pid"; timeout 10 py-spy dump --native --pid "$pid" 2>&1 | tee "$W/$name/last"
        # every thread, C++ ones too (py-spy shows Python threads only): name, state, kernel wait
        for t in /proc/"$pid"/task/*; do
          echo "  thread ${t##*/} $(cat "$t/comm" 2>/dev/null) $(awk '{print $3}' "$t/stat" 2>/dev/null) $(cat "$t/wchan" 2>/dev/null)"
        done
        # a survivor in ~ProcessGroupNCCL's join (issue 37, bug 2): every thread's native stack, once per process
        if [ -n "${GDB:-}" ] && grep -q "Watchdog::join" "$W/$name/last" && [ ! -e "$W/$name/gdb.$pid.txt" ]; then
          timeout 90 cuda-gdb -p "$pid" -batch -ex "set pagination off" -ex "thread apply all bt 30" \
            >"$W/$name/gdb.$pid.txt" 2>&1
          cp "$W/$name/gdb.$pid.txt" "$OUT/" 2>/dev/null
        fi
      done >>"$W/$name/pyspy.txt"
    done ) &
  local spy=$!
  timeout "${BENCH_TIMEOUT:-250}" $PY -m benchmarks.inprocess --device "$DEVICE" --quick --work-dir "$W/$name" \
    --json "$OUT/$name.json" "$@" >"$W/$name.log" 2>&1
  local rc=$?
  kill $spy 2>/dev/null
  say "$name: exit $rc"; grep -E "^\[bench" "$W/$name.log" | tail -n 8 | tee -a "$OUT/summary.txt"
  sed -n '/^| row/,$p' "$W/$name.log" | tee -a "$OUT/summary.txt"
}
if [ "$NPROC" -gt 1 ]; then
  want bench && bench inprocess_ddp --reps 2 \
    --only kill.elaunch_inprocess,kill.elaunch_inprocess_warm,raise.elaunch_inprocess,kill.elaunch_full
  # torch's INFO lines say whether each communicator's abort returned ("... aborts successfully"): a survivor
  # that hangs in ncclCommAbort (NVIDIA/nccl#1777: the proxy thread stuck in poll) never prints its own
  want bench_kill && TORCH_CPP_LOG_LEVEL=INFO bench inprocess_kill --reps "${KILL_REPS:-3}" --only kill.elaunch_inprocess \
    --agent-args=--inprocess-timeout=8
  want bench_kill_aeh0 && TORCH_NCCL_ASYNC_ERROR_HANDLING=0 bench inprocess_kill_aeh0 --reps 3 \
    --only kill.elaunch_inprocess --agent-args=--inprocess-timeout=8
  # the flight recorder off: a watchdog that sees the dead peer first waits for its dump (Python stacks, so the GIL)
  want bench_kill_nodump && TORCH_NCCL_DUMP_ON_TIMEOUT=0 TORCH_NCCL_TRACE_BUFFER_SIZE=0 bench inprocess_kill_nodump \
    --reps 3 --only kill.elaunch_inprocess --agent-args=--inprocess-timeout=8
  want bench_raise && bench inprocess_raise --reps 2 --only raise.elaunch_inprocess --agent-args=--inprocess-timeout=8
  # bug 2's stack: cuda-gdb's backtrace of every thread of a survivor stuck in ~ProcessGroupNCCL (the agent waits 60 s)
  want bench_kill_gdb && GDB=1 bench inprocess_kill_gdb --reps 3 --only kill.elaunch_inprocess \
    --agent-args=--inprocess-timeout=60
  want bench_kill_warm && bench inprocess_kill_warm --reps 2 --only kill.elaunch_inprocess_warm \
    --agent-args=--inprocess-timeout=8
else
  say "the benchmark parts: skipped (one rank a job: no survivors to keep)"
fi

# -- 2 (cont.): NCCL's watchdog in CleanUpOnly mode (abort the communicators, keep the process) -------------------
# The default, 1 (TearDown, as torchrun sets it), ends a process whose communicator reports an error: a survivor
# whose watchdog saw the dead peer before the agent's abort arrived would die with it.
if [ "$NPROC" -gt 1 ] && want bench_aeh; then
  TORCH_NCCL_ASYNC_ERROR_HANDLING=2 bench inprocess_ddp_aeh2 --reps 2 --only kill.elaunch_inprocess
fi

want fsdp_compare && fsdp fsdp_kill_full --crash-at "$VICTIM:10"

# -- 3. examples/ddp_digits.py --in-process, a raising rank (issue 37) ---------------------------------------------
digits() {  # name, then the example's arguments
  local name=$1; shift
  left "$name" || return
  timeout 120 $PY -m elaunch --standalone --nproc-per-node=$NPROC --max-restarts=2 --rdzv-id "$name" \
    --log-dir "$W/$name-logs" scripts/gpu_shared.py examples/ddp_digits.py --epochs 3 --in-process \
    --no-disk-checkpoint --run-dir "$W/$name-run" --final-params "$W/$name.params.json" "$@" >"$W/$name.log" 2>&1
  say "$name: exit $?"; grep -E "resumed|restor|Error" "$W/$name.log" | head -4
}
want digits && digits digits_clean
want digits && digits digits_raise --crash-at "$VICTIM:2:5"

grep -rhoE "elaunch.restartable: .{0,160}|Duplicate GPU.{0,80}|NCCL WARN.{0,120}|ProcessGroupNCCL.{0,120}([Aa]bort|[Tt]ear).{0,80}" \
  "$W" 2>/dev/null | sort | uniq -c | sort -rn | head -12 | tee -a "$OUT/summary.txt"

# -- the summary ---------------------------------------------------------------------------------------------------
$PY - "$W" "$OUT" <<'PYEOF' 2>&1 | tee -a "$OUT/summary.txt"
import glob, json, os, sys
w, out = sys.argv[1], sys.argv[2]
def sha(name):
    try:
        return open(f"{w}/{name}").read().strip()
    except OSError:
        return None
clean = sha("fsdp_clean.sha")
for name in ("fsdp_kill_inprocess", "fsdp_kill_full"):
    try:
        recs = [json.loads(line) for line in open(f"{w}/{name}.journal")]
    except OSError:
        continue  # the part did not run (PARTS, the budget)
    crash = next((r for r in recs if r["event"] == "crash"), None)
    first = {r["rank"]: r for r in recs if r["event"] == "start" and r["attempt"] == 0}
    if crash is None:
        print(f"{name}: no crash journalled")
        continue
    after = sorted((r for r in recs if r["event"] == "start" and r["time"] > crash["time"]), key=lambda r: r["rank"])
    timings = {}
    for path in glob.glob(f"{w}/{name}.timings.*.json"):
        timings[int(path.rsplit(".", 2)[-2])] = json.load(open(path))
    print(f"{name}: rank {crash['rank']} SIGKILLed itself after saving step {crash['step']}")
    for r in after:
        kept = first.get(r["rank"], {}).get("pid") == r["pid"]
        t = timings.get(r["rank"], {})
        print(f"  rank {r['rank']}: {'process kept' if kept else 'new process'}, restored step {r['step']} from "
              f"{r['source']} ({t.get('restore') or 0:.3f} s), restored {r['time'] - crash['time']:.2f} s after the kill")
    final = sha(f"{name}.sha")
    if clean is None:
        print(f"  final parameters {final and final[:12]} (no uninterrupted run to compare with)")
    else:
        print(f"  final parameters {'bit-identical to' if final == clean else 'DIFFER from'} the uninterrupted"
              f" run's ({final and final[:12]} vs {clean[:12]})")
for path in sorted(glob.glob(f"{out}/*.json")):
    try:
        res = json.load(open(path))["raw"]
    except (OSError, ValueError, KeyError, TypeError):
        continue
    for r in res:
        for x in r.get("samples", []):
            new = [k for k in x["per_rank_s"] if int(k) not in x["kept_ranks"]]
            print(f"{os.path.basename(path)} {r['key']}: {x['seconds']:.2f} s, kept {x['pids_kept']} of "
                  f"{x['survivors']}, new rank(s) {new}: phases {[x.get('phases_s', {}).get(k) for k in new]}")
        if r.get("note"):
            print(f"{os.path.basename(path)} {r['key']}: {r['note']}")
def params(name):
    try:
        return json.load(open(f"{w}/{name}.params.json"))
    except (OSError, ValueError):
        return None
a, b = params("digits_raise"), params("digits_clean")
if a and b:
    print(f"digits_raise: final parameters {'bit-identical to' if a['sha256'] == b['sha256'] else 'DIFFER from'} the"
          f" clean run's (world size {a['world_size']})")
for ev in glob.glob(f"{w}/*-logs/**/events.jsonl", recursive=True):
    for line in open(ev):
        e = json.loads(line)
        if e.get("kind") == "inprocess_restart":
            print(f"{os.path.relpath(ev, w).split('/')[0]}: inprocess_restart kept {e.get('kept')} "
                  f"started {e.get('started')} {e.get('seconds')} s to go ({e.get('cause')})")
PYEOF
