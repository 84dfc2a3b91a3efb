#!/usr/bin/env bash
# Prepared single-GPU check (run through the device tool when a GPU is lent; a few minutes on an H200):
# profiler peak vs torch.cuda.max_memory_allocated and predicted vs measured step time for GPT-2 large (8x1024)
# and a ~1B Llama (4x2048) in bf16, with and without our runtime applied (see scripts/gpu_check.py).
#
# Made for a machine with no network whose python3 has torch/transformers/accelerate but not this project's
# solver dependencies: the project runs from source (PYTHONPATH, no `pip install -e .`, whose torch>=2.13
# pin that machine does not meet), and pulp/highspy come from the wheels in the ignored folder .whl/,
# installed into /tmp/site only when python3 cannot already import them. Where .whl/ holds no wheel, or the
# packages are installed (a development machine), the install step is skipped. The wheels (py3.12, manylinux
# x86_64, the versions of the dev venv; pulp has no dependencies, highspy needs only numpy) are fetched with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl pulp==3.3.2 highspy==1.16.0
# (`datasets`, a dependency of the recipes only, is not needed here.)
#
# Writes $OUT/gpu_check.json (rewritten after every model) and $OUT/gpu_check.log when $OUT is set.
# PYTHON overrides the interpreter (default python3); extra arguments go to gpu_check.py, e.g.
#   PYTHON=.venv/bin/python bash scripts/gpu_check.sh --device cpu --models tiny-gpt2 --batch-size 2 --seq-len 32 --steps 1
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
SITE=/tmp/site

shopt -s nullglob
wheels=(.whl/*.whl)
shopt -u nullglob
if ((${#wheels[@]})) && ! "$PY" -c 'import pulp, highspy' >/dev/null 2>&1; then
    echo "installing ${#wheels[@]} wheel(s) into $SITE: ${wheels[*]}"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "${wheels[@]}" || echo "WARNING: wheel install failed; going on with what is importable"
fi

export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

"$PY" -c 'import sys, torch, transformers
cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, {cuda}")'
"$PY" -c 'import pulp, highspy; print(f"pulp {pulp.__version__} from {pulp.__file__}; highspy from {highspy.__file__}")' ||
    echo "WARNING: pulp/highspy not importable: planning will fail"

# calibrate this device first (GEMMs, bandwidth, attention, per-op overheads): the check then compares the
# calibrated predictions (and the datasheet preset's) with the measurements
SPEC="${OUT:-/tmp}/device_calibration.json"
[[ -n "${OUT:-}" ]] && mkdir -p "$OUT"
spec_args=()
if "$PY" -m hf_colossal_auto.cli calibrate --out "$SPEC" "${CALIBRATE_ARGS[@]+"${CALIBRATE_ARGS[@]}"}"; then
    spec_args=(--device-spec "$SPEC")
else
    echo "WARNING: calibration failed; predicting with the preset"
fi

cmd=("$PY" scripts/gpu_check.py --models gpt2-large:8x1024 llama-1b:4x2048 --steps 5 "${spec_args[@]+"${spec_args[@]}"}")
if [[ -n "${OUT:-}" ]]; then
    cmd+=(--json "$OUT/gpu_check.json")
fi
cmd+=("$@")
echo "+ ${cmd[*]}"
if [[ -n "${OUT:-}" ]]; then
    "${cmd[@]}" 2>&1 | tee "$OUT/gpu_check.log"
else
    "${cmd[@]}"
fi
