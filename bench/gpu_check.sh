#!/usr/bin/env bash
# GPU check of the torch trainer: each step prints its figures and the script goes on when one
# fails (a summary at the end names the failed and skipped steps; the exit code is non-zero if
# any failed). Every step has its own time limit and BUDGET_S (default 480) bounds the whole run:
# a step that would start after it is reported as skipped, never silently dropped.
#   0. pytest -m gpu: the CUDA-only unit tests (chunk timing never waits for the GPU, float64).
#   1. correctness on CUDA: PP2 (ZB-H1) and TP2 first-iteration loss and gradients vs the
#      single-process CPU reference (float64). With >= 2 GPUs the ranks use NCCL, one GPU
#      each; with one GPU they share it and communicate through gloo (host staging),
#      because NCCL refuses two ranks on the same device.
#   2. a 1-rank NCCL job (NCCL init, CUDA-event chunk timing, training) when only one GPU.
#   3. bench/predictor.py on CUDA (micro-batch / iteration predictor MAPE vs noise floor). With
#      one GPU it runs one rank on NCCL (PP1): PP stages sharing one GPU run one after the other,
#      which breaks the DAG's premise that stages run concurrently; with >= 2 GPUs, PP2 on NCCL.
#   4. bench/convergence.py on CUDA: a fail-stop mid-run, loss curve vs the fault-free run and
#      the trainer's in-job recovery timeline.
#   5. bench/recovery_stack.py on CUDA: the same fail-stop through the whole stack (collector,
#      detector, scheduler, dashboard): kill -> detected -> plan -> applied, in seconds.
#   6. bench/predictor.py --only-overhead on CUDA: telemetry overhead on step time.
#   7. bench/telemetry_calls.py on CUDA: where that overhead goes, call by call (pooled vs
#      fresh CUDA events).
# Usage: bash bench/gpu_check.sh   (PYTHON=... to pick the interpreter; OUT=... for outputs;
#        STEPS="1 3" to run some steps only)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python}
OUT=${OUT:-/tmp/resihp-gpu-check}
mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-480}
STEPS=${STEPS:-0 1 2 3 4 5 6 7}
DEVICE=${DEVICE:-cuda}   # DEVICE=cpu dry-runs the same steps without a GPU
if [ "$DEVICE" = cuda ]; then
  NGPU=$($PY -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
  if [ "$NGPU" -lt 1 ]; then echo "no CUDA device"; exit 1; fi
  $PY -c "import torch; print('GPU:', torch.cuda.get_device_name(0), 'count', torch.cuda.device_count(), 'torch', torch.__version__)"
  if [ "$NGPU" -ge 2 ]; then BACKEND=nccl; else BACKEND=gloo; fi
else
  NGPU=2; BACKEND=gloo
fi
FAILED=""; SKIPPED=""
# step N LIMIT_S DESCRIPTION -- COMMAND...: runs COMMAND under a time limit, logs to $OUT/stepN.log
step() {
  local n=$1 limit=$2 what=$3; shift 4
  case " $STEPS " in *" $n "*) ;; *) return 0 ;; esac
  if [ "$SECONDS" -ge "$BUDGET_S" ]; then
    echo "== $n. $what: SKIPPED (budget ${BUDGET_S}s spent)"; SKIPPED="$SKIPPED $n"; return 0
  fi
  echo "== $n. $what (limit ${limit}s, ${SECONDS}s into the check)"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/step$n.log"
  local rc=${PIPESTATUS[0]}
  echo "-- step $n: rc $rc in $((SECONDS - t0))s"
  [ "$rc" -eq 0 ] || FAILED="$FAILED $n"
}
# spawned workers re-import the main module, so the check runs from a file
cat > "$OUT/check_correctness.py" <<'PYEOF'
import os, time, torch
from trainer.torch_trainer.config import TrainConfig
from trainer.torch_trainer.launcher import launch
from trainer.torch_trainer.reference import expected_shard, reference_step
import json, pathlib


