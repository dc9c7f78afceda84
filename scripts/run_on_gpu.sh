#!/usr/bin/env bash
# Every CUDA path and benchmark on a CUDA machine, from the project's root:
#   bash scripts/run_on_gpu.sh checks            # GPU tests + short real runs on CUDA (~5 min)
#   bash scripts/run_on_gpu.sh suite gpu_tests   # parts in order (an unknown one lists them)
# Parts: suite (the whole test suite, which pins the CPU, against this machine's torch, with
# pytest-xdist), gpu_tests, nccl, runs (real CUDA runs: default job, a run from its
# weights (trainer.init_from) and its checkpoint validated (trainer.validate_only), fp16 +
# accumulation + clipping, NCCL under torchrun (and early stopping there), DataParallel, compile with CUDA graphs, profiler, transformer,
# image folder + shm cache, shards, start-up), and one per benchmark: bench_gpu,
# bench_overhead (the tiny step), overhead_probe (where the tiny step's time goes: per-function
# profiles and the lockstep pairs without the prefetcher, ~2.5 min expected), overhead_cnn,
# bench_images, strategies, loader, checkpoint, speed (loader also runs bench_handoff). A step never outlives its
# time limit; a call cut off by its own (SIGTERM) says which step it cut in gpu-summary.txt
# and packs the archive once more, which is also packed every 30 s (a SIGKILL loses at most
# that). BENCH_GPU_REPEATS=1 halves bench_gpu's time. Seen on one H100, 2026-11-25 (16 cores, torch 2.11): gpu_tests 74 s,
# runs 3.8 min, loader 66 s, checkpoint 26 s, bench_gpu 256 s (--repeats 2, before its two
# feed rows, the 8-layer transformer and the 64 KB copy row: ~370 s expected; it writes its
# rows so far to bench_gpu_<tag>.partial.json after each repeat, which a run cut off leaves
# and pack collects), bench_overhead's tiny step ~110 s a repeat (8 runners, with
# Lightning: 3 repeats did not fit in 330 s), overhead_cnn ~50 s a repeat, bench_images
# (--repeats 1 --epochs 2) ~2 min, strategies 92 s, speed 149 s a repeat; suite not tried
# there since 2026-11-22 (a call of its own; it needs pytest-xdist and execnet wheels).
# Seen on one H200, 2026-11-26 (16 cores, torch 2.11): gpu_tests 62 s (21 tests), bench_gpu
# 276 s (--repeats 2), overhead_cnn 96 s, runs 149 s, checkpoint 21 s, loader 97 s (with
# bench_handoff); the machine's start about 30 s. A session has 15 minutes of device time,
# start and idle waits included, a call at most 10, and a machine is given back 30 s after a
# call ends: chain the calls at once. Run 2026-11-26: gpu_tests bench_gpu | overhead_cnn runs
# | checkpoint loader. Run 2026-11-27 (H200): gpu_tests runs (cut at shards_train by its 300 s
# limit: gpu_tests 98 s, the runs ~14 s each, compile_cudagraphs 37 s) | bench_overhead
# (322 s). Run 2026-11-27, second session (H200): gpu_tests runs (310 s: gpu_tests 95 s, 24
# tests; the runs 10-16 s each, compile_cudagraphs 36 s) | overhead_probe (110 s) |
# overhead_cnn strategies (283 s: overhead_cnn 206 s, strategies 72 s); 12.5 of 15 minutes.
# The third session of 2026-11-27 found 149 s of device time left (under the 4 minutes a
# start needs), and the fourth was lent no device: nothing ran; the rows below stand.
# Next, one row per lent session, the first unrun row first:
#   1. gpu_tests runs (~5.5 min, timeout_s 420) | bench_images speed (~7 min, timeout_s 480)
#   2. bench_gpu (BENCH_GPU_REPEATS=1) | bench_overhead
# Row 1 runs the CUDA paths again (never run on CUDA: the prefetcher's C++ stream entry and
# its pass now a generator that ends its loader's workers, the DDP sampler's change, the
# validation's values gathered as objects (NCCL), the write-barrier and start-up preemption
# all-reduces on the gloo groups) and the two benchmarks not run since their code changed;
# row 2 the feed rows and the tiny step (0.963 device, 0.907 host placement of plain in
# lockstep on the H200; 0.946 host without the prefetcher).
# Wheels the machine lacks (Hydra, OmegaConf, ANTLR, WebDataset) may wait in .gpu/whl; they are
# installed into /tmp/site. Benchmark JSON goes to docs/benchmarks/*_<gpu>.json; everything
# else (logs, run dirs without weights, gathered in $R, /tmp/gpu-results by default) into one
# archive, $OUT/gpu-results.tar.gz, and one line per step into $OUT/gpu-summary.txt.
set -u
PARTS="suite gpu_tests runs nccl bench_gpu bench_overhead overhead_probe overhead_cnn bench_images strategies loader checkpoint speed"
for part in "$@"; do  # before any install: a misspelt part is refused at once
  case " checks $PARTS " in *" $part "*) ;; *)
    echo "usage: run_on_gpu.sh checks | PART... ($PARTS)"; exit 2 ;; esac
