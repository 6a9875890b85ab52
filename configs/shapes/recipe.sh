#!/usr/bin/env bash
# The shapes model, end to end, with the project's own commands:
#   bash configs/shapes/recipe.sh OUT [--set STEP:key=value ...]   (then: unclip generate "..." --model OUT/pipeline)
# The same as `unclip recipe shapes OUT`, with this folder's configs (UNCLIP names the command if
# `unclip` is not on PATH, e.g. UNCLIP="python -m unclip.cli"). The steps and which run side by side
# on 2 cores: unclip/shapes/recipe.py. Run it again after a failure or an interruption: finished
# steps are skipped, interrupted training resumes from its last checkpoint. Per-step wall-clock
# seconds go to OUT/timings.tsv, logs to OUT/logs/.
set -euo pipefail
OUT=${1:?usage: bash configs/shapes/recipe.sh OUT [--set STEP:key=value ...]}
shift
# shellcheck disable=SC2086  # UNCLIP may be a command with arguments
exec ${UNCLIP:-unclip} recipe shapes "$OUT" --configs "$(cd "$(dirname "$0")" && pwd)" "$@"
