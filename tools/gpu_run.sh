#!/usr/bin/env bash
# run.sh of the GPU bundle (installed by tools/gpu_bundle.sh): runs on a GPU
# machine and prints one summary line last.
#
#   run.sh OUT_DIR [--sanitize] [--stages tests,python,programs,determinism,benchmarks,comm,step_table,profile,multigpu,multigpu_bench,multigpu_tp_bench,multigpu_pp_bench,multigpu_ep_bench,multigpu_sanitize]
#
# Every log and JSON is written into OUT_DIR/results/ as it is made; at the
# end that folder is packed into OUT_DIR/results.tar.gz and removed (the device
# tool brings back at most 8 files), leaving it and summary.txt:
#   summary.txt                  the summary line and the sanitizer totals
#   tests.log, pytest.log        GoogleTest binaries; the Python binding's tests
#   fuzz_table.txt               the fuzz test's cases and their outcomes
#   programs.log                 the trainer runs, the demo, the attention kernels against SDPA
#   determinism.log              every trainer configuration twice per mode and resumed, 1,000 steps, bit
#                                for bit, on a text file (tools/determinism_checks.sh); with 2 GPUs also
#                                DP=2, ZeRO-1, TP=2 on the window model (--heads 0) and TP=2 on the default
#                                GPT (about 1 minute each world)
#   benchmarks.log               every benchmark's output; *.json their results
#   comm.log                     comm_bench and comm_peer.py (collectives on this host's GPUs)
#   step_table.log               --stages step_table: the training-step table alone, in under 10 minutes
#                                (the step goals in one job): step_bench --profile, step_bench
#                                --step-scoped-gradients, PyTorch's eager and compiled systems (--quick),
#                                step_report.md and step_report_step_scoped.md
#   multigpu.log                 --stages multigpu (2 GPUs, about 5 minutes): the multi-rank NCCL tests,
#                                the trainer's checks (entropy floor, eager == graph, exact resume) on the
#                                default GPT at TP=2 (4 layers, hidden 512, 8 heads: about 20 s), on the
#                                window model at TP=2 (--heads 0), at DP=2 and in two pipeline stages
#                                (--pp 2, with and without --virtual-stages 2), 10,000 TP=2 steps of a short
#                                GPT (2 layers, hidden 128, 4 heads, 512 tokens a step: about 15 s) for
#                                the no-hang check, DP=2 losses against one GPU, a killed rank, restarts
#                                after a killed rank (DP=2, ZeRO-1); expert parallelism at EP=2 (--experts 8:
#                                the trainer's checks, the losses against one GPU, 10,000 steps of a short
#                                MoE GPT for the no-hang check)
#   multigpu_sanitize.log        --stages multigpu_sanitize: memcheck on the multi-rank tests and on the
#                                GPT's two TP ranks for 6 steps, graphed and eager
#   multigpu_bench.log           --stages multigpu_bench (2 GPUs, over 10 minutes: run its parts in
#                                separate device calls where a call is limited): tp_mlp_bench +
#                                tp_peer.py, comm_bench + comm_peer.py, step_bench --dp 2 +
#                                pytorch_peer.py --ddp, step_bench --cp 2 + cp_step_peer.py (long: 32k
#                                over 2 GPUs against 16k on one; step_report_cp2.md), and
#                                multigpu_tp_bench's runs, each JSON beside it
#   multigpu_tp_bench.log        --stages multigpu_tp_bench (2 GPUs, about 8 minutes; also part of
#                                multigpu_bench): the GPT medium and large at TP=2, step_bench --tp 2
#                                --profile (bulk and overlap, about 1.5 minutes each) + tp_step_peer.py
#                                (parallelize_module, compiled, async TP, captured whole: at most 5 minutes,
#                                --budget-s) and their report.py tables (step_report_tp2_*.md: step time
#                                against the fastest PyTorch TP row, exposed communication)
#   multigpu_pp_bench.log        --stages multigpu_pp_bench (2 GPUs, about 10 minutes): the GPT medium and
#                                large in two pipeline stages, step_bench --pp 2 --microbatches 8 (1F1B;
#                                step_bench_pp2.json) and large at --virtual-stages 2 (interleaved 1F1B;
#                                step_bench_pp2_v2.json): eager and graphed against each GPU training the
#                                whole model alone, the measured bubble against the schedule's; then
#                                pp_step_peer.py, torch.distributed.pipelining on the same rows
#                                (pp_step_peer.json, pp_step_peer_v2.json; at most 5 minutes each, --budget-s)
#   multigpu_ep_bench.log        --stages multigpu_ep_bench (2 GPUs, about 8 minutes): the moe config at EP=2,
#                                step_bench --ep 2 --profile (experts spread over the GPUs, eager and graphed,
#                                against each GPU training the whole config alone: efficiency, exposed
#                                communication; step_bench_ep2.json), ep_exchange_bench (the captured and eager
#                                exchange of the moe config's rows against NCCL's all-to-all with host counts,
#                                uniform and skewed routing, the transport that ran; ep_exchange_bench.json), and
#                                ep_step_peer.py, PyTorch's expert-parallel MoE step (all_to_all_single with host
#                                split sizes; ep_step_peer.json; at most 5 minutes, --budget-s), and their
#                                report.py table and goals (step_report_ep2.md)
#   profile.log                  --stages profile: step_bench --profile (each config's ops by summed
#                                time), ncu over one graphed step of small, large, moe; ncu_<config>.md their tables
#   sanitizer.log                with --sanitize: memcheck and racecheck
# Stages default to all of them but profile and the multigpu ones (2 GPUs or more).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: run.sh OUT_DIR [--sanitize] [--stages tests,python,programs,benchmarks,comm]}
shift
sanitize=no
stages=tests,python,programs,determinism,benchmarks,comm
while [ $# -gt 0 ]; do
  case "$1" in
    --sanitize) sanitize=yes ;;
    --stages) stages=${2:?--stages needs a list}; shift ;;
    *) echo "run.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