def main():
    out = pathlib.Path(os.environ["OUT"])
    for name, kw in [("pp2-zbh1", dict(pp=2, schedule="zbh1")), ("tp2", dict(tp=2))]:
        d = out / name
        cfg = TrainConfig(num_layers=2, hidden=64, num_heads=4, ffn_hidden=128, token_budget=256,
                          microbatches=3, iterations=1, dtype="float64", telemetry=False,
                          device=os.environ["DEVICE"], backend=os.environ["BACKEND"], out_dir=str(d / "run"),
                          dump_grads_dir=str(d / "grads"), **kw)
        t0 = time.time()
        assert launch(cfg) == 0, name
        loss = json.loads((d / "run" / "metrics.jsonl").read_text().splitlines()[0])["loss"]
        ref_loss, ref = reference_step(TrainConfig(**{**cfg.to_dict(), "device": "cpu", "backend": "auto"}))
        worst = 0.0
        for p in (d / "grads").glob("rank_*.pt"):
            dump = torch.load(p, weights_only=True)
            m = dump["meta"]
            for n, g in dump["grads"].items():
                want = expected_shard(ref, n, m["tp_size"], m["tp_rank"])
                worst = max(worst, float((g - want).abs().max() / (want.abs().max() + 1e-30)))
        ok = abs(loss - ref_loss) <= 1e-9 * abs(ref_loss) and worst < 1e-7
        print(f"{name}: loss {loss:.12f} ref {ref_loss:.12f}  worst rel grad err {worst:.2e}  "
              f"{'OK' if ok else 'MISMATCH'}  ({time.time() - t0:.1f}s)")
        assert ok, name


if __name__ == "__main__":
    main()
PYEOF
if [ "$DEVICE" = cuda ]; then
  step 0 120 "pytest -m gpu" -- $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py
fi
step 1 240 "correctness on $DEVICE (backend $BACKEND)" -- \
  env OUT="$OUT" BACKEND="$BACKEND" DEVICE="$DEVICE" $PY "$OUT/check_correctness.py"
if [ "$NGPU" -lt 2 ] && [ "$DEVICE" = cuda ]; then
  step 2 120 "one-rank NCCL job" -- bash -c "$PY -m trainer torch --device cuda --backend nccl \
    --iterations 5 --microbatches 4 --token-budget 1024 --out-dir '$OUT/nccl1' && cat '$OUT/nccl1/metrics.jsonl'"
fi
if [ "$DEVICE" = cuda ]; then
  SIZE="--hidden 1024 --layers 4 --budgets 4096,8192,16384"
  if [ "$NGPU" -ge 2 ]; then PRED="--pp 2 --backend nccl"; else PRED="--pp 1 --backend nccl"; fi
else
  SIZE="--iterations 6"; PRED="--pp 2 --backend gloo"
fi
step 3 200 "predictor bench on $DEVICE ($PRED)" -- \
  $PY bench/predictor.py --device "$DEVICE" $PRED --iterations 24 $SIZE --out "$OUT/predictor"
step 4 200 "convergence and in-job recovery on $DEVICE" -- \
  $PY bench/convergence.py --device "$DEVICE" --backend "$BACKEND" --iterations 20 --kill-at 8 \
    --out "$OUT/convergence"
step 5 200 "stack recovery on $DEVICE" -- \
  $PY bench/recovery_stack.py --device "$DEVICE" --backend "$BACKEND" --iterations 30 --kill-at 12 \
    --timeout-s 170 --out "$OUT/recovery"
step 6 150 "telemetry overhead on $DEVICE" -- \
  $PY bench/predictor.py --device "$DEVICE" $PRED --only-overhead $SIZE --out "$OUT/overhead"
step 7 120 "telemetry calls on $DEVICE" -- $PY bench/telemetry_calls.py --device "$DEVICE"
echo "== summary: ${SECONDS}s; failed:${FAILED:- none}; skipped:${SKIPPED:- none}"
[ -z "$FAILED" ]
