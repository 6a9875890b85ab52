#!/usr/bin/env bash
# The shapes model, end to end, with the project's own commands:
#   bash configs/shapes/recipe.sh OUT            (then: unclip generate "..." --model OUT/pipeline)
# Lanes (2 CPU cores; every process single-threaded, which is far faster than 2 threads per process
# on a shared machine):
#   A: CLIP (train-clip) -> decoder 32 px (train-decoder, torchrun 2 processes) | prior (train-prior)
#      -> decoder fine-tuned on mostly two-object scenes (train-decoder with train.init_weights)
#   B: upsampler 32->64 (sr64) and upsampler 64->128 (sr128), which need no CLIP, while CLIP trains.
# The CLIP both conditions the prior and decoder and reranks the decoder's candidates.
# Then `unclip assemble` and the finishing step (default sampling settings, fp16 weights).
# Per-step wall-clock seconds go to OUT/timings.tsv, logs to OUT/logs/.
set -euo pipefail
OUT=${1:?usage: bash configs/shapes/recipe.sh OUT}
CFG=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT/logs"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
UNCLIP=${UNCLIP:-unclip}
TORCHRUN=${TORCHRUN:-torchrun}

step() {  # step NAME command...   (runs it, logs it, records its wall-clock time)
  local name=$1; shift
  local t0=$SECONDS
  echo "[$(date +%T)] start $name"
  "$@" > "$OUT/logs/$name.log" 2>&1 || { echo "step $name failed; see $OUT/logs/$name.log" >&2; return 1; }
  printf '%s\t%d\n' "$name" $((SECONDS - t0)) >> "$OUT/timings.tsv"
  echo "[$(date +%T)] done  $name ($((SECONDS - t0)) s)"
}

lane_b() {  # the upsamplers side by side
  step sr64 "$UNCLIP" train-decoder "$CFG/sr64.yaml" --output-dir "$OUT/sr64" & local sr64=$!
  step sr128 "$UNCLIP" train-decoder "$CFG/sr128.yaml" --output-dir "$OUT/sr128" & local sr128=$!
  wait $sr64 || return 1
  wait $sr128 || return 1
}
lane_b & LANE_B=$!
step clip "$UNCLIP" train-clip "$CFG/clip.yaml" --output-dir "$OUT/clip"
CLIPW="$OUT/clip/final/clip/model.safetensors"
step prior "$UNCLIP" train-prior "$CFG/prior.yaml" "clip.pretrained=$CLIPW" --output-dir "$OUT/prior" & PRIOR=$!
step decoder "$TORCHRUN" --standalone --nproc_per_node 2 -m unclip.cli.train_decoder "$CFG/decoder.yaml" \
  "clip.pretrained=$CLIPW" --output-dir "$OUT/decoder"
# second decoder run: fine-tune on 60 % two-object scenes (docs/shapes_model.md)
step decoder_pairs "$TORCHRUN" --standalone --nproc_per_node 2 -m unclip.cli.train_decoder "$CFG/decoder.yaml" \
  "clip.pretrained=$CLIPW" "train.init_weights=$OUT/decoder/final/decoder" data.shapes_two_object_prob=0.6 \
  train.max_steps=7000 train.lr=4e-4 train.warmup_steps=200 --output-dir "$OUT/decoder_pairs"
wait $PRIOR
wait $LANE_B
step assemble "$UNCLIP" assemble --clip "$OUT/clip/final/clip" --prior "$OUT/prior/final/prior" \
  --decoder "$OUT/decoder_pairs/final/decoder" --upsampler "$OUT/sr64/final/sr64" \
  --upsampler "$OUT/sr128/final/sr128" --out "$OUT/pipeline"
step finalize "$UNCLIP" shapes-finalize "$OUT/pipeline" --sampling "$CFG/sampling.yaml" \
  --closed-vocabulary clip
echo "pipeline: $OUT/pipeline   (evaluate: unclip shapes-eval --model $OUT/pipeline)"
