#!/usr/bin/env bash
# The GPU runs still owed by issues 4, 5, 6 and 8, one job per device call (never run by CI).
#
#   bash evals/gpu_runs.sh JOB        with OUT set to a folder for results (the device tool sets it)
#
# Jobs (wall time on one H200, within a 10-minute call):
#   tf       chunk kernel check + per-layer timing at 8K, whole-model teacher forcing at 131072
#            tokens (issue 5), bench kl --context 131072 (issue 6)             ~480 s
#   mamba    retrain tiny-mamba2 (issue 8), evaluate both tiny models, 16K demo of both on the
#            GPU (evals/train_tiny.py device-run)                              ~250 s
#   decode   bench kernels for what run 5 left unmeasured: Mamba-2 (L = 8, verify, peer), GDN
#            B = 512 and verify T = 4 (issue 4)                                ~480 s
#   generate evals/cuda_generate_check.py (generate through the compiled decode kernel vs the
#            CPU path, issue 5)                                               ~60 s
#   read     GDN B = 256 (L = 16) decode with the kernel-vs-reference checks first: times the
#            select-free E2M1 / E4M3 decoders (session 4, untimed) against run 10  ~150 s
#   dots     Mamba-2 'dots' read at B = 128 / 256 / 512, GDN batch 1 and 8   ~400 s
#   defaults the 'dots' read's default block (16 rows, 1 warp) at B = 128 / 512, both kinds
#   batch1   B = 1 and 8, both kinds: the forced flush's early anchor load     ~200 s
#   targets  B = 1 and 256, both kinds, main L: issue 4's targets with byte ceilings ~280 s
#   recheck-gdn, recheck-mamba2  GPU checks, B = 1 / 128 / 256, verify at B = 512 ~330 s each
#   rows     the read tile as row chunks (session 7): GDN (checks first) and Mamba-2 at B = 1
#            and 256, main L, three pairs, verify T = 4 at B = 512                ~520 s
#   revert-nt  flush-nt and B = 256 both kinds again, on the block read tile      ~300 s
#   final    B = 256 both kinds with run 27's defaults (row blocks per flush program) ~250 s
#   side     the flush kernel on a side stream: NT sweep on / off, B = 256 with checks ~260 s
#   confirm  session 7's final defaults, B = 256, short (the last of that session's budget) ~120 s
#   flush-nt evals/flush_nt_stagger.py: in-phase and staggered 'dots' windows by the row
#            blocks per flush program (NT), both kinds, B = 256                  ~200 s
#   gap      evals/batch1_gap.py: the conventional kernel on fresh stores, on replay anchors and
#            through the replay path, B = 1 and 8, both kinds (session 8)       ~120 s
#   grid-gdn, grid-mamba2, grid-spec   issue 4's grid at one commit in three calls (session
#            8, runs 31-33), no sweep (the default launch configs): GDN with the GPU checks and
#            peers, Mamba-2 with its peer, the speculative rounds of both (budgets 545 / 440 /
#            430 s: they took 577 / 442 / 482 s and left the lowest-priority sections unrun, as
#            listed in the JSON; session 9, runs 35-37: 554 / 407 / 423 s, Mamba-2 run by hand
#            with --budget-s 400 to fit the device time left); then, here:
#            replayquant bench merge kernels_part_{gdn,mamba2,spec}.json
#   read-blocks  evals/read_blocks_sweep.py: read programs of several row blocks and the
#            packed-word NVFP4 / FP8 decode (session 9), GPU checks first, B = 256  ~120 s
#   verify-read  evals/read_blocks_sweep.py --verify-batches 32,512: the speculative rounds
#            (T = 4) by verify read config, read_blocks included (session 9's FP8 verify at
#            B = 32 regressed 29%; not run yet, estimated ~400 s)
#   spec-t4, spec-t2  the speculative rounds of both kinds (B = 32 / 256 / 512, every pair) at
#            T = 4 / T = 2 with session 10's verify read configs (VERIFY_BLOCK), one call each
#            (session 10, run 39-42 with grid-gdn and grid-mamba2 at 9d8b19a: 56 / 36 / 147 /
#            104 s, nothing skipped, since the stores of the SR pair are built on the GPU);
#            then: replayquant bench merge kernels_part_{gdn,mamba2}.json kernels_spec_t{4,2}.json
#            (session 11, runs 51-52 at 7e04f39: grid-gdn + spec-t4 in one call 363 s, grid-mamba2
#            + spec-t2 211 s)
#   philox4  the stochastic-rounding pair (tp4_hi16_sr) with one Philox per four elements
#            (session 10): GPU checks, B = 256 windows / flush steps and verify at B = 512, both
#            kinds, against the same rows of the grid (9d8b19a); then bench formats (its GPU
#            bits against the CPU reference, SR casts timed)                    ~200 s
#   flush-heads  evals/flush_heads_sweep.py: value heads per whole-matrix flush program (NH
#            1, 2, 4, 8), NVFP4 pairs, both kinds, B = 256, GPU check first      ~150 s
#   confirm-s10  what session 10 left untimed at its last commit: the SR pair (tp4_hi16_sr) at
#            every batch, both kinds, no sweep (NH = 1 below 8192 matrices, the new Philox
#            bits), with the GPU checks; the FP8 SR cast on its grouped bits   ~150 s
#   ncu      Nsight Compute (counters, stall reasons) on one launch of each decode kernel:
#            evals/ncu_decode_drive.py, B = 256 steps and the T = 4 verify at 512 (session 11;
#            NCU_ONLY=verify: the verify cases only)
#   row-width  evals/row_width_sweep.py: the FP32 read tile as [d_k / RW, rows, RW] (RW 128 =
#            the old layout, 32, 16), s32_rs, both kinds: read step and windows at B = 256, the
#            T = 4 round at B = 512, GPU checks first (session 11)             ~250 s
#   verify-rw  evals/read_blocks_sweep.py --verify-batches 512, s32_rs, seven verify read configs
#            with READ_ROW_WIDTH's verify tile (RW 32, session 11)             ~100 s
#   flush-list  evals/decode_ab.py: the flush kernel over a list of the rows that flush
#            (FLUSH_LIST, session 12) against a program per matrix: GPU check, B = 256 read /
#            flush steps and windows, T = 4 rounds at 512, every pair, both kinds  ~300 s
#   preload  evals/decode_ab.py: a verify's draft inputs loaded before its draft loop
#            (VERIFY_PRELOAD, session 12, run 57) against without, s32_rs / tp8_hi32 / tp4_hi32,
#            with the B = 256 steps (unchanged by it: a repeat), GPU checks first   ~150 s
#   small-nt evals/decode_ab.py at B = 8 and 32 (block read, verify rounds at the same batch):
#            one flush block per program below 128 rows against every block of the matrix
#            ('nt-all'), s32_rs / tp8_hi32 (session 13, run 73)              ~40 s
#   kernels-small  bench kernels at B = 1 / 8 / 32, L 16 and 8, T = 4 at 32, no peers (run 74) ~150 s
#   gdn-small  bench kernels, GDN at B = 1 / 8 / 32 / 128, L = 16, no verify, no peers: the rows that
#            session 14's FUSED_THRESHOLD and FLUSH_DEVICE_BLOCKS changed after its grid
#   grid     the grid in one call, GPU checks, peers and sweep included (session 10, run 45
#            at c9c64fd: 554 s, its 540 s budget skipped Mamba-2 L = 32 and the T = 2 rounds;
#            the refitted estimate says ~520 s of sections for the whole grid: use two calls
#            (grid-gdn, grid-mamba2 + spec-t4 / spec-t2) when every section is wanted)
#   followup generate, tiny-mamba2 16K demo, tf32x3 whole model + KL, GDN flush folds ~520 s
#            (the generate check alone took over 150 s; at most 8 files come back from $OUT)
#
# Carry .gpu (fla-core and einops wheels, mamba_ssm's selective_state_update files, the tiny
# corpus); pass REPLAYQUANT_GIT_COMMIT=$(git rev-parse HEAD) (the device copy has no .git).
# The image has torch, triton, transformers, accelerate, rich, typer, matplotlib; not fla.
set -uo pipefail
: "${OUT:?set OUT to the folder where results go}"
job=${1:?usage: bash evals/gpu_runs.sh tf|mamba|decode|read|dots|defaults|batch1|targets|recheck-gdn|recheck-mamba2|rows|revert-nt|final|side|confirm|flush-nt|gap|grid-gdn|grid-mamba2|grid-spec|read-blocks|verify-read|spec-t4|spec-t2|philox4|flush-heads|confirm-s10|ncu|flush-list|preload|small-nt|kernels-small|gdn-small|row-width|verify-rw|grid|generate|followup}
export PYTHONUNBUFFERED=1 REPLAYQUANT_GIT_COMMIT=${REPLAYQUANT_GIT_COMMIT:-unknown}
python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/site .gpu/wheels/*.whl \
    || { echo "gpu_runs: could not install the carried wheels in .gpu/wheels" >&2; exit 1; }
export PYTHONPATH=$PWD:/tmp/site:$PWD/.gpu
python3 -c "import fla, einops; print('fla', fla.__version__)" \
    || { echo "gpu_runs: fla does not import; HF would fall back to its slow torch path" >&2; exit 1; }
rq=(python3 -m replayquant.cli)      # an array: `timeout` cannot run a shell function
b256() {  # NAME SECONDS [bench options]: both kinds, B = 256, main L, three pairs, verify at 512
  local name=$1 secs=$2 kind L; shift 2
  for kind in gdn mamba2; do
    L=16; [ "$kind" = mamba2 ] && L=8
    timeout "$secs" "${rq[@]}" bench kernels --out "$OUT" --name "kernels_${kind}_$name" \
        --kinds $kind --batches 256 --L $L --pairs s32_rs,tp8_hi32,tp4_hi32 --T 4 \
        --spec-batches 512 --no-sweep --no-peers --budget-s $((secs - 10)) "$@" \
        > "/tmp/${name}_${kind}.log" 2>&1; echo "$kind rc=$?"   # (at most 8 files come back)
  done
}
case "$job" in
  tf)
    timeout 260 python3 -m replayquant.bench.teacher_forcing "$OUT/teacher_forcing.json" --lengths 8192 \
        > "$OUT/layer.log" 2>&1; echo "layer rc=$?"
    timeout 120 "${rq[@]}" bench teacher-forcing --part model --out "$OUT/teacher_forcing.json" \
        > "$OUT/model.log" 2>&1; echo "model rc=$?"
    timeout 180 "${rq[@]}" bench kl --context 131072 --pair f4_sr_rs --pair tp4_hi32 --out "$OUT/kl_128k.json" \
        > "$OUT/kl.log" 2>&1; echo "kl rc=$?"
    ;;
  mamba)
    # writes at most 8 files into $OUT (model folder, log, demo results); then, here:
    # python evals/train_tiny.py install --from <that folder>
    timeout 240 python3 evals/train_tiny.py device-run --data .gpu/tiny --out "$OUT" \
        --models mamba --steps 400 --evaluate-also qwen \
        --train-stdout results/train_tiny/train_stdout_run2.txt \
        --source-commit "$REPLAYQUANT_GIT_COMMIT" --deadline 185 --reserve 60 \
        2>&1 | tee /tmp/train_stdout.txt; echo "train rc=${PIPESTATUS[0]}"
    ;;
  decode)
    # Mamba-2 at its main L (8) with verify T = 4 and the mamba_ssm peer (~310 s estimated),
    # then GDN's verify target and B = 512 (~85 s)
    "${rq[@]}" bench kernels --out "$OUT" --name kernels_mamba2 --kinds mamba2 --L 8 --T 4 --no-checks \
        --budget-s 330 > "$OUT/decode_mamba2.log" 2>&1; echo "mamba2 rc=$?"
    "${rq[@]}" bench kernels --out "$OUT" --name kernels_gdn_b512 --kinds gdn --batches 512 --L 16 --T 4 \
        --spec-batches 512 --no-checks --no-sweep --budget-s 100 \
        > "$OUT/decode_gdn.log" 2>&1; echo "gdn rc=$?"
    ;;
  read)
    "${rq[@]}" bench kernels --out "$OUT" --name kernels_gdn_b256_read --kinds gdn --batches 256 \
        --L 16 --T 4 --spec-batches "" --no-sweep --no-peers --budget-s 200 \
        > "$OUT/decode_read.log" 2>&1; echo "read rc=$?"
    ;;
  dots)
    # session 5: Mamba-2's 'dots' read variant (never timed; DOTS_MIN_ROWS has none for
    # Mamba-2) at B = 128 / 256 / 512 next to the block read, then GDN at batch 1 and 8 (the
    # batch-1 target; last timed in run 5) with the select-free decoders
    timeout 300 "${rq[@]}" bench kernels --out "$OUT" --name kernels_mamba2_dots --kinds mamba2 \
        --batches 128,256,512 --L 8 --T 4 --spec-batches "" --no-checks --no-sweep --no-peers \
        --budget-s 230 > "$OUT/dots_mamba2.log" 2>&1; echo "mamba2 rc=$?"
    timeout 230 "${rq[@]}" bench kernels --out "$OUT" --name kernels_gdn_small --kinds gdn \
        --batches 1,8 --L 16 --T 4 --spec-batches "" --no-checks --no-sweep --no-peers \
        --budget-s 150 > "$OUT/small_gdn.log" 2>&1; echo "gdn rc=$?"
    ;;
  defaults)
    # the 'dots' read's new defaults (16 rows on one warp; Mamba-2 from 128 rows) at B = 128 and
    # 512 next to the block read, both kinds at their main L
    timeout 260 "${rq[@]}" bench kernels --out "$OUT" --name kernels_mamba2_dots_default \
        --kinds mamba2 --batches 128,512 --L 8 --T 4 --spec-batches "" --no-checks --no-sweep \
        --no-peers --budget-s 200 > "$OUT/defaults_mamba2.log" 2>&1; echo "mamba2 rc=$?"
    timeout 220 "${rq[@]}" bench kernels --out "$OUT" --name kernels_gdn_dots_default \
        --kinds gdn --batches 128,512 --L 16 --T 4 --spec-batches "" --no-checks --no-sweep \
        --no-peers --budget-s 160 > "$OUT/defaults_gdn.log" 2>&1; echo "gdn rc=$?"
    ;;
  batch1)
    # the batch-1 target after the forced flush's early anchor load (session 5, untimed): GDN
    # and Mamba-2 at B = 1 and 8, main L, every pair (one-launch rows, forced flush per layer)
    timeout 260 "${rq[@]}" bench kernels --out "$OUT" --name kernels_batch1 --kinds gdn,mamba2 \
        --batches 1,8 --L 16,8 --T 4 --spec-batches "" --no-checks --no-sweep --no-peers \
        --budget-s 200 > "$OUT/batch1.log" 2>&1; echo "batch1 rc=$?"
    ;;
  targets)
    # session 6: the targets at HEAD in one file per kind (B = 1 and 256, main L, every pair,
    # read steps and byte ceilings), after the small-batch blocks (small_block); the verify
    # target (B = 512) is left to the decode job: its kernels did not change
    timeout 280 "${rq[@]}" bench kernels --out "$OUT" --name kernels_gdn_targets --kinds gdn \
        --batches 1,256 --L 16 --T 4 --spec-batches "" --no-checks --no-sweep --no-peers \
        --budget-s 220 > "$OUT/targets_gdn.log" 2>&1; echo "gdn rc=$?"
    timeout 230 "${rq[@]}" bench kernels --out "$OUT" --name kernels_mamba2_targets --kinds mamba2 \
        --batches 1,256 --L 8 --T 4 --spec-batches "" --no-checks --no-sweep --no-peers \
        --budget-s 170 > "$OUT/targets_mamba2.log" 2>&1; echo "mamba2 rc=$?"
    ;;
  recheck-gdn|recheck-mamba2)
    # what session 6 left untimed (one call per kind, ~330 s each): GPU checks of the flush
    # kernel's NT row blocks per program (CPU-tested only), the verify target (B = 512, T = 4;
    # the verify flush kernel now takes NT blocks too), B = 128 (the GDN dispatch threshold
    # against the faster forced flush), batch 1 (the conventional kernel on empty buffers:
    # 'replay-forced-auto'; Mamba-2's masked gate load) and the staggered 'dots' windows (rows
    # out of phase, as in serving)
    kind=${job#recheck-}; L=16; [ "$kind" = mamba2 ] && L=8
    timeout 560 "${rq[@]}" bench kernels --out "$OUT" --name "kernels_${kind}_recheck" \
        --kinds "$kind" --batches 1,128,256 --L $L --T 4 --spec-batches 512 --no-sweep \
        --no-peers --budget-s 400 > "$OUT/recheck_${kind}.log" 2>&1; echo "$kind rc=$?"
    ;;
  rows)
    timeout 320 "${rq[@]}" bench kernels --out "$OUT" --name kernels_gdn_rows --kinds gdn \
        --batches 1,256 --L 16 --pairs s32_rs,tp8_hi32,tp4_hi32 --T 4 --spec-batches 512 \
        --no-sweep --no-peers --budget-s 300 > "$OUT/rows_gdn.log" 2>&1; echo "gdn rc=$?"
    timeout 250 "${rq[@]}" bench kernels --out "$OUT" --name kernels_mamba2_rows --kinds mamba2 \
        --batches 1,256 --L 8 --pairs s32_rs,tp8_hi32,tp4_hi32 --T 4 --spec-batches 512 \
        --no-sweep --no-peers --no-checks --budget-s 240 > "$OUT/rows_mamba2.log" 2>&1
    echo "mamba2 rc=$?"
    ;;
  revert-nt)
    # after the row-chunk read tile was measured slower and reverted: flush-nt and the B = 256
    # rows again on the block tile
    timeout 200 python3 evals/flush_nt_stagger.py "$OUT/flush_nt_stagger_block_tile.json" \
        > "$OUT/flush_nt_block_tile.log" 2>&1; echo "flush-nt rc=$?"
    b256 block_tile 180 --no-checks
    tail -45 "$OUT/flush_nt_block_tile.log"
    ;;
  final)
    # run 27's defaults (row blocks per flush program) at B = 256, both kinds, checks on GDN
    b256 final 260          # (run 27 ran GDN with the checks, Mamba-2 without)
    ;;
  side)
    # the flush kernel on a side stream (FLUSH_SIDE_STREAM): NT sweep with and without it, then
    # B = 256 both kinds with GPU checks (the checks' replay steps run the side stream)
    timeout 200 python3 evals/flush_nt_stagger.py "$OUT/flush_nt_side.json" \
        > "$OUT/flush_nt_side.log" 2>&1; echo "flush-nt rc=$?"
    b256 side 200
    tail -60 "$OUT/flush_nt_side.log"
    ;;
  confirm)
    # the final defaults of session 7 through the bench's own rows: GDN B = 256 windows (no
    # verify: its code is run 26's), Mamba-2 tp8_hi32 with verify (its new 16-row flush block)
    timeout 80 "${rq[@]}" bench kernels --out "$OUT" --name kernels_gdn_confirm --kinds gdn \
        --batches 256 --L 16 --pairs s32_rs,tp8_hi32 --spec-batches "" --no-sweep --no-checks \
        --budget-s 75 > /dev/null 2>&1; echo "gdn rc=$?"
    timeout 80 "${rq[@]}" bench kernels --out "$OUT" --name kernels_mamba2_confirm --kinds mamba2 \
        --batches 256 --L 8 --pairs tp8_hi32 --T 4 --spec-batches 512 --no-sweep --no-checks \
        --budget-s 75 > /dev/null 2>&1; echo "mamba2 rc=$?"
    ;;
  grid-gdn|grid-mamba2|grid-spec)
    part=${job#grid-}
    case "$part" in
      gdn) opts=(--kinds gdn --spec-batches= --budget-s 545) ;;
      mamba2) opts=(--kinds mamba2 --spec-batches= --no-checks --budget-s 440) ;;
      spec) opts=(--batches= --no-checks --no-peers --budget-s 430) ;;
    esac
    timeout 585 "${rq[@]}" bench kernels --out "$OUT" --name "kernels_part_$part" --no-sweep \
        "${opts[@]}" > "/tmp/grid_$part.log" 2>&1; echo "grid $part rc=$?"
    grep -E "^\[bench|^copy|Not measured|failed" "/tmp/grid_$part.log" | cut -c1-2000
    ;;
  gap)
    timeout 300 python3 evals/batch1_gap.py "$OUT/batch1_gap.json" --batches 1,8 --repeats 3 \
        2>&1 | tee /tmp/gap.log; echo "gap rc=${PIPESTATUS[0]}"
    ;;
  spec-t4|spec-t2)
    T=${job#spec-t}
    timeout 585 "${rq[@]}" bench kernels --out "$OUT" --name "kernels_spec_t$T" --batches= --T "$T" \
        --no-checks --no-peers --no-sweep --budget-s 560 > "/tmp/spec_t$T.log" 2>&1; echo "spec T=$T rc=$?"
    grep -E "^\[bench|^copy|Not measured|failed" "/tmp/spec_t$T.log" | cut -c1-2000
    ;;
  philox4)
    timeout 500 "${rq[@]}" bench kernels --out "$OUT" --name kernels_sr_philox4 --batches 256 \
        --pairs tp4_hi16_sr --T 4 --spec-batches 512 --no-peers --no-sweep --budget-s 480 \
        > /tmp/philox4.log 2>&1; echo "philox4 rc=$?"
    grep -E "^\[bench|^copy|Not measured|failed|flush-step|read-step|round " /tmp/philox4.log | cut -c1-300
    cp /tmp/philox4.log "$OUT/"
    timeout 150 "${rq[@]}" bench formats --out "$OUT/formats" > /tmp/formats.log 2>&1; echo "formats rc=$?"
    tail -30 /tmp/formats.log
    ;;
  flush-heads)
    timeout 500 python3 evals/flush_heads_sweep.py "$OUT/flush_heads.json" > "$OUT/flush_heads.log" 2>&1
    echo "flush-heads rc=$?"; tail -45 "$OUT/flush_heads.log"
    ;;
  confirm-s10)
    timeout 400 "${rq[@]}" bench kernels --out "$OUT" --name kernels_sr_confirm --pairs tp4_hi16_sr \
        --no-sweep --no-peers --budget-s 380 > /tmp/confirm.log 2>&1; echo "confirm rc=$?"
    grep -E "^\[bench|^copy|Not measured|failed" /tmp/confirm.log | cut -c1-2000; cp /tmp/confirm.log "$OUT/"
    timeout 150 "${rq[@]}" bench formats --format fp8 --out "$OUT/formats" > /tmp/formats.log 2>&1
    echo "formats rc=$?"; tail -8 /tmp/formats.log
    ;;
  flush-list)
    timeout 560 python3 evals/decode_ab.py "$OUT/flush_list.json" > "$OUT/flush_list.log" 2>&1
    echo "flush-list rc=$?"; grep -v "^  " "$OUT/flush_list.log" | tail -60
    ;;
  small-nt)
    for B in 8 32; do
      timeout 200 python3 evals/decode_ab.py "$OUT/nt_b$B.json" --batch "$B" --read-variant block \
          --modes default,nt-all --verify-modes default,nt-all --verify-batch "$B" \
          --pairs s32_rs,tp8_hi32 > "$OUT/nt_b$B.log" 2>&1
      echo "small-nt B=$B rc=$?"; grep -v "^  " "$OUT/nt_b$B.log" | grep -v "^|" | tail -30
    done
    ;;
  kernels-small)
    timeout 280 "${rq[@]}" bench kernels --out "$OUT" --name kernels_small --batches 1,8,32 \
        --L 16,8 --T 4 --spec-batches 32 --no-peers --no-sweep --no-checks --budget-s 220 \
        > "$OUT/small.log" 2>&1; echo "kernels-small rc=$?"; tail -5 "$OUT/small.log"
    ;;
  gdn-small)
    timeout 280 "${rq[@]}" bench kernels --out "$OUT" --name kernels_gdn_small --kinds gdn \
        --batches 1,8,32,128 --L 16 --spec-batches= --no-peers --no-sweep --no-checks \
        --budget-s 250 > "$OUT/gdn_small.log" 2>&1; echo "gdn-small rc=$?"; tail -5 "$OUT/gdn_small.log"
    ;;
  preload)
    timeout 500 python3 evals/decode_ab.py "$OUT/preload.json" --modes default,no-preload \
        --verify-modes default,no-preload --pairs s32_rs,tp8_hi32,tp4_hi32 > "$OUT/preload.log" 2>&1
    echo "preload rc=$?"; grep -v "^  " "$OUT/preload.log" | tail -60
    ;;
  ncu)
    # Nsight Compute on one launch of each case of evals/ncu_decode_drive.py (session 11):
    # throughput, occupancy, launch stats, warp stall reasons, instruction mix
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    echo "ncu: $NCU"; "$NCU" --version | tail -1
    timeout 420 "$NCU" --profile-from-start off --clock-control none --target-processes all \
        --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
        --section InstructionStats --print-details all \
        python3 evals/ncu_decode_drive.py ${NCU_ONLY:+--only "$NCU_ONLY"} > "$OUT/ncu_decode.txt" 2>&1
    echo "ncu rc=$?"
    grep -E "^== case|^  [_a-z].*\(|Duration|Memory Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|No Eligible|DRAM Throughput" \
        "$OUT/ncu_decode.txt" | cut -c1-160 | head -250
    ;;
  row-width)
    # evals/row_width_sweep.py: the FP32 read tile's row width (session 11), GPU checks first
    timeout 560 python3 evals/row_width_sweep.py "$OUT/row_width.json" --widths 128,32,16 \
        > "$OUT/row_width.log" 2>&1; echo "row-width rc=$?"
    tail -45 "$OUT/row_width.log"
    ;;
  verify-rw)
    # the T = 4 verify read configs again with the row width 32 tile (session 11), s32_rs, B = 512
    timeout 560 python3 evals/read_blocks_sweep.py "$OUT/verify_read_rw32.json" --verify-batches 512 \
        --pairs s32_rs --verify-configs 16x1x1,16x1x2,16x2x1,32x1x1,32x1x2,32x2x1,64x2x1 \
        > "$OUT/verify_read_rw32.log" 2>&1; echo "verify-rw rc=$?"
    tail -40 "$OUT/verify_read_rw32.log"
    ;;
  grid)
    timeout 585 "${rq[@]}" bench kernels --out "$OUT" --name kernels --budget-s 540 \
        > "/tmp/grid.log" 2>&1; echo "grid rc=$?"
    grep -E "^\[bench|^copy|Not measured|failed" /tmp/grid.log | cut -c1-2000; cp /tmp/grid.log "$OUT/"
    ;;
  verify-read)
    timeout 560 python3 evals/read_blocks_sweep.py "$OUT/verify_read.json" --verify-batches 32,512 \
        --pairs s32_rs,tp8_hi32,tp4_hi32 > "$OUT/verify_read.log" 2>&1; echo "verify-read rc=$?"
    tail -70 "$OUT/verify_read.log"
    ;;
  read-blocks)
    timeout 540 python3 evals/read_blocks_sweep.py "$OUT/read_blocks_b256.json" \
        > "$OUT/read_blocks_b256.log" 2>&1; echo "read-blocks rc=$?"; tail -60 "$OUT/read_blocks_b256.log"
    ;;
  flush-nt)
    timeout 400 python3 evals/flush_nt_stagger.py "$OUT/flush_nt_stagger.json" \
        > "$OUT/flush_nt_stagger.log" 2>&1; echo "flush-nt rc=$?"; tail -40 "$OUT/flush_nt_stagger.log"
    ;;
  generate)
    python3 evals/cuda_generate_check.py "$OUT/cuda_generate.json" --new-tokens 32; echo "rc=$?"
    ;;
  followup)
    # what session 3's first runs left: generate check, the retrained tiny-mamba2's 16K demo
    # (skipped by the mamba job's deadline), whole-model teacher forcing and KL with the chunk
    # kernel's tf32x3 dots, and GDN's flush-step rows with the chunked folds (B = 256)
    timeout 260 python3 evals/cuda_generate_check.py "$OUT/cuda_generate.json" --new-tokens 32 \
        > "$OUT/generate.log" 2>&1; echo "generate rc=$?"
    timeout 90 "${rq[@]}" kl --model tiny-mamba2 --pair s32_rs --pair sbf16 --pair f4_sr_rs \
        --pair tp4_hi32 --pair tp4_hi16_sr --dataset "$(python3 -m replayquant.data)" \
        --context 16384 --docs 3 --dtype float32 --device-map cuda --no-progress \
        --out /tmp/demo/tiny-mamba2_ctx16k_h200.json > "$OUT/demo.log" 2>&1; echo "demo rc=$?"
    tar cf "$OUT/demo.tar" -C /tmp/demo .      # one file: at most 8 come back from a call
    REPLAYQUANT_CHUNK_DOT=tf32x3 timeout 100 "${rq[@]}" bench teacher-forcing --part model \
        --out "$OUT/teacher_forcing_tf32x3.json" > "$OUT/model_tf32x3.log" 2>&1; echo "model rc=$?"
    REPLAYQUANT_CHUNK_DOT=tf32x3 timeout 130 "${rq[@]}" bench kl --context 131072 --pair f4_sr_rs \
        --pair tp4_hi32 --out "$OUT/kl_128k_tf32x3.json" > "$OUT/kl_tf32x3.log" 2>&1; echo "kl rc=$?"
    timeout 100 "${rq[@]}" bench kernels --out "$OUT" --name kernels_gdn_flushfold --kinds gdn \
        --batches 256 --L 16 --pairs s32_rs,tp8_hi32,tp4_hi32 --no-checks --no-sweep --no-peers \
        --spec-batches "" --budget-s 80 > "$OUT/decode_fold.log" 2>&1; echo "fold rc=$?"
    ;;
  *) echo "gpu_runs: unknown job $job (tf, mamba, decode, read, dots, defaults, batch1, targets, recheck-gdn, recheck-mamba2, rows, revert-nt, final, side, confirm, flush-nt, generate, followup)" >&2; exit 2 ;;
esac
