#!/usr/bin/env bash
# One call's work on the lent GPU (see docs/benchmarks.md): the CUDA tests, then benchmarks.
#   scripts/gpu_round.sh tests            CUDA tests + kernel tests (compiled Triton); XDIST=N:
#                                         in N pytest-xdist workers sharing the GPU (the
#                                         device has xdist; not tried there yet)
#   scripts/gpu_round.sh bench SHAPE ...  shoal bench throughput for random:<shape>s
#   scripts/gpu_round.sh pool SPEC ...     issue 25's grid: shoal bench ttft for each
#                                         shape:prefix_tokens:source[:rounds[:block_size]]
#                                         (source files|tier; 2 rounds, the bench's block
#                                         size unless given), a line a point in grid.txt
#   scripts/gpu_round.sh moe              issue 30's figures: the fused MoE's tiles, the MoE
#                                         and MLA decode step at batch 64 and 256, and
#                                         DeepSeek-V2-Lite's 8k TTFT from the pool
#   scripts/gpu_round.sh loads [P:T ...]  Llama-1B 8k from files traced (split_probe.py, IO_TRACE):
#                                         a recompute, a whole load, two splits, for each
#                                         P read processes and T I/O threads (default 16:2 0:8)
#   scripts/gpu_round.sh leads            the leads of docs/roadmap.md item 2 (cold start,
#                                         whole loads from files, 8B 8k rows)
#   scripts/gpu_round.sh host             the engine's host floor per decode step (a tiny
#                                         model's graphs at 64 and 256 rows) beside the 135M
#                                         shape's step at 256 rows (issue 26)
#   scripts/gpu_round.sh prefill [SHAPE ...]  issue 26's prefill MFU: shoal bench prefill (8 x 4096)
#                                         for each shape (default llama-1b llama-8b)
#   scripts/gpu_round.sh mla              MLA's expanded attention with and without cuDNN's
#                                         SDPA, and V2-Lite's 8k TTFT from the pool either way
# Before spending device time: `env -u TRITON_INTERPRET .venv/bin/python
# scripts/compile_kernels.py` compiles the newest kernels for sm_90 here, without a GPU, and
# `scripts/device_prep.sh` makes .whl and .tok (what the device lacks; carry both).
# Results go to $OUT (or ./gpu-out); the device machine's python3 has torch, Triton and
# transformers; Shoal's pure-Python needs beyond those travel in .whl if missing.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 SHOAL_CACHE=/tmp/shoal-cache
what=$1; shift
if [ "$what" = tests ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
  python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)' | tee -a "$OUT/gpu.txt"
  python3 -m pytest -q -p no:cacheprovider -rfE --durations=12 ${XDIST:+-n "$XDIST" --dist load} \
    tests/test_paged_attention.py \
    tests/test_cuda.py tests/test_host_tier.py tests/test_gpu_xxh3.py tests/test_gpu_place.py tests/test_fused_ops.py \
    tests/test_paged_mla.py tests/test_fused_moe.py tests/test_warm_up.py tests/test_read_procs.py \
    tests/test_structured_output.py::test_masking_keeps_exactly_the_allowed_tokens -k "not smollm2" "$@" 2>&1 \
    | tee "$OUT/tests.log" | tail -60
elif [ "$what" = moe ]; then
  timeout 120 python3 scripts/moe_tune.py 64 256 4096 2>&1 | tee "$OUT/moe_tune.txt" | tail -30
  bash "$0" bench qwen3-30b-a3b@8:64:256:32 deepseek-v2-lite@9:64:256:32 \
    qwen3-30b-a3b@8:256:256:32 deepseek-v2-lite@9:256:256:32
  python3 -m shoal bench ttft --model random:deepseek-v2-lite@9 --device cuda \
    --prefix-tokens 8192 --rounds 3 2>&1 | tee -a "$OUT/ttft.log" | tail -12
elif [ "$what" = host ]; then
  for rows in 64 256; do
    timeout 240 python3 scripts/host_step_probe.py "$rows" 3 cuda 2>&1 | grep -v Writing \
      | tee -a "$OUT/host.txt"
  done
  timeout 300 python3 scripts/generate_only.py random:smollm2-135m 256 256 3 2>&1 \
    | tee -a "$OUT/host.txt" | tail -4
