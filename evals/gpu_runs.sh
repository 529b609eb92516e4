#!/usr/bin/env bash
# The GPU measurements a maintainer reruns, one job per device call (never run by CI).
#
#   bash evals/gpu_runs.sh JOB        with OUT set to a folder for results (the device tool sets it)
#
# Jobs (wall time on one H200; each fits a 10-minute call):
#   kernels         `replayquant bench kernels --preset targets` beside the ReplaySSM authors'
#                   kernels (.gpu/authors): GPU checks, accuracy against float64, both kinds at
#                   their main L over every batch, in phase and staggered, pairs s32_rs /
#                   tp8_hi32 / tp4_hi32, KDA conventional rows, peers, speculative rounds T = 4 at
#                   B = 512; every target of bench/targets.py from one call, one kernels.json
#                   (265 s of wall time including the install; the plan estimated 220 s and the
#                   budget skipped its last sections, listed in the file's `skipped`)
#   probe           evals/gpu_checks.py, then `bench kernels --preset probe` beside the authors:
#                   the launch-config sweep of every kind at B = 256 (read and flush launch of
#                   each pair apart), then its picks' windows and the speculative rounds; the
#                   sweep of three kinds with ten read candidates filled the 300-s budget (478 s
#                   of wall time in all) and the budget skipped the sections after GDN s32_rs
#   ncu             Nsight Compute on one GDN tp4_hi32 read step at B = 256 (evals/ncu_read_step.py):
#                   the flush launch (its programs all return) and the read launch: speed of light,
#                   memory, warp state, launch statistics, occupancy (~60 s)
#   checks          evals/gpu_checks.py: the kernels against their torch references at the real
#                   head shapes, the reference casts on the device against the CPU (~50 s)
#   tf              `bench teacher-forcing`: the chunk kernel check and per-layer timing at 8K,
#                   then the whole model at 131072 tokens; `bench kl` at 131072 tokens (~480 s)
#   decode          the CUDA-only decode tests (recorded decode steps against eager ones, bit for bit,
#                   on the three embedded models; the faults a step notes in its own launches, with
#                   the GPU's atomics, against the torch references; an FP32 pair's decode after a
#                   prompt against a float64 loop, GDN, Mamba-2 and KDA), then
#                   evals/compiled_generate_check.py: HF's
#                   compiled static-cache generate against the eager one, greedy tokens, on the
#                   three embedded models with s32_rs and tp4_hi16_sr (on an H100: 60 s of tests
#                   on a machine that had compiled the kernels before, over 200 s on a fresh one,
#                   where Triton compiles them; then 80 s for the check, tiny-kimi-linear the longest)
#   bench-generate  `bench generate` at the batch given as the second argument (default 1) for
#                   s32_rs and tp4_hi16_sr, added to the file named by the third argument (an
#                   earlier call's generate.json of the same commit, carried; the batches of one
#                   commit gather in one file; or `replayquant bench merge` joins the files of
#                   calls that each wrote their own); on an H100 a batch with both pairs took
#                   290-380 s of wall time, compiles included
#   gpqa-timing     evals/gpqa_cot_timing.py: questions per minute of GPQA-Diamond with chain of
#                   thought (lm-eval, batch 8) on the Qwen3.5-4B shape, this tree eager and compiled
#                   beside an older tree's package in .gpu/before (its commit in .gpu/before/COMMIT);
#                   needs lm-eval, datasets and their missing needs as wheels in .gpu/lmeval
#                   (on H100 machines 340-565 s of wall time: 26-30 s saving the model,
#                   77-160 s a way);
#                   arguments after the job name go to the script (--ways compiled,hf_compiled
#                   --questions 24: two ways, two batches after the compiling one)
#   spec            evals/spec_gpu.py: decode tokens/s of speculation against plain decode,
#                   eager and compiled (plain decode; speculation runs eager, the static cache
#                   refused with it), on the Qwen3.5-4B shape at B = 1 with long-memory gates, pairs
#                   s32_rs and tp4_hi16_sr, a 512-token prompt of a held-out excerpt said four
#                   times, 96 new tokens, 3 timed runs a way: oracle drafts (the pair's own plain
#                   tokens, 4 a round: speculation's ceiling) and prompt lookup (4 drafts); the
#                   verify forwards' GPU time per length (CUDA events), the break-even acceptance,
#                   compiles in timed runs (0: warm-ups meet every verify length); the JSON
#                   is written after every way. On an H100 one pair (s32_rs, 64 new tokens)
#                   took 214 s: give one pair a call, `bash evals/gpu_runs.sh spec --pairs
#                   s32_rs` (timeout 540 s; arguments after the job name go to the script)
#   fused-read      evals/fused_read_bench.py: the decode step of tp8_hi32 and s32_rs as one
#                   launch on the read's tiles (the flush inside the read program; at the read's
#                   register cap and at 168) beside two launches and the authors' windows, GDN
#                   and Mamba-2 at B = 1, 32, 256, in phase and staggered, after a device check
#                   of the one launch against the two; before each kind's windows the one-pass
#                   verify's rounds (T = 4, B = 512) with its pre-flushes inside its read program
#                   (uncapped and at 128 registers) beside the flush launch first and the authors'
#                   round (--budget-s of timing, 400 by default; arguments after the job name go
#                   to the script). An NVFP4 read copy with a carried scale beside today's whole
#                   matrices: fused-read --pairs tp4_hi32 --ways two,today,carried,carried-read
#                   --spec-ways two,carried,carried-read128 --batches 32,256 --budget-s 330
#   generate        evals/cuda_generate_check.py: generation through the compiled decode kernel
#                   against the CPU path on the shipped tiny models (~150 s)
#   train           evals/train_tiny.py device-run: train both tiny models, evaluate them and
#                   run their 16K demo (needs the corpus in .gpu/tiny; ends by its
#                   425 s deadline)
#
# At most 8 files come back from $OUT per call: the jobs write their JSON there (and the generate
# check its log) and keep the other logs in /tmp, printing the lines that matter.
#
# Carry .gpu (fla-core and einops wheels in .gpu/wheels, mamba_ssm's selective_state_update files
# with their COMMIT, the authors' kernel files in .gpu/authors with their COMMIT, the tiny corpus
# for `train`); pass REPLAYQUANT_GIT_COMMIT=$(git rev-parse HEAD) (the device copy
# has no .git). The image has torch, triton, transformers, accelerate, rich, typer, matplotlib;
# not fla.
set -uo pipefail
: "${OUT:?set OUT to the folder where results go}"
jobs="kernels|probe|ncu|checks|tf|decode|bench-generate|gpqa-timing|spec|fused-read|generate|train"
job=${1:?usage: bash evals/gpu_runs.sh $jobs}
[[ "|$jobs|" == *"|$job|"* ]] \
    || { echo "gpu_runs: unknown job '$job'; choose one of $jobs" >&2; exit 2; }