done
if ls .gpu/whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu/whl/*.whl || { echo "wheel install failed"; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# without them every step fails on its first import: say so once (carry .gpu in the call)
python3 -c "import hydra, omegaconf" 2>/dev/null || {
  echo "hydra/omegaconf missing: fetch the wheels into .gpu/whl and carry .gpu"; exit 1; }
OUT=${OUT:-/tmp/gpu-out}; R=${R:-/tmp/gpu-results}; mkdir -p "$OUT" "$R" docs/benchmarks
S="$OUT/gpu-summary.txt"
# JSON files are named after the GPU (bench_gpu_h100.json): the device tool may lend an H200
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
TAG=${GPU_TAG:-$(echo "$gpu" | grep -oiE 'h100|h200|a100|l40s|l4|a10g' | head -1 | tr 'A-Z' 'a-z')}
TAG=${TAG:-gpu}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
  echo "cpus $(nproc)"
  df -h /dev/shm | tail -1 | awk '{print "/dev/shm", $2}'; } > "$R/device.txt" 2>&1  # (workers' batches)
tee "$S" < "$R/device.txt"
step() {  # step NAME SECONDS COMMAND...: bounded, log in the archive, one line in the summary
  local name=$1 limit=$2; shift 2; local t0=$SECONDS
  # in the background, waited for: a SIGTERM to this script is handled at once, not after
  # the step (timeout leads a process group of its own, which the trap below ends)
  STEP_NAME=$name STEP_T0=$t0  # (named first: a SIGTERM right after the fork finds it)
  timeout -k 10 "$limit" bash -c '"$@"' _ "$@" > "$R/$name.log" 2>&1 &
  STEP=$!; wait $STEP; local rc=$?; STEP= STEP_NAME=
  local last; last=$(grep -v '^\s*$' "$R/$name.log" | tail -1 | cut -c1-160)
  [ "$rc" = 124 ] && last="TIMED OUT after ${limit}s (incomplete) | $last"
  printf '%-26s rc=%-3s %4ss | %s\n' "$name" "$rc" "$((SECONDS - t0))" "$last" | tee -a "$S"
}
run() {  # run NAME OVERRIDES...: train.py on CUDA into its own run dir
  local name=$1; shift
  python3 train.py hydra.run.dir="$R/runs/$name" trainer.progress_bar=false "$@"
}
export -f run; export R
pack() {  # the benchmark files this call wrote (not older committed ones), logs, run dirs
  find docs/benchmarks -name "*_$TAG*" -newer "$R/device.txt" -exec cp {} "$R"/ \;
  # (weights are not results: a small archive; a running job's files are left alone)
  local tmp="$OUT/.gpu-results.$BASHPID.tmp"  # (the packer's and the script's apart)
  tar -czf "$tmp" --exclude='*.pt' -C "$R" . 2>/dev/null && \
    mv "$tmp" "$OUT/gpu-results.tar.gz"  # (whole or not at all)
  rm -f "$tmp"
}
# a call cut off by its limit leaves what it had: packed every 30 s, and once more on SIGTERM
( trap 'kill $! 2>/dev/null; exit 0' TERM; while :; do sleep 30 & wait $!; pack; done ) &
PACKER=$! STEP= STEP_NAME=
trap 'kill $PACKER 2>/dev/null' EXIT
cut_off() {  # SIGTERM (the call's limit) or Ctrl-C: the running step's line, then the archive
  if [ -n "$STEP_NAME" ]; then
    STEP=${STEP:-$!}  # (a signal between the step's fork and STEP=$!: $! is the step)
    kill $STEP 2>/dev/null; wait $STEP
    printf '%-26s rc=%-3s %4ss | %s\n' "$STEP_NAME" 124 "$((SECONDS - STEP_T0))" \
      "CUT OFF: the call ended (its time limit?) | $(grep -v '^\s*$' "$R/$STEP_NAME.log" \
      2>/dev/null | tail -1 | cut -c1-120)" | tee -a "$S"
  fi
  kill $PACKER 2>/dev/null; wait $PACKER 2>/dev/null  # (its pack done or ended: ours last)
  pack; exit 124
}
trap cut_off TERM INT
nccl() {  # DDP over NCCL in a torchrun job of one process (one GPU cannot show scaling)
  step nccl_torchrun_1 120 torchrun --standalone --nproc_per_node=1 train.py \
    trainer.strategy=ddp hydra.run.dir="$R/runs/nccl" trainer.progress_bar=false
  # the stop decided from all-reduced validation numbers, as under gloo
  step nccl_early_stop 120 torchrun --standalone --nproc_per_node=1 train.py \
    trainer.strategy=ddp hydra.run.dir="$R/runs/nccl_early_stop" trainer.progress_bar=false \
    trainer.max_epochs=200 trainer.checkpoint.monitor=val_loss \
    trainer.early_stopping.patience=2 trainer.early_stopping.min_delta=0.01
}
[ $# -gt 0 ] || set -- checks
parts=()
for part in "$@"; do
  if [ "$part" = checks ]; then parts+=(gpu_tests runs); else parts+=("$part"); fi
done
for part in "${parts[@]}"; do
case $part in
suite)
  step suite 540 python3 -m pytest -v -p no:cacheprovider -n 14 -m "not gpu"
  grep -oE "(FAILED|ERROR) tests/[^ ]*" "$R/suite.log" | sort -u | head -40 | tee -a "$S"
  ;;
gpu_tests)
  step pytest_gpu 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rA ${GPU_TESTS:-}
  grep -E "^(FAILED|ERROR|PASSED)" "$R/pytest_gpu.log" | cut -c1-200 | tee -a "$S"
  ;;
nccl) nccl ;;
runs)
  step default_job 120 run default
  # a new run from its weights (trainer.init_from: read on the CPU, copied into CUDA tensors)
  step init_from 60 run init_from trainer.init_from="$R/runs/default/checkpoints/last.pt" \
    trainer.max_epochs=1
  # the checkpoint validated once on CUDA: the default job's last validation, to its digits
  step validate_only 60 run validate_only trainer.validate_only=true \
    trainer.init_from="$R/runs/default/checkpoints/last.pt"
  step fp16_accum_clip 120 run fp16 experiment=synthetic_cnn trainer.precision=fp16 \
    trainer.accumulate_grad_batches=2 trainer.grad_clip=1.0 trainer.max_epochs=2
  nccl
  step dp_mode 120 run dp experiment=synthetic_cnn trainer.strategy=dp trainer.max_epochs=2
  # AUROC keeps the predictions it is given: copies of the replayed graph's outputs
  step compile_cudagraphs 240 run cudagraphs experiment=synthetic_cnn trainer.precision=bf16 \
    trainer.compile.enabled=true trainer.compile.mode=reduce-overhead trainer.max_epochs=2 \
    +task.metrics.auroc._target_=torchmetrics.classification.MulticlassAUROC \
    '+task.metrics.auroc.num_classes=${data.num_classes}'
  step profile 120 python3 train.py debug=profile hydra.run.dir="$R/runs/profile"
  step transformer_bf16 120 run lm experiment=tokens_transformer trainer.precision=bf16 \
    trainer.max_epochs=1
  step make_images 120 python3 scripts/make_images.py --out /tmp/imgs --count 2000
  step image_folder_shm 120 run imgs data=image_folder data.dataset.root=/tmp/imgs \
    data.dataset.size=64 model=cnn data.num_workers=8 data.cache=shm trainer.max_epochs=3
  step shards_pack 120 python3 scripts/prepare_data.py --format shards --out /tmp/shards \
    data=image_folder data.dataset.root=/tmp/imgs
  step shards_train 120 run shards data=shards data.dataset.root=/tmp/shards \
    data.dataset.size=64 model=cnn data.num_workers=8 trainer.max_epochs=2
  step start_up_fdr 60 python3 train.py debug=fdr hydra.run.dir="$R/runs/fdr"
  ;;
bench_gpu)
  step bench_gpu 460 python3 scripts/bench_gpu.py --repeats "${BENCH_GPU_REPEATS:-2}" \
    --out "docs/benchmarks/bench_gpu_$TAG.json"
  ;;
bench_overhead)
  step bench_overhead 420 python3 scripts/bench_overhead.py --workload tiny --repeats 3 \
    --startup-repeats 0 --out "docs/benchmarks/bench_overhead_$TAG.json"
  ;;
overhead_probe)  # where the tiny step's extra time goes on this machine's host: each
  # function's time per step (plain and Stoker, host and device placement), and the lockstep
  # pairs without the prefetcher's side stream (its share of the host placement's overhead)
  step overhead_profile 150 python3 scripts/bench_overhead.py --workload tiny --repeats 1 \
    --startup-repeats 0 --runners plain,stoker,plain_indexed,stoker_device \
    --profile "$R/overhead_profile" --out "$R/bench_overhead_profiled.json"
  step overhead_noprefetch 200 python3 scripts/bench_overhead.py --workload tiny --repeats 3 \
    --startup-repeats 0 --runners lockstep_host,lockstep_null \
    --override data.device_prefetch=false \
    --out "docs/benchmarks/bench_overhead_${TAG}_noprefetch.json"
  ;;
overhead_cnn)
  step overhead_cnn 300 python3 scripts/bench_overhead.py --workload cnn --repeats 3 \
    --startup-repeats 0 --out "docs/benchmarks/bench_overhead_${TAG}_cnn.json"
  ;;
bench_images)
  step bench_images 200 python3 scripts/bench_images.py --workers 8 --repeats 1 --epochs 2 \
    --out "docs/benchmarks/bench_images_$TAG.json"
  ;;
strategies)
  step compare_strategies 100 python3 scripts/compare_strategies.py --nproc 1 \
    --out "docs/benchmarks/compare_strategies_$TAG.json"
  ;;
loader)
  step bench_loader 80 python3 scripts/bench_loader.py --workers 8 \
    --out "docs/benchmarks/bench_loader_$TAG.json"
  step bench_handoff 90 python3 scripts/bench_handoff.py --workers 8 \
    --out "docs/benchmarks/bench_handoff_$TAG.json"
  ;;
checkpoint)
  step bench_checkpoint 60 python3 scripts/bench_checkpoint.py \
    --out "docs/benchmarks/bench_checkpoint_$TAG.json"
  ;;
speed)
  step bench_speed 330 python3 scripts/bench_speed.py --precision bf16 --repeats 2 \
    --out "docs/benchmarks/bench_speed_$TAG.json"
  ;;
*) echo "run_on_gpu.sh: part $part has no steps"; exit 2 ;;  # (listed in PARTS, not below)
esac
pack  # after every part: a call cut off by its time limit still returns the parts done
done
echo "archive: $(du -h "$OUT/gpu-results.tar.gz" | cut -f1)" | tee -a "$S"
