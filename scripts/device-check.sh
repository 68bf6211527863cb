#!/usr/bin/env bash
# The device check: one bounded run of what a GPU settles, everything as JSON under one folder.
#
#   scripts/device-check.sh --out DIR [--device cuda] [--dry-run]
#
# Steps (each under its own `timeout`; a failing step is recorded and the rest still run):
#   verify-float32, verify-bfloat16  kvnotes verify in each dtype (DIR/verify-<dtype>.json)
#   patch-sweep                      kvnotes bench patch-sweep against its strong baselines (DIR/patch-sweep.json)
#   prefill                          kvnotes bench prefill against TransformerLens and HF (DIR/prefill.json)
#   memory                           python -m kvnotes.bench.memory: bytes vs tokens and batch (DIR/memory.json)
#   report                           kvnotes report --quick on order-cancel (DIR/report/report.json)
# then DIR/summary.json: the machine (nvidia-smi, torch, the device's name), each step's command,
# exit code and wall time. On CUDA with Gemma 3 270M it aims at about 5 minutes (10 at most).
# --dry-run: the same steps at CI sizes on tiny-llama (about a minute on 2 CPU cores).
# The exit code is 0 when every step passed, 1 when one failed, 2 for bad arguments.
# KVNOTES (default: kvnotes) is the command run, e.g. KVNOTES="python -m kvnotes.cli"; PYTHON
# (default: python3) runs the memory bench.
set -euo pipefail

usage="usage: scripts/device-check.sh --out DIR [--device cpu|cuda|cuda:N|mps] [--dry-run]"
device=cuda
out=""
dry=0
while [ $# -gt 0 ]; do
  case "$1" in
    --device | --out)
      if [ $# -lt 2 ] || [ -z "$2" ]; then
        echo "device-check: $1 needs a value; $usage" >&2
        exit 2
      fi
      if [ "$1" = --device ]; then device=$2; else out=$2; fi
      shift 2
      ;;
    --dry-run) dry=1; shift ;;
    -h | --help) echo "$usage"; exit 0 ;;
    *) echo "device-check: unknown argument '$1'; $usage" >&2; exit 2 ;;
  esac
done
if [ -z "$out" ]; then
  echo "device-check: --out DIR is required (where the JSON goes); $usage" >&2
  exit 2
fi
if ! [[ $device =~ ^(cpu|cuda|cuda:[0-9]+|mps)$ ]]; then
  echo "device-check: --device must be cpu, cuda, cuda:N or mps, got '$device'; $usage" >&2
  exit 2
fi
mkdir -p "$out"
read -r -a kv <<< "${KVNOTES:-kvnotes}"
read -r -a py <<< "${PYTHON:-python3}"

if [ "$dry" = 1 ]; then
  model=tiny-llama
  sweep=(--tokens 64 --slots 4 --repeats 1 --batch-sizes 4)
  prefill=(--lengths "128,256" --repeats 1)
  memory=(--tokens "64,128,256" --batches "2,4,8")
  report=(--n 2)
  limit=240  # a bound against a hang, not a target: CI's cores may be shared (the report took 195 s at load 9)
else
  model=gemma-3-270m
  sweep=(--tokens "256,1024" --slots 32 --repeats 3 --batch-sizes "16,32,64")
  prefill=(--lengths "1024,4096" --repeats 2)
  memory=(--tokens "256,512,1024,2048" --batches "4,8,16,32")
  report=()
  limit=150
fi
on=(--model "$model" --device "$device")
steps="$out/steps.jsonl"
: > "$steps"
failed=0

# step NAME SECONDS CMD...: run CMD under `timeout`, its output in DIR/NAME.log, one line in steps.jsonl
step() {
  local name=$1 seconds=$2 rc=0 t0 t1
  shift 2
  echo "device-check: $name: $*"
  t0=$(date +%s.%N)
  timeout "$seconds" "$@" > "$out/$name.log" 2>&1 || rc=$?
  t1=$(date +%s.%N)
  [ "$rc" = 0 ] || { failed=1; echo "device-check: $name failed (exit $rc; $out/$name.log)" >&2; }
  python3 - "$name" "$rc" "$t0" "$t1" "$seconds" "$@" >> "$steps" <<'PY'
import json, sys
name, rc, t0, t1, limit, *cmd = sys.argv[1:]
wall = round(float(t1) - float(t0), 2)
print(json.dumps(dict(step=name, exit_code=int(rc), wall_s=wall, timeout_s=int(limit), timed_out=rc in ("124", "137"), command=cmd)))
PY
}

start=$(date +%s)
step verify-float32 "$limit" "${kv[@]}" verify "${on[@]}" --dtype float32 --json "$out/verify-float32.json"
step verify-bfloat16 "$limit" "${kv[@]}" verify "${on[@]}" --dtype bfloat16 --json "$out/verify-bfloat16.json"
step patch-sweep "$limit" "${kv[@]}" bench patch-sweep "${on[@]}" --dtype float32 "${sweep[@]}" \
  --json "$out/patch-sweep.json"
step prefill "$limit" "${kv[@]}" bench prefill "${on[@]}" --dtype float32 "${prefill[@]}" --json "$out/prefill.json"
step memory "$limit" "${py[@]}" -m kvnotes.bench.memory "${on[@]}" --dtype float32 "${memory[@]}" \
  --json "$out/memory.json"
step report "$((limit * 2))" "${kv[@]}" report "${on[@]}" --dtype float32 --task order-cancel --quick \
  "${report[@]}" --out "$out/report"

python3 - "$out" "$device" "$dry" "$(($(date +%s) - start))" <<'PY'
import json, platform, shutil, subprocess, sys
from pathlib import Path

out, device, dry, total = sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
smi = None
if shutil.which("nvidia-smi"):
    done = subprocess.run(["nvidia-smi"], capture_output=True, text=True, check=False)
    smi = done.stdout or done.stderr
try:
    import torch

    torch_version = torch.__version__
    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") and cuda else platform.processor() or platform.machine()
except Exception as e:  # noqa: BLE001 - the summary says what went wrong rather than failing
    torch_version, cuda, name = f"unavailable: {e}", False, platform.machine()
steps = [json.loads(line) for line in Path(out, "steps.jsonl").read_text().splitlines() if line]
summary = dict(
    device=device,
    dry_run=dry,
    device_name=name,
    cuda_available=cuda,
    torch=torch_version,
    python=platform.python_version(),
    machine=f"{platform.machine()} {platform.node()}",
    nvidia_smi=smi,
    wall_s=total,
    passed=all(s["exit_code"] == 0 for s in steps),
    steps=steps,
)
Path(out, "summary.json").write_text(json.dumps(summary, indent=2))
print(f"device-check: {sum(s['exit_code'] == 0 for s in steps)}/{len(steps)} steps passed in {total} s; {out}/summary.json")
PY
exit "$failed"