elif [ "$what" = prefill ]; then
  shapes=("$@"); [ ${#shapes[@]} -eq 0 ] && shapes=(llama-1b llama-8b)
  for shape in "${shapes[@]}"; do
    timeout 240 python3 -m shoal bench prefill --model "random:$shape" --device cuda 2>&1 \
      | tee -a "$OUT/prefill.log" | tail -2 | head -1
  done
elif [ "$what" = mla ]; then
  python3 scripts/mla_sdpa_probe.py 2>&1 | tee "$OUT/mla_probe.txt"
  for mode in ttft ttft-cudnn; do
    echo "== $mode" >>"$OUT/mla_ttft.log"
    python3 scripts/mla_sdpa_probe.py "$mode" --model random:deepseek-v2-lite@9 --device cuda \
      --prefix-tokens 8192 --rounds 2 2>&1 | tee -a "$OUT/mla_ttft.log" | tail -6
  done
elif [ "$what" = loads ]; then
  baseline=1 cfgs=("$@")
  [ ${#cfgs[@]} -eq 0 ] && cfgs=(16:2 0:8)
  for cfg in "${cfgs[@]}"; do
    echo "## READ_PROCS=${cfg%%:*} IO_THREADS=${cfg##*:}" | tee -a "$OUT/loads.log"
    BASELINE=$baseline READ_PROCS=${cfg%%:*} IO_THREADS=${cfg##*:} IO_TRACE=1 timeout 150 \
      python3 scripts/split_probe.py random:llama-1b 8192 16 files 2>&1 | grep -v Writing \
      >>"$OUT/loads.log"
    baseline=
  done
  grep "## \|== \|launched in\|units, medians\|shares, ms" "$OUT/loads.log" | cut -c1-150
elif [ "$what" = leads ]; then
  # the tenth session's leads (docs/roadmap.md item 2), ~7 minutes on an H100: the first
  # short chunk's cold start with cuBLAS's kernels loaded lazily or eagerly; whole loads
  # from files with the engine's idle wait; the 8B rows at 64-token blocks
  for loading in LAZY EAGER; do
    echo "== CUDA_MODULE_LOADING=$loading" | tee -a "$OUT/leads.log"
    CUDA_MODULE_LOADING=$loading timeout 150 python3 scripts/chunk_probe.py random:llama-8b 8192 \
      2>&1 | grep "engine, last\|execute wall" | tee -a "$OUT/leads.log"
  done
  WHOLE=3 timeout 120 python3 scripts/split_probe.py random:llama-8b 8192 64 files 2>&1 \
    | grep "==\|start_load\|loads done\|execute" | cut -c1-120 | tee -a "$OUT/leads.log"
  for source in files tier; do
    timeout 150 python3 -m shoal bench ttft --model random:llama-8b --device cuda \
      --prefix-tokens 8192 --rounds 2 --block-size 64 --source $source 2>&1 | tail -6 \
      | cut -c1-200 | tee -a "$OUT/leads.log"
  done
elif [ "$what" = pool ]; then
  for spec in "$@"; do  # shape:prefix_tokens:source[:rounds[:block_size]]
    IFS=: read -r shape n source rounds bs <<<"$spec"
    echo "== $spec" >>"$OUT/pool.log"
    python3 -m shoal bench ttft --model "random:$shape" --device cuda --prefix-tokens "$n" \
      --source "$source" --rounds "${rounds:-2}" ${bs:+--block-size "$bs"} 2>&1 \
      | tee -a "$OUT/pool.log" | tail -6 | cut -c1-160
    # one line a point: the ratios to the recompute, the decision, the floor
    tail -1 "$OUT/pool.log" | python3 -c 'import json, sys
d = json.loads(sys.stdin.read()); s = d["split"] or {}
r = [d[k] for k in ("ttft_recomputed_s", "ratio_load_only_over_recomputed",
                    "ratio_pool_over_recomputed", "ratio_floor_over_recomputed")]
print("%s %s %s: recomputed %.3f s, whole %.3f, compute+load %.3f (%s %s/%s), floor %.3f" % (
    d["model"], d["prompt_tokens"], d["source"], r[0], r[1], r[2], s.get("decision"),
    s.get("front_tokens"), s.get("loaded_tokens"), r[3]))' \
      2>/dev/null | tee -a "$OUT/grid.txt"
  done
else
  for spec in "$@"; do  # shape:num_prompts:prompt_len:max_tokens
    IFS=: read -r shape n len toks <<<"$spec"
    python3 -m shoal bench throughput --model "random:$shape" --device cuda --num-prompts "$n" \
      --prompt-len "$len" --max-tokens "$toks" --rounds 2 2>&1 | tee -a "$OUT/bench.log" | tail -8
  done
fi
