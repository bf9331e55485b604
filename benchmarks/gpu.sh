#!/usr/bin/env bash
# The GPU check, end to end, sized for about 10 minutes on one GPU:
#   install -> device-independent tests on the device (FXOPT_TEST_DEVICE) -> the corpus in inference and
#   training -> benchmarks/report.py at realistic sizes (inference: ResNet-50 batch 64, float16; training
#   memory: BERT-base sequence 512 batch 8, bfloat16) -> one folder: README.md, JSON rows, each step's log.
#
#   benchmarks/gpu.sh                         # cuda, real sizes, results in gpu-results-<date>/
#   benchmarks/gpu.sh --device cpu --small    # the same steps on CPU with tiny sizes (how it is tested here)
#   benchmarks/gpu.sh --out DIR --no-install
#
# The machine's own torch is kept: the install step adds fxopt and the test extras only (pip install -e .[test]).
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda SMALL=0 INSTALL=1 OUT="gpu-results-$(date -u +%Y%m%d-%H%M%S)"
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=$2; shift 2 ;;
    --small) SMALL=1; shift ;;
    --out) OUT=$2; shift 2 ;;
    --no-install) INSTALL=0; shift ;;
    *) echo "usage: $0 [--device cuda|cpu] [--small] [--out DIR] [--no-install]" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
export PYTHONPATH=$PWD FXOPT_TEST_DEVICE=$DEVICE
status=0
step() {  # step NAME COMMAND...: output to $OUT/NAME.txt, exit status and seconds to $OUT/steps.txt
  local name=$1; shift; local start=$SECONDS
  echo "=== $name: $*"
  "$@" > "$OUT/$name.txt" 2>&1; local rc=$?
  tail -n 25 "$OUT/$name.txt"
  echo "$name rc=$rc seconds=$((SECONDS - start))" | tee -a "$OUT/steps.txt"
  [ $rc -eq 0 ] || status=1
}
python - > "$OUT/environment.txt" 2>&1 <<'PY'
import platform, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory // 2**20, "MiB")
print("python", platform.python_version())
PY
cat "$OUT/environment.txt"
[ $INSTALL -eq 1 ] && step install python -m pip install -q -e ".[test]"
step tests python -m pytest -q tests/test_device.py tests/test_fuzz_findings.py
step corpus python -m pytest -q -m corpus tests/corpus -k "not budget"
if [ $SMALL -eq 1 ]; then
  step benchmarks python benchmarks/report.py --device "$DEVICE" --small --no-compile --output "$OUT/README.md" --json-dir "$OUT"
else
  step benchmarks python benchmarks/report.py --device "$DEVICE" --dtype float16 --output "$OUT/README.md" --json-dir "$OUT"
fi
echo "results in $OUT/ (steps.txt: each step's exit status and seconds)"
exit $status