export PYTHONUNBUFFERED=1 REPLAYQUANT_GIT_COMMIT=${REPLAYQUANT_GIT_COMMIT:-unknown}
python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/site .gpu/wheels/*.whl \
    || { echo "gpu_runs: could not install the carried wheels in .gpu/wheels" >&2; exit 1; }
export PYTHONPATH=$PWD:/tmp/site:$PWD/.gpu
python3 -c "import fla, einops; print('fla', fla.__version__)" \
    || { echo "gpu_runs: fla does not import; HF would fall back to its slow torch path" >&2; exit 1; }
rq=(python3 -m replayquant.cli)      # an array: `timeout` cannot run a shell function
case "$job" in
  kernels)
    timeout 560 "${rq[@]}" bench kernels --out "$OUT" --name kernels --preset targets \
        --authors .gpu/authors --budget-s 520 > "$OUT/kernels.log" 2>&1; echo "kernels rc=$?"
    grep -E "^\[bench|^copy|Not measured|failed|^  (ours|authors)" "$OUT/kernels.log" | cut -c1-2000
    ;;
  probe)
    timeout 200 python3 evals/gpu_checks.py "$OUT/gpu_checks.json" > "$OUT/gpu_checks.log" 2>&1
    echo "checks rc=$?"; grep -E "max_rel|equal|frac" "$OUT/gpu_checks.log" | head -60
    timeout 330 "${rq[@]}" bench kernels --out "$OUT" --name probe --preset probe \
        --authors .gpu/authors --budget-s 300 > "$OUT/probe.log" 2>&1; echo "probe rc=$?"
    grep -E "^\[bench|^copy|Not measured|failed|^  (ours|authors)|^  (gdn|mamba2) " \
        "$OUT/probe.log" | cut -c1-2000
    ;;
  ncu)
    timeout 200 ncu -k regex:_replay_kernel --launch-skip 2 --launch-count 2 --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats \
        --section Occupancy python3 evals/ncu_read_step.py gdn tp4_hi32 256 > "$OUT/ncu.txt" 2>&1
    echo "ncu rc=$?"; grep -E "_replay_kernel|Duration|Throughput|Registers|Occupancy" "$OUT/ncu.txt"
    ;;
  checks)
    timeout 300 python3 evals/gpu_checks.py "$OUT/gpu_checks.json" > /tmp/gpu_checks.log 2>&1
    echo "checks rc=$?"; tail -40 /tmp/gpu_checks.log
    ;;
  tf)
    timeout 260 "${rq[@]}" bench teacher-forcing --part layer --lengths 8192 \
        --out "$OUT/teacher_forcing.json" > /tmp/tf_layer.log 2>&1; echo "layer rc=$?"
    timeout 120 "${rq[@]}" bench teacher-forcing --part model --out "$OUT/teacher_forcing.json" \
        > /tmp/tf_model.log 2>&1; echo "model rc=$?"
    timeout 180 "${rq[@]}" bench kl --context 131072 --pair f4_sr_rs --pair tp4_hi32 \
        --out "$OUT/kl_128k.json" > /tmp/kl.log 2>&1; echo "kl rc=$?"
    tail -5 /tmp/tf_layer.log /tmp/tf_model.log /tmp/kl.log
    ;;
  decode)
    TRITON_INTERPRET=0 timeout 260 python3 -m pytest -q -s -p no:cacheprovider tests/models/test_decode_graph.py \
        tests/kernels/replay/test_kernel_faults.py tests/models/test_decode_exact.py -k cuda -rA > "$OUT/decode_tests.log" 2>&1
    echo "tests rc=$?"
    grep -E "cuda: prompt" "$OUT/decode_tests.log"
    grep -E "PASSED|FAILED|Error" "$OUT/decode_tests.log" | head -12
    timeout 300 python3 evals/compiled_generate_check.py "$OUT/compiled_generate_check.json" \
        --pairs s32_rs,tp4_hi16_sr > /tmp/cgc.log 2>&1; echo "compiled generate check rc=$?"
    grep "^{" /tmp/cgc.log | cut -c1-400
    ;;
  bench-generate)
    if [[ -n "${3:-}" ]]; then cp "$3" "$OUT/generate.json" && chmod u+w "$OUT/generate.json" || exit 1; fi
    timeout 560 "${rq[@]}" bench generate --batch "${2:-1}" --add --out "$OUT/generate.json" \
        > "$OUT/generate.log" 2>&1; echo "bench generate rc=$?"
    grep -E "^(met|MISS)|error|@B" "$OUT/generate.log" | cut -c1-600
    ;;
  gpqa-timing)
    python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/site .gpu/lmeval/*.whl \
        || { echo "gpu_runs: could not install the wheels in .gpu/lmeval" >&2; exit 1; }
    python3 -c "import lm_eval, datasets, pyarrow; print('lm_eval', lm_eval.__version__, 'datasets', \
        datasets.__version__, 'pyarrow', pyarrow.__version__)" || exit 1
    timeout 570 python3 evals/gpqa_cot_timing.py "$OUT/gpqa_cot_timing.json" --before .gpu/before \
        --before-commit "$(cat .gpu/before/COMMIT)" "${@:2}" > "$OUT/gpqa_timing.log" 2>&1
    echo "gpqa-timing rc=$?"; grep -vE "it/s\]|s/it\]" "$OUT/gpqa_timing.log" | tail -40 | cut -c1-1500
    ;;
  spec)
    timeout 540 python3 evals/spec_gpu.py "$OUT/spec_gpu.json" "${@:2}" > "$OUT/spec_gpu.log" 2>&1
    echo "spec rc=$?"; grep -vE "it/s\]|s/it\]" "$OUT/spec_gpu.log" | tail -22 | cut -c1-1500
    ;;
  fused-read)
    timeout 560 python3 evals/fused_read_bench.py "$OUT/fused_read.json" --authors .gpu/authors \
        "${@:2}" > "$OUT/fused_read.log" 2>&1; echo "fused-read rc=$?"
    grep -vE "it/s\]|s/it\]" "$OUT/fused_read.log" | tail -60 | cut -c1-400
    ;;
  generate)
    timeout 300 python3 evals/cuda_generate_check.py "$OUT/cuda_generate.json" --new-tokens 32 \
        > "$OUT/cuda_generate_check.log" 2>&1; echo "generate rc=$?"
    tail -30 "$OUT/cuda_generate_check.log"
    ;;
  train)
    # writes at most 8 files into $OUT (model folders, log, demo results); then, here:
    # python evals/train_tiny.py install --from <that folder>
    timeout 500 python3 evals/train_tiny.py device-run --data .gpu/tiny --out "$OUT" \
        --time-budget 120,120 --deadline 425 --reserve 85 \
        --source-commit "$REPLAYQUANT_GIT_COMMIT" 2>&1 | tee /tmp/train_stdout.txt
    echo "train rc=${PIPESTATUS[0]}"
    ;;
esac
