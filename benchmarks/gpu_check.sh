#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py) on a machine that has PyTorch, accelerate,
# transformers and peft but not the rest of unclip's dependencies, and no network: the missing
# packages travel as wheels in .whl/ at the repository's root (ignored by git). docs/gpu_check.md
# says how to run it on a lent H200.
#
#   bash benchmarks/gpu_check.sh --fetch-wheels   # once, where pip reaches PyPI: fills .whl/
#   bash benchmarks/gpu_check.sh OUT [ARGS...]    # on the GPU machine: installs, then runs
#
# ARGS go to gpu_check.py (e.g. --only train fsdp). The run's own deadline is 440 s; `timeout`
# sends SIGTERM at 460 s whatever a kernel is doing (the report is then written with the section
# it stopped) and SIGKILL 5 s later: with the install, under 8 minutes in all.
set -euo pipefail
cd "$(dirname "$0")/.."

# what the GPU machine's image lacks, at the versions the project is tested with; all pure Python
# but wcwidth (an abi3 manylinux wheel). diffusers lists importlib_metadata, which it imports only
# on Pythons before 3.8: not carried (its own new releases need one more package, lazy-importer).
WHEELS=(
  diffusers==0.42.1
  open_clip_torch==3.3.0
  ftfy==6.3.1
  wcwidth==0.9.4
  webdataset==1.0.2
  braceexpand==0.1.7
  torch-fidelity==0.4.0
)

if [[ "${1:-}" == "--fetch-wheels" ]]; then
  exclude="$(git rev-parse --git-path info/exclude)"
  mkdir -p "$(dirname "$exclude")"
  grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl "${WHEELS[@]}"
  ls -l .whl
  exit 0
fi

OUT="${1:?usage: gpu_check.sh OUT [ARGS...] | --fetch-wheels}"
shift
if ! compgen -G ".whl/*.whl" > /dev/null; then
  echo "no wheels in .whl/: run 'bash benchmarks/gpu_check.sh --fetch-wheels' first and carry .whl" >&2
  exit 2
fi
SITE=/tmp/gpu-check-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" .whl/*.whl
# unclip itself, for its entry points (diffusers folders, the shapes reranker) and its bundled
# model; built from this tree with the image's own setuptools, nothing fetched
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
  --no-cache-dir --upgrade --target "$SITE" .
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
set +e
timeout -k 5 460 python3 benchmarks/gpu_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
status=${PIPESTATUS[0]}
echo "gpu_check exit status: $status"
exit "$status"