results="$out/results"
mkdir -p "$results"
work=$(mktemp -d)
export PYTHONPATH="$here/python${PYTHONPATH:+:$PYTHONPATH}"
export STEPGRAPH_LIBRARY="$here/python/stepgraph/libstepgraph_c.so"
export PYTHONUNBUFFERED=1
# NVLink multicast stays off in every process of every stage (DESIGN.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
wants() { case ",$stages," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$results/summary.txt"

# Runs a command, appending its output to a log; counts a failure.
failed_steps=0
step() {
  local log=$1
  shift
  echo "=== $*" >>"$results/$log"
  local start=$SECONDS
  "$@" >>"$results/$log" 2>&1
  local status=$?
  echo "=== exit $status ($((SECONDS - start)) s)" >>"$results/$log"
  if [ "$status" -ne 0 ]; then
    failed_steps=$((failed_steps + 1))
    echo "FAILED ($log): $*" | tee -a "$results/summary.txt"
  fi
  return "$status"
}

# 1. GoogleTest binaries, results as XML.
test_line="tests not run"
if wants tests; then
  : >"$results/tests.log"
  for binary in "$here"/tests/*; do
    name=$(basename "$binary")
    echo "=== $name" >>"$results/tests.log"
    "$binary" --gtest_output="xml:$work/$name.xml" >>"$results/tests.log" 2>&1
    echo "=== $name exit $?" >>"$results/tests.log"
  done
fi

# 2. The Python binding's tests (pytest), on this GPU and against torch.
if wants python; then
  : >"$results/pytest.log"
  (cd "$here/python_tests" && STEPGRAPH_README="$here/python_tests/README.md" \
    STEPGRAPH_TRAINER_REFERENCE="$here/bin/trainer_reference" \
    python3 -m pytest -q -rs -p no:cacheprovider --junitxml="$work/pytest.xml" .) >>"$results/pytest.log" 2>&1
  echo "=== pytest exit $?" >>"$results/pytest.log"
  # The fuzz test's table of cases and outcomes (a JUnit test-suite property).
  python3 - "$work/pytest.xml" >"$results/fuzz_table.txt" 2>&1 <<'PY'
import sys
import xml.etree.ElementTree as ET
tables = [p.get("value") for p in ET.parse(sys.argv[1]).iter("property") if p.get("name") == "fuzz_table"]
print("\n".join(tables) if tables else "no fuzz_table property in the pytest results")
PY
fi
if wants tests || wants python; then
  test_line=$(python3 "$here/count_test_results.py" --quiet-skips "$work"/*.xml | tee -a "$results/tests.log" | tail -n 1)
fi

# 3. Programs: the trainer's checks, the capture demo, attention against SDPA.
if wants programs; then
  : >"$results/programs.log"
  step programs.log "$here/trainer_checks.sh" "$here/bin/trainer" "$work/trainer"
  step programs.log "$here/bin/capture_demo" --device cuda --replays 10
  # The trainer's flag, data-file and checkpoint fuzz on cuda: every case a clear error or a correct run.
  step programs.log env TRAINER="$here/bin/trainer" TRAINER_FUZZ_DEVICE=cuda python3 "$here/trainer_fuzz_test.py"
  # The attention kernels against PyTorch SDPA on random packings.
  step programs.log python3 "$here/benchmarks/attention_sdpa_check.py" --binary "$here/bin/attention_sdpa_dump" --cases 24
fi

# 3b. Reproducibility: every configuration's runs equal bit for bit, fresh and
# resumed, on a text file (the bundle's own sources: real token statistics).
cat "$here"/python/stepgraph/*.py "$here"/python_tests/*.py "$here"/benchmarks/*.py "$here"/*.sh "$here"/*.py \
  "$here"/python_tests/*.md >"$work/corpus.txt"
if wants determinism; then
  : >"$results/determinism.log"
  echo "corpus: $(wc -c <"$work/corpus.txt") bytes of the bundle's sources" >>"$results/determinism.log"
  step determinism.log "$here/determinism_checks.sh" "$here/bin/trainer" "$work/determinism" "$work/corpus.txt" --steps 1000
  # And at 2 ranks where the machine has 2 GPUs (DP=2, ZeRO-1, TP=2 on the window model and on the GPT).
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    for world in "--dp 2" "--dp 2 --dp-mode zero1" "--tp 2 --heads 0" "--tp 2"; do
      # shellcheck disable=SC2086
      step determinism.log "$here/determinism_checks.sh" "$here/bin/trainer" "$work/determinism_${world// /_}" \
        "$work/corpus.txt" --steps 1000 --only default -- --nproc-per-node 2 $world
    done
  fi
fi

# 4. Benchmarks, each writing JSON beside its log.
if wants benchmarks; then
  : >"$results/benchmarks.log"
  step benchmarks.log "$here/bin/launch_overhead" --out "$results/launch_overhead.json"
  step benchmarks.log "$here/bin/gemm_bench" --out "$results/gemm_bench.json"
  step benchmarks.log "$here/bin/memory_bound_bench" --out "$results/memory_bound.json"
  step benchmarks.log "$here/bin/grouped_gemm_bench" --out "$results/grouped_gemm.json"
  step benchmarks.log python3 "$here/benchmarks/grouped_gemm_peer.py" --out "$results/grouped_gemm_peer.json"
  step benchmarks.log "$here/bin/attention_bench" --out "$results/attention.json"
  step benchmarks.log python3 "$here/benchmarks/attention_peer.py" --out "$results/attention_peer.json"
  step benchmarks.log "$here/bin/moe_layer_bench" --out "$results/moe_layer.json"
  step benchmarks.log "$here/bin/pipeline_bench" --out "$results/pipeline_large.json"
  step benchmarks.log "$here/bin/pipeline_bench" --hidden 256 --tokens 256 --out "$results/pipeline_small.json"
  step benchmarks.log "$here/bin/step_bench" --out "$results/step_bench.json"
  step benchmarks.log python3 "$here/benchmarks/pytorch_peer.py" --out "$results/pytorch_peer.json"
  step benchmarks.log python3 "$here/benchmarks/report.py" "$results/step_bench.json" "$results/pytorch_peer.json" \
    --markdown "$results/step_report.md" --plot "$results/step_report.png"
fi

# 4b. The training-step table alone (not in the default stages: benchmarks has it whole).
if wants step_table; then
  : >"$results/step_table.log"
  step step_table.log "$here/bin/step_bench" --profile --out "$results/step_bench.json"
  step step_table.log "$here/bin/step_bench" --step-scoped-gradients --out "$results/step_bench_step_scoped.json"
  step step_table.log python3 "$here/benchmarks/pytorch_peer.py" --quick --systems eager,compile_graph,compile \
    --budget-s 300 --out "$results/pytorch_peer.json"
  step step_table.log python3 "$here/benchmarks/report.py" "$results/step_bench.json" "$results/pytorch_peer.json" \
    --markdown "$results/step_report.md" --plot "$results/step_report.png"
  step step_table.log python3 "$here/benchmarks/report.py" "$results/step_bench_step_scoped.json" \
    "$results/pytorch_peer.json" --markdown "$results/step_report_step_scoped.md"
fi

# 5. Collectives: comm_bench and its torch.distributed peer, one process
# (world size 1: NCCL's collectives are local copies; both say so), 1-256 MiB.
if wants comm; then
  : >"$results/comm.log"
  step comm.log "$here/bin/comm_bench" --max-bytes 256M --out "$results/comm_bench.json"
  step comm.log python3 "$here/benchmarks/comm_peer.py" --max-bytes 256M --out "$results/comm_peer.json"
fi

# 6. Several GPUs: 2 ranks, one per GPU, through NCCL (NVLink multicast off in
# every process: the variables are exported above and the programs set them too).
# Whether this machine has 2 GPUs; otherwise says so in LOG and counts a failed step.
two_gpus() {
  local log=$1 gpus
  gpus=$(nvidia-smi -L | wc -l)
  [ "$gpus" -ge 2 ] && return 0
  echo "${log%.log}: needs 2 GPUs, this machine has $gpus" | tee -a "$results/$log" "$results/summary.txt"
  failed_steps=$((failed_steps + 1))
  return 1
}
# torchrun starts our binaries with --no-python, the peers with python3.
python_run=(python3 -m torch.distributed.run --standalone --nproc-per-node 2)
binary_run=("${python_run[@]}" --no-python)
if wants multigpu; then
  : >"$results/multigpu.log"
  if two_gpus multigpu.log; then
    echo "NCCL loaded by the bundle: $(ldd "$here/bin/trainer" | grep -o 'libnccl[^ ]* => [^ ]*')" >>"$results/multigpu.log"
    # Collectives, DP and ZeRO-1, TP in every overlap mode against one GPU, eager == graph, a mismatched capture.
    for binary in "$here"/multirank/*; do
      step multigpu.log "${binary_run[@]}" "$binary"
    done
    # The trainer's checks on the default GPT (attention and MLP tensor- and sequence-parallel), on the window
    # model (MLP blocks alone) and data parallel.
    step multigpu.log "$here/trainer_checks.sh" "$here/bin/trainer" "$work/gpt_tp2" --nproc-per-node 2 --tp 2 --overlap overlap
    step multigpu.log "$here/trainer_checks.sh" "$here/bin/trainer" "$work/tp2" --nproc-per-node 2 --tp 2 --heads 0 --overlap overlap
    step multigpu.log "$here/trainer_checks.sh" "$here/bin/trainer" "$work/dp2" --nproc-per-node 2 --dp 2
    # The GPT in two pipeline stages (1F1B, then interleaved chunks).
    step multigpu.log "$here/trainer_checks.sh" "$here/bin/trainer" "$work/pp2" --nproc-per-node 2 --pp 2
    step multigpu.log "$here/trainer_checks.sh" "$here/bin/trainer" "$work/pp2v2" --nproc-per-node 2 --pp 2 \
      --virtual-stages 2 --layers 4
    # No hang: 10,000 TP=2 steps of a short GPT (its collectives every step, attention's included).
    step multigpu.log "$here/bin/trainer" --nproc-per-node 2 --tp 2 --overlap overlap --layers 2 --hidden 128 --heads 4 \
      --ffn 256 --seq-len 64 --batch 8 --steps 10000 --log-every 1000
    # DP=2 against one GPU on the same global batch (fp32; the log prints 4 decimals).
    "$here/bin/trainer" --dtype fp32 --steps 50 --log-every 1 >"$work/dp1_fp32.log" 2>&1
    "$here/bin/trainer" --nproc-per-node 2 --dp 2 --dtype fp32 --steps 50 --log-every 1 >"$work/dp2_fp32.log" 2>&1
    step multigpu.log python3 "$here/compare_losses.py" "$work/dp1_fp32.log" "$work/dp2_fp32.log" --rtol 2e-4
    step multigpu.log "$here/killed_rank_check.sh" "$here/bin/trainer" "$work/killed"
    # Elastic restarts: a killed rank restarted, the run equal to an uninterrupted one (DP=2 and ZeRO-1's parts).
    step multigpu.log "$here/restart_check.sh" "$here/bin/trainer" "$work/restart_dp2" --dp 2
    step multigpu.log "$here/restart_check.sh" "$here/bin/trainer" "$work/restart_zero1" --dp 2 --dp-mode zero1
    # Expert parallelism: the default GPT's 2 MoE blocks with 8 experts, 4 on each rank, their tokens exchanged
    # inside the captured step; its losses against one GPU on the same global batch (fp32); no hang over
    # 10,000 steps of a short MoE GPT (2 layers, hidden 128, 4 heads, 512 tokens a step).
    step multigpu.log "$here/trainer_checks.sh" "$here/bin/trainer" "$work/ep2" --nproc-per-node 2 --ep 2 --experts 8
    "$here/bin/trainer" --experts 8 --dtype fp32 --steps 50 --log-every 1 >"$work/ep1_fp32.log" 2>&1
    "$here/bin/trainer" --nproc-per-node 2 --ep 2 --experts 8 --dtype fp32 --steps 50 --log-every 1 \
      >"$work/ep2_fp32.log" 2>&1
    step multigpu.log python3 "$here/compare_losses.py" "$work/ep1_fp32.log" "$work/ep2_fp32.log" --rtol 2e-4
    step multigpu.log "$here/bin/trainer" --nproc-per-node 2 --ep 2 --experts 8 --layers 2 --hidden 128 --heads 4 \
      --ffn 256 --seq-len 64 --batch 8 --steps 10000 --log-every 1000
  fi
fi
# Where a step's time goes: every op of one replay by stream, then Nsight Compute over every kernel of one
# replayed graphed step of each config (step_bench --cuda-profiler-range marks that replay).
if wants profile; then
  : >"$results/profile.log"
  step profile.log "$here/bin/step_bench" --profile --steps 20 --warmup 5 --out "$results/step_bench_profile.json"
  for config in small large moe; do
    step profile.log ncu --csv --page details --section SpeedOfLight --section Occupancy --section LaunchStats \
      --profile-from-start off --log-file "$work/ncu_$config.csv" \
      "$here/bin/step_bench" --configs "$config" --steps 2 --warmup 2 --cuda-profiler-range
    python3 "$here/ncu_summary.py" "$work/ncu_$config.csv" --top 25 \
      --title "ncu over one replayed graphed step of $config (step_bench --configs $config --cuda-profiler-range)" \
      >"$results/ncu_$config.md" 2>>"$results/profile.log" || echo "ncu_summary of $config failed" >>"$results/profile.log"
  done
fi
# compute-sanitizer memcheck on the multi-rank tests: each rank under its own sanitizer.
if wants multigpu_sanitize; then
  : >"$results/multigpu_sanitize.log"
  if two_gpus multigpu_sanitize.log; then
    # 20 replays of the peer-copy test, not 10,000: the sanitizer instruments every kernel of every replay.
    for binary in "$here"/multirank/*; do
      step multigpu_sanitize.log env STEPGRAPH_PEER_REPLAYS=20 "${binary_run[@]}" compute-sanitizer --tool memcheck \
        --report-api-errors no --error-exitcode 99 "$binary"
    done
    # The GPT's TP ranks (attention's collectives, split kv heads) and CP ranks (gathered K/V, segment
    # attention on the tensor cores) for a few steps, graphed and eager.
    for world in "--tp 2" "--cp 2"; do
      for mode in graph eager; do
        # shellcheck disable=SC2086  # $world is two words on purpose
        step multigpu_sanitize.log "${binary_run[@]}" compute-sanitizer --tool memcheck --report-api-errors no \
          --error-exitcode 99 "$here/bin/trainer" $world --kv-heads 2 --steps 6 --log-every 1 --mode "$mode"
      done
    done
    grep -E "ERROR SUMMARY" "$results/multigpu_sanitize.log" | sort | uniq -c >>"$results/summary.txt"
  fi
fi
# The GPT medium and large at TP=2: our step (each overlap mode, profiled for the exposed communication) and
# PyTorch's (parallelize_module: eager, compiled, async TP, captured whole), then each mode's TP table against it.
tp_step_bench() {
  local log=$1 overlap
  for overlap in bulk overlap; do
    step "$log" "${binary_run[@]}" "$here/bin/step_bench" --tp 2 --overlap "$overlap" --configs medium,large --profile \
      --out "$results/step_bench_tp2_$overlap.json"
  done
  # --budget-s: no row starts after 5 minutes; the timeout in case a symmetric-memory wait never returns.
  step "$log" timeout 480 "${python_run[@]}" "$here/benchmarks/tp_step_peer.py" --configs medium,large --budget-s 300 \
    --out "$results/tp_step_peer.json"
  for overlap in bulk overlap; do
    step "$log" python3 "$here/benchmarks/report.py" "$results/step_bench_tp2_$overlap.json" \
      "$results/tp_step_peer.json" --markdown "$results/step_report_tp2_$overlap.md"
  done
}
if wants multigpu_bench; then
  : >"$results/multigpu_bench.log"
  if two_gpus multigpu_bench.log; then
    step multigpu_bench.log "${binary_run[@]}" "$here/bin/tp_mlp_bench" --config large --profile --out "$results/tp_mlp.json"
    step multigpu_bench.log "${python_run[@]}" "$here/benchmarks/tp_peer.py" --config large --out "$results/tp_peer.json"
    step multigpu_bench.log "${binary_run[@]}" "$here/bin/comm_bench" --max-bytes 256M --out "$results/comm_bench_2gpu.json"
    step multigpu_bench.log "${python_run[@]}" "$here/benchmarks/comm_peer.py" --max-bytes 256M --out "$results/comm_peer_2gpu.json"
    step multigpu_bench.log "${binary_run[@]}" "$here/bin/step_bench" --dp 2 --configs medium,large --out "$results/step_bench_dp2.json"
    step multigpu_bench.log "${binary_run[@]}" "$here/bin/step_bench" --cp 2 --configs long --profile --out "$results/step_bench_cp2.json"
    # PyTorch's context parallelism on the same rows; --budget-s: no row starts after 7 minutes, the timeout in
    # case a ring collective never returns. report.py reads its file where it wrote one.
    step multigpu_bench.log timeout 720 "${python_run[@]}" "$here/benchmarks/cp_step_peer.py" --configs long \
      --budget-s 420 --out "$results/cp_step_peer.json"
    cp_peer=()
    [ -s "$results/cp_step_peer.json" ] && cp_peer=("$results/cp_step_peer.json")
    step multigpu_bench.log python3 "$here/benchmarks/report.py" "$results/step_bench_cp2.json" "${cp_peer[@]}" \
      --markdown "$results/step_report_cp2.md"
    wants multigpu_tp_bench || tp_step_bench multigpu_bench.log
    step multigpu_bench.log "${python_run[@]}" "$here/benchmarks/pytorch_peer.py" --ddp --configs medium,large \
      --out "$results/pytorch_peer_dp2.json"
  fi
fi
if wants multigpu_tp_bench; then
  : >"$results/multigpu_tp_bench.log"
  two_gpus multigpu_tp_bench.log && tp_step_bench multigpu_tp_bench.log
fi
# The GPT medium and large in two pipeline stages: our step (1F1B; interleaved on large, whose 4 layers make
# 2 chunks of one block a rank) and PyTorch's pipelining peer on the same microbatches.
if wants multigpu_pp_bench; then
  : >"$results/multigpu_pp_bench.log"
  if two_gpus multigpu_pp_bench.log; then
    step multigpu_pp_bench.log "${binary_run[@]}" "$here/bin/step_bench" --pp 2 --configs medium,large \
      --microbatches 8 --out "$results/step_bench_pp2.json"
    step multigpu_pp_bench.log "${binary_run[@]}" "$here/bin/step_bench" --pp 2 --virtual-stages 2 --configs large \
      --microbatches 8 --out "$results/step_bench_pp2_v2.json"
    # --budget-s: no row starts after 5 minutes; the timeout in case a send or recv never returns.
    step multigpu_pp_bench.log timeout 480 "${python_run[@]}" "$here/benchmarks/pp_step_peer.py" \
      --configs medium,large --microbatches 8 --budget-s 300 --out "$results/pp_step_peer.json"
    step multigpu_pp_bench.log timeout 480 "${python_run[@]}" "$here/benchmarks/pp_step_peer.py" \
      --virtual-stages 2 --configs large --microbatches 8 --budget-s 300 --out "$results/pp_step_peer_v2.json"
  fi
fi
# The moe config at EP=2: our step against each GPU alone, the exchange against NCCL's all-to-all on the same
# rows, and PyTorch's expert-parallel step.
if wants multigpu_ep_bench; then
  : >"$results/multigpu_ep_bench.log"
  if two_gpus multigpu_ep_bench.log; then
    step multigpu_ep_bench.log "${binary_run[@]}" "$here/bin/step_bench" --ep 2 --configs moe --profile \
      --out "$results/step_bench_ep2.json"
    step multigpu_ep_bench.log "${binary_run[@]}" "$here/bin/ep_exchange_bench" --config moe \
      --copy-blocks 8,16,32,64 --out "$results/ep_exchange_bench.json"
    # --budget-s: no row starts after 5 minutes; the timeout in case an all-to-all never returns.
    step multigpu_ep_bench.log timeout 480 "${python_run[@]}" "$here/benchmarks/ep_step_peer.py" --configs moe \
      --budget-s 300 --out "$results/ep_step_peer.json"
    ep_peer=()
    [ -s "$results/ep_step_peer.json" ] && ep_peer=("$results/ep_step_peer.json")
    step multigpu_ep_bench.log python3 "$here/benchmarks/report.py" "$results/step_bench_ep2.json" "${ep_peer[@]}" \
      --markdown "$results/step_report_ep2.md"
  fi
fi

# 7. Optional: compute-sanitizer memcheck and racecheck over the test binaries.
# API errors are not reported: every CUDA call's status is already checked by
# SG_CUDA_CHECK, and the negative tests provoke some on purpose (an unjoined
# capture, timing untimed events); the sanitizer's job here is kernel memory.
sanitizer_line="sanitizer not run"
if [ "$sanitize" = yes ]; then
  sanitizer_errors=0
  : >"$results/sanitizer.log"
  for tool in memcheck racecheck; do
    for binary in "$here"/tests/*; do
      echo "=== $tool $(basename "$binary")" >>"$results/sanitizer.log"
      # racecheck looks at shared memory inside kernels; under it the thousand
      # graph replays take minutes and add nothing memcheck has not covered.
      filter=()
      [ "$tool" = racecheck ] && filter=(--gtest_filter='-*ThousandReplays*:*HundredReplays*')
      compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 99 "$binary" "${filter[@]}" \
        >>"$results/sanitizer.log" 2>&1
      status=$?
      echo "=== exit $status" >>"$results/sanitizer.log"
      [ "$status" -eq 0 ] || sanitizer_errors=$((sanitizer_errors + 1))
    done
  done
  sanitizer_line="sanitizer: $sanitizer_errors failing run(s)"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$results/sanitizer.log" | sort | uniq -c >>"$results/summary.txt"
fi

summary="gpu bundle: tests $test_line; steps: $failed_steps failed; $sanitizer_line"
echo "$summary" | tee -a "$results/summary.txt"
cp "$results/summary.txt" "$out/summary.txt"
tar -czf "$out/results.tar.gz" -C "$out" results && rm -rf "$results"
rm -rf "$work"
case "$test_line" in *" 0 failed"* | "tests not run") ;; *) exit 1 ;; esac
[ "$failed_steps" -eq 0 ] || exit 1
