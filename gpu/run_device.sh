#!/usr/bin/env bash
# The GPU suite and the GPU benchmarks on the device tool's machines, one part per call (the whole
# script takes longer than one call's 10 minutes), e.g. on two GPUs:
#   run(kind="nvidia-h100-x2", carry=[".whl"], command="export OUT; bash gpu/run_device.sh tests")
# The machine has no network: PyTensor 3.3.8 and its pure-Python dependencies, nccl4py (for
# synk_comm.nccl's own tests) and posix_ipc travel as cp312 wheels in .whl/ (docs/guides/gpu.rst);
# our packages run from source.  GPU mode runs on the JAX engine (synkhronos.engine).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/synk-out}; mkdir -p "$OUT"
# once per machine: a warm machine's later calls (and parts run side by side) find it installed
[ -e /tmp/site/.synk-wheels ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && touch /tmp/site/.synk-wheels; } || exit 1
# the wheels, then the packages of a tree (this one, or another one's copy: tiny16's BASE) from source
tree_path() { local t; t=$(cd "$1" && pwd); echo "/tmp/site:$t/packages/synk-shm/src:$t/packages/synk-comm/src:$t/packages/synk-theano/src:$t/packages/synk-lasagne/src"; }
PYTHONPATH=$(tree_path .); export PYTHONPATH
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTENSOR_FLAGS="floatX=float32" PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import jax, pytensor, nccl.core, torch; print('jax', jax.__version__, 'pytensor', pytensor.__version__, 'torch', torch.__version__)"
status=0
what=${1:-all}  # all | tests | reliability | bench | uneven | comm | profile | mnist | engine | hot | tiny | quiet | resnet | resnet-scaling | resnet-fp32 | resnet-bf16 | precision | precision2 | inflight | overlap | resnet-inflight | pymc | pymc-gpu | pymc-profile | lasagne | cpu | cpu2 | tiny2 | tiny16 | allreduce | step
# The GPU-marker suites, and every CPU-mode scenario of the synkhronos suite again in GPU mode on
# the engine (float64: the tests' numpy data), as four pytest processes at once: each forks its own
# groups over every GPU (no preallocation), so they share the GPUs; their compile time runs in
# parallel.  Tests of more GPUs than the machine has skip.  Fits one device call (<= 540 s).
if [ "$what" = all ] || [ "$what" = tests ]; then
  T=packages/synk-theano/tests
  # the two GPU-marker suites one after the other, each in a pytest process of its own
  (for suite in packages/synk-comm/tests/test_comm_gpu.py $T/test_synk_gpu.py; do
     timeout 200 python3 -m pytest -p no:cacheprovider -q -m gpu "$suite" || exit 1
   done) > "$OUT/gpu_tests.log" 2>&1 & pids=$!
  mapfile -t modules < <(ls "$T"/test_synk_*.py | grep -v test_synk_gpu.py)
  for part in 0 1 2; do  # every third module
    files=""; for ((i = part; i < ${#modules[@]}; i += 3)); do files="$files ${modules[$i]}"; done
    SYNK_TEST_GPU=1 PYTENSOR_FLAGS=floatX=float64 timeout 450 python3 -m pytest -p no:cacheprovider -q -rs $files \
      > "$OUT/gpu_suite_$part.log" 2>&1 & pids="$pids $!"
  done
  for pid in $pids; do wait "$pid" || status=1; done
  tail -n 3 "$OUT"/gpu_tests.log "$OUT"/gpu_suite_*.log
fi
# The reliability suites (bad input, faults with real processes) in GPU mode on every GPU, then the
# soak there (20,000 calls): what `nox -s reliability` runs in GPU mode, without nox (no network)
if [ "$what" = all ] || [ "$what" = reliability ]; then
  SYNK_TEST_GPU=1 PYTENSOR_FLAGS=floatX=float64 timeout 420 python3 -m pytest -p no:cacheprovider -q -rs tests/reliability \
    > "$OUT/reliability_gpu.log" 2>&1 || status=1
  tail -n 40 "$OUT/reliability_gpu.log"
  SYNK_TEST_GPU=1 timeout 150 python3 tests/reliability/soak.py --calls 20000 --sample 5000 2>&1 | tee "$OUT/soak_gpu.log" || status=1
fi
# synk_lasagne's step on an uneven batch (one program cut at its all-reduce) against its chain, every GPU
if [ "$what" = all ] || [ "$what" = uneven ]; then
  timeout 300 python3 benchmarks/bench_train_step.py --gpu --engine jax --uneven --ranks "$(nvidia-smi -L | wc -l)" 2>&1 \
    | tee "$OUT/bench_train_step_uneven.log" || status=1
fi
if [ "$what" = all ] || [ "$what" = mnist ]; then  # the main job on every GPU, both data patterns
  for pattern in host scatter; do
    timeout 240 python3 examples/mnist/train_mnist.py --no-progress --pattern $pattern --plot "$OUT/mnist_gpu_$pattern.png" 2>&1 \
      | tee "$OUT/mnist_gpu_$pattern.log" || status=1
  done
fi
# What a user sees: the main job on every GPU (its defaults), stdout and stderr kept apart; every stderr
# line is printed (the goal: none a user cannot act on)
if [ "$what" = quiet ]; then
  timeout 240 python3 examples/mnist/train_mnist.py --no-progress > "$OUT/quiet_stdout.log" 2> "$OUT/quiet_stderr.log" \
    || status=1
  echo "== stdout ($(wc -l < "$OUT/quiet_stdout.log") lines)"; cat "$OUT/quiet_stdout.log"
  echo "== stderr ($(wc -l < "$OUT/quiet_stderr.log") lines)"; cat "$OUT/quiet_stderr.log"
fi
if [ "$what" = all ] || [ "$what" = engine ]; then  # the JAX engine: its GPU tests, then one GPU against plain
  timeout 240 python3 -m pytest -p no:cacheprovider -q -s packages/synk-theano/tests/test_synk_engine_gpu.py 2>&1 \
    | tee "$OUT/engine_gpu_tests.log" || status=1
  timeout 280 python3 benchmarks/bench_engine.py 2>&1 | tee "$OUT/bench_engine.log" || status=1
fi
if [ "$what" = hot ]; then  # the engine's call path: its GPU tests, the one-GPU table, where a call's time goes
  timeout 150 python3 -m pytest -p no:cacheprovider -q packages/synk-theano/tests/test_synk_engine_gpu.py 2>&1 \
    | tail -n 5 | tee "$OUT/engine_gpu_tests.log" || status=1
  timeout 320 python3 benchmarks/bench_engine.py --reps 3 2>&1 | tee "$OUT/bench_engine.log" || status=1
  PYTHONPATH=$PYTHONPATH:$PWD/benchmarks timeout 150 python3 tools/profile_engine_call.py 2>&1 \
    | tee "$OUT/profile_engine_call.log" || status=1
fi
if [ "$what" = all ] || [ "$what" = tiny ]; then  # the engine's tiny call against plain, side by side in one process
  timeout 200 python3 benchmarks/bench_engine.py --reps 3 --variants tiny 2>&1 | tee "$OUT/bench_engine_tiny.log" || status=1
fi
if [ "$what" = all ] || [ "$what" = lasagne ]; then  # layers and conv/pool Ops on the GPU (JAX), one rank
  # float64: the tests compare float64 numpy data (as in CI)
  PYTENSOR_FLAGS=floatX=float64 timeout 300 python3 -m pytest -p no:cacheprovider -q packages/synk-lasagne/tests/test_lasagne_ops.py \
    packages/synk-lasagne/tests/test_lasagne_layers.py > "$OUT/lasagne_gpu_tests.log" 2>&1 || status=1
  tail -n 3 "$OUT/lasagne_gpu_tests.log"
  PYTENSOR_FLAGS=floatX=float64 timeout 300 python3 -m pytest -p no:cacheprovider -q -m gpu \
    packages/synk-lasagne/tests/test_lasagne_gpu.py 2>&1 | tail -n 3
fi
# ResNet-50 images/s (benchmarks/bench_resnet.py): every visible GPU; one precision per call (each compiles
# ResNet-50 for every row: about 4-5 minutes on one H100).
if [ "$what" = all ] || [ "$what" = resnet ]; then
  timeout 560 python3 benchmarks/bench_resnet.py --batches 64,128 --precisions tf32 2>&1 | tee "$OUT/bench_resnet_tf32.log" || status=1
fi
if [ "$what" = all ] || [ "$what" = resnet-fp32 ]; then
  timeout 560 python3 benchmarks/bench_resnet.py --batches 64,128 --precisions fp32 2>&1 | tee "$OUT/bench_resnet_fp32.log" || status=1
fi
# ResNet-50 scaling on every GPU (1, 2, 4, 8 up to the machine's count) beside DDP at the same per-GPU batch and
# precision, synchronous and submitted (2 in flight): BATCHES (default 128), PRECISIONS (default tf32,bf16); each row
# compiles in about 20 s, so both precisions fit one call on 4 GPUs
if [ "$what" = resnet-scaling ]; then
  timeout 570 python3 benchmarks/bench_resnet.py --batches "${BATCHES:-128}" --precisions "${PRECISIONS:-tf32,bf16}" \
    --skip plain --in-flight 2 2>&1 | grep -v "WatchTasksAsync\|GRPC error\|CANCELLED\|UNAVAILABLE\|Source Location\|grpc_util\|^$" \
    | tee "$OUT/bench_resnet_scaling.log" || status=1
fi
# Mixed precision on ONE GPU (synkhronos.precision): ResNet-50 images/s in bf16 -- ours (precision="bf16", the
# step called and, with IN_FLIGHT (default 3) steps in flight, submitted), plain PyTensor JAX under the policy,
# the hand-written JAX network (NHWC, benchmarks/jax_resnet.py), torchvision AMP (NCHW, channels_last) and AMP +
# channels_last + torch.compile -- at BATCHES (default 128,256; PRECISIONS=tf32,bf16 adds the TF32 rows, in a
# second call if one call's 10 minutes do not hold both; SKIP (default ddp) leaves rows out)
if [ "$what" = resnet-bf16 ]; then
  timeout 570 python3 benchmarks/bench_resnet.py --gpus 1 --batches "${BATCHES:-128,256}" --precisions "${PRECISIONS:-bf16}" \
    --skip "${SKIP:-ddp}" --in-flight "${IN_FLIGHT:-3}" 2>&1 | tee "$OUT/bench_resnet_bf16.log" || status=1
fi
# The benchmark MLP's step in TF32 and bf16 against DDP (+ autocast bf16) on every GPU, then the CNN MNIST demo in
# bf16 and in the default precision (accuracy within 0.5 points is the goal)
if [ "$what" = precision ]; then
  SYNK_BENCH_PARTS=tf32,bf16 timeout 300 python3 benchmarks/bench_gpu.py 2>&1 | tee "$OUT/bench_gpu_bf16.log" || status=1
  for p in bf16 default; do
    timeout 120 python3 examples/mnist/train_mnist.py --model cnn --precision $p --no-baseline --no-progress \
      --plot "$OUT/mnist_cnn_$p.png" > "$OUT/mnist_cnn_$p.log" 2>&1 || status=1
    tail -n 4 "$OUT/mnist_cnn_$p.log"
  done
  # both test accuracies and their difference (the goal: within 0.5 percentage points)
  acc() { grep -o "final test accuracy[^:]*: [0-9.]*%" "$OUT/mnist_cnn_$1.log" | grep -o "[0-9.]*%$" | tr -d %; }
  a=$(acc bf16); b=$(acc default)
  if [ -n "$a" ] && [ -n "$b" ]; then
    awk -v a="$a" -v b="$b" 'BEGIN { d = a - b; printf "CNN MNIST test accuracy: bf16 %.2f%%, default %.2f%%, difference %+.2f points: %s (goal: within 0.5)\n", a, b, d, (d <= 0.5 && d >= -0.5) ? "PASS" : "FAIL" }' \
      | tee "$OUT/mnist_cnn_accuracy.log"
  else
    echo "CNN MNIST: a run printed no final test accuracy (see $OUT/mnist_cnn_*.log)"; status=1
  fi
fi
# Mixed precision's accuracy, memory and profile in ONE call (under 9 minutes): ResNet-50's loss over 200 steps
# and its GPU memory at batch 128 under strict float32, TF32 and bf16, beside strict float32 from a start moved
# by one float32 ulp (the protocol's floor) (benchmarks/bench_precision.py --part resnet: bf16's PASS/FAIL lines), where bf16's step time goes at batch 256 with XLA's memory analysis beside TF32's
# (tools/profile_precision_step.py); on 2+ GPUs the ResNet runs on the second GPU while the first is profiled,
# then the MLP step with the gradient all-reduced in bfloat16 against float32 and DDP's bf16_compress_hook
# (--part allreduce).  Logs: $OUT/precision_resnet.log, profile_bf16.log, precision_allreduce.log.
if [ "$what" = precision2 ]; then
  gpus=$(nvidia-smi -L | wc -l)
  if [ "$gpus" -ge 2 ]; then
    timeout 300 python3 benchmarks/bench_precision.py --part resnet --gpu 1 --timeout 280 > "$OUT/precision_resnet.log" 2>&1 &
    resnet=$!
    CUDA_VISIBLE_DEVICES=0 timeout 240 python3 tools/profile_precision_step.py --batch 256 --memory-of default \
      > "$OUT/profile_bf16.log" 2>&1 || status=1
    wait "$resnet" || status=1
    timeout 180 python3 benchmarks/bench_precision.py --part allreduce --timeout 160 > "$OUT/precision_allreduce.log" 2>&1 \
      || status=1
  else
    timeout 300 python3 benchmarks/bench_precision.py --part resnet --timeout 280 > "$OUT/precision_resnet.log" 2>&1 || status=1
    timeout 220 python3 tools/profile_precision_step.py --batch 256 --memory-of default > "$OUT/profile_bf16.log" 2>&1 \
      || status=1
  fi
  for log in precision_resnet profile_bf16 precision_allreduce; do
    [ -e "$OUT/$log.log" ] && { echo "== $log"; grep -v "Warning\|warn(" "$OUT/$log.log" | tail -n 45; }
  done
fi
# CPU mode on the machine's CPU cores (16 on the one-GPU kinds): scaling against torch DDP (gloo)
if [ "$what" = all ] || [ "$what" = cpu ]; then
  CUDA_VISIBLE_DEVICES= PYTENSOR_FLAGS= timeout 300 python3 benchmarks/bench_cpu_scaling.py 2>&1 | tee "$OUT/bench_cpu_scaling.log" || status=1
fi
# CPU mode on 2 of the machine's cores (taskset: a quiet 2-core machine; two cores of different physical
# cores, not one core's two hyperthreads): the tiny call at 2 ranks (twice; TINY=0 skips it) and the
# main job (data-parallel against one process on both cores), RUNS rounds (default 3) of its
# VARIANTS alternating: ';'-separated sets of flags (default: the defaults, then one 1024-row step per epoch),
# e.g. VARIANTS='--layers 8;--layers 12' (a leading ';': the defaults first); with BASE=<dir holding
# another tree's packages/ and examples/> (carried), that tree's main job before each of ours; CORES=a,b
# takes those two cores instead of the first two physical ones
if [ "$what" = cpu2 ]; then
  two=${CORES:-$(cd benchmarks && python3 -c "from machine import physical_cores; print(','.join(map(str, physical_cores(2))))")}
  echo "cores $two; cpu0's hyperthreads: $(cat /sys/devices/system/cpu/cpu0/topology/thread_siblings_list)"
  if [ "${TINY:-1}" != 0 ]; then
    for i in 1 2; do
      CUDA_VISIBLE_DEVICES= PYTENSOR_FLAGS= taskset -c "$two" timeout 100 python3 benchmarks/bench_cpu_scaling.py --only tiny \
        2>/dev/null | tee -a "$OUT/tiny_2cores.log" || status=1
    done
  fi
  IFS=';' read -ra variants <<< "${VARIANTS:-;--batch-size 1024 --drop-last --epochs 500}"
  trees=(.); [ -n "${BASE:-}" ] && trees=("$BASE" .)
  for i in $(seq "${RUNS:-3}"); do
    for v in "${!variants[@]}"; do
      for t in "${!trees[@]}"; do
        flags=${variants[$v]}
        log="$OUT/mnist_2cores_${i}_${v}_$t.log"
        echo "run $i ${flags:-(defaults)}, tree ${trees[$t]}"
        # shellcheck disable=SC2086  # a variant's flags split on spaces
        PYTHONPATH=$(tree_path "${trees[$t]}") CUDA_VISIBLE_DEVICES= PYTENSOR_FLAGS= taskset -c "$two" timeout 150 \
          python3 "${trees[$t]}/examples/mnist/train_mnist.py" --cpu --no-progress $flags --plot "${log%.log}.png" \
          > "$log" 2>&1 || status=1
        grep -E "^(data-parallel|single process):|speedup|final test|total time" "$log"
      done
    done
  done
fi
# The tiny call at 2 ranks on the two cores machine.physical_cores picks (CORES=a,b to choose: on a
# VM the host may pair vCPUs as hyperthreads), RUNS times, the trees taking turns (BASE=)
if [ "$what" = tiny2 ]; then
  two=${CORES:-$(cd benchmarks && python3 -c "from machine import physical_cores; print(','.join(map(str, physical_cores(2))))")}
  trees=(.); [ -n "${BASE:-}" ] && trees=("$BASE" .)
  for i in $(seq "${RUNS:-3}"); do
    for tree in "${trees[@]}"; do
      echo "== tree $tree, run $i, cores $two"
      PYTHONPATH=$(tree_path "$tree") CUDA_VISIBLE_DEVICES= PYTENSOR_FLAGS= taskset -c "$two" timeout 100 \
        python3 benchmarks/bench_cpu_scaling.py --only tiny 2>/dev/null | tee -a "$OUT/tiny_2cores.log" || status=1
    done
  done
fi
# The in-program all-reduce alone at PROBE_RANKS ranks (default 2,4,8,16) in each of PROBE_TREES (default
# BASE and this tree), then the MLP step at RANKS_MLP ranks (default 4) against DDP at 2 processes,
# RUNS times (default 2), the trees taking turns (BASE=)
if [ "$what" = allreduce ]; then
  # one MLP configuration through the benchmark's own driver (its float32 and its thread variables)
  mlp_one() { PYTENSOR_FLAGS= timeout 150 python3 -c "import json, sys; sys.path.insert(0, 'benchmarks')
import bench_cpu_scaling as b; print(json.dumps(b.run_one(sys.argv[1], int(sys.argv[2]))))" "$1" "$2" \
    2>/dev/null | tee -a "$OUT/mlp_ab.log"; }
  trees=(.); [ -n "${BASE:-}" ] && trees=("$BASE" .)
  for tree in ${PROBE_TREES:-${trees[@]}}; do
    echo "== tree $tree, all-reduce probe"
    PYTHONPATH=$(tree_path "$tree") CUDA_VISIBLE_DEVICES= PYTENSOR_FLAGS= timeout 150 python3 \
      tools/probe_in_program_all_reduce.py --ranks "${PROBE_RANKS:-2,4,8,16}" 2>&1 | grep -v "^ \|^Trace\|^Runtime\|^An NVIDIA\|^Jax plugin" \
      | tee -a "$OUT/all_reduce.log" || status=1
  done
  for i in $(seq "${RUNS:-2}"); do
    for tree in "${trees[@]}"; do
      for n in ${RANKS_MLP:-4}; do
        echo "== tree $tree, run $i, MLP at $n ranks"
        PYTHONPATH=$(tree_path "$tree") CUDA_VISIBLE_DEVICES= mlp_one synk "$n" || status=1
      done
    done
    echo "== run $i, DDP at 2 processes"
    CUDA_VISIBLE_DEVICES= mlp_one ddp 2 || status=1
  done
fi
# The tiny call at 2 and 16 ranks on the machine's 16 cores, three times, then where its time goes;
# with BASE=<dir holding another tree's packages/> (carried), that tree's run before each of ours
if [ "$what" = tiny16 ]; then
  trees=(.); [ -n "${BASE:-}" ] && trees=("$BASE" .)
  for i in 1 2 3; do
    for tree in "${trees[@]}"; do
      echo "== tree $tree, run $i"
      PYTHONPATH=$(tree_path "$tree") CUDA_VISIBLE_DEVICES= PYTENSOR_FLAGS= timeout 120 python3 benchmarks/bench_cpu_scaling.py \
        --only tiny --tiny-ranks 2,16 2>/dev/null | tee -a "$OUT/tiny_16cores.log" || status=1
    done
  done
  for tree in "${trees[@]}"; do
    echo "== tree $tree, probe"
    PYTHONPATH=$(tree_path "$tree") CUDA_VISIBLE_DEVICES= PYTENSOR_FLAGS= timeout 150 python3 tools/probe_tiny_call.py \
      --ranks 2,16 2>&1 | tee -a "$OUT/probe_tiny_16cores.log" || status=1
  done
fi
# Calls in flight on every GPU: the GPU-marker suites, the engine's one-GPU tests and the submit /
# gradient-rule / precision scenarios in GPU mode, then bench_gpu's all-reduce, tiny call and TF32 step
# with synchronous calls and with 2 calls in flight (SYNK_BENCH_IN_FLIGHT), side by side in one call
if [ "$what" = inflight ]; then
  T=packages/synk-theano/tests
  for suite in packages/synk-comm/tests/test_comm_gpu.py $T/test_synk_gpu.py; do
    timeout 150 python3 -m pytest -p no:cacheprovider -q -m gpu "$suite" 2>&1 | tail -n 2 | tee -a "$OUT/gpu_tests.log" || status=1
  done
  SYNK_TEST_GPU=1 PYTENSOR_FLAGS=floatX=float64 timeout 200 python3 -m pytest -p no:cacheprovider -q -rs \
    $T/test_synk_inflight.py $T/test_synk_gradient_rule.py $T/test_synk_precision.py $T/test_synk_engine_gpu.py 2>&1 \
    | tail -n 15 | tee "$OUT/gpu_inflight_tests.log" || status=1
  # one table: the MLP step synchronous and submitted (pipelined, 2 in flight, every loss read through its
  # future) beside plain PyTensor JAX on 1 GPU and DDP with and without its per-step sync
  SYNK_BENCH_PARTS=allreduce,tiny,tf32 SYNK_BENCH_IN_FLIGHT=2 timeout 300 python3 benchmarks/bench_gpu.py 2>&1 \
    | tee "$OUT/bench_gpu_inflight.log" || status=1
fi
# Where XLA schedules the gradient all-reduce of the MLP step on every GPU (tools/hlo_overlap.py: the step's
# optimised HLO, the products that run between each all-reduce's start and its wait), then the calls-in-flight
# and collective tests in GPU mode and bench_gpu's all-reduce (called and submitted) and tiny call
if [ "$what" = overlap ]; then
  PYTHONPATH=$PYTHONPATH:$PWD/benchmarks timeout 200 python3 tools/hlo_overlap.py --batch 16384 --dump /tmp/synk-hlo \
    --keep "$OUT/hlo_step.txt" 2>&1 | tee "$OUT/hlo_overlap.log" || status=1
  T=packages/synk-theano/tests
  SYNK_TEST_GPU=1 PYTENSOR_FLAGS=floatX=float64 timeout 150 python3 -m pytest -p no:cacheprovider -q -rs \
    $T/test_synk_inflight.py $T/test_synk_collectives.py 2>&1 | tail -n 6 | tee "$OUT/gpu_inflight_tests.log" || status=1
  SYNK_BENCH_PARTS=allreduce,tiny timeout 200 python3 benchmarks/bench_gpu.py 2>&1 | tee "$OUT/bench_gpu_allreduce.log" \
    || status=1
fi
# ResNet-50 on one GPU (TF32, batch 128): synk 1 rank synchronous and submitted (2 in flight, every loss read
# through its future) beside plain PyTensor JAX reading the loss every step and once at the end (async)
if [ "$what" = resnet-inflight ]; then
  timeout 560 python3 benchmarks/bench_resnet.py --gpus 1 --batches "${BATCHES:-128}" --precisions tf32 --skip torch,ddp \
    --in-flight 2 2>&1 | tee "$OUT/bench_resnet_inflight.log" || status=1
fi
# PyMC (synkhronos.pymc, float64 as PyMC computes; benchmarks/bench_pymc.py), each part in one call of at most about 9
# minutes.  The .whl folder carries PyMC 6 and its pure-Python dependencies, and nutpie with what it needs beyond the
# image (nutpie, arro3-core, obstore, platformdirs); numpyro and JAX with CUDA are the image's.  Environment:
#   SAMPLERS   the samplers, in turn, each in a fresh process (pymc: synk,pymc,numpyro,nutpie; pymc-gpu:
#              synk,numpyro-vec,numpyro,pymc); ROWS (1,000,000) rows x 20 features, 4 chains x (DRAWS draws + TUNE tune)
#              (pymc: 100 + 100; pymc-gpu: 1000 + 1000)
#   SAMPLER_S  seconds each sampler may run (default 150); a stopped sampler's row gives the draws it finished and
#              the seconds it ran (its wall time is at least that), and --report compares it with synk's run at the
#              same draws.  The part's budget: SAMPLER_S + 30 per sampler, PART_S (default 510) in all with the
#              evaluations: a sampler is stopped earlier where the budget ends first (the call then takes about
#              PART_S + 30 s with the wheels' install)
#   EVALS=0    skips the milliseconds per logp-and-gradient evaluation at ROWS rows (about 60 s)
# Rows: $OUT/pymc[_gpu]_<samplers>.json; `python benchmarks/bench_pymc.py --report A.json B.json ...` puts the
# rows of several calls in one table beside the first synk row.  The CPU goal at its real size (4 x (1000 + 1000)):
#   SAMPLERS=synk,pymc DRAWS=1000 EVALS=0 SAMPLER_S=480 bash gpu/run_device.sh pymc
# (synk whole, then PyMC's default sampler for the rest of the call: stopped, its draws against synk's at the same
# draws -- the same chains, the same seeds), then SAMPLERS=numpyro and SAMPLERS=nutpie, a call each.
# pymc: on the CPU cores (synk: RANKS_PYMC ranks, default 16, the 4 chains batched; PyMC's default sampler: 4 chain
# processes; numpyro: 4 XLA host devices; nutpie).  pymc-gpu: synk in GPU mode on one GPU (the JAX engine, one rank,
# the chains batched), numpyro on the GPU (numpyro-vec: chain_method="vectorized"; numpyro: its default, "parallel",
# which on one device draws the chains one after another), then PyMC's default sampler on the CPU cores for the rest
# of the call (a reference: stopped, its draws against synk's at the same draws).
if [ "$what" = pymc ] || [ "$what" = pymc-gpu ]; then
  export PYTENSOR_FLAGS=floatX=float64
  gpu=""; json=pymc; samplers=${SAMPLERS:-synk,pymc,numpyro,nutpie}; draws=${DRAWS:-100}
  if [ "$what" = pymc-gpu ]; then
    gpu="--gpu"; json=pymc_gpu; samplers=${SAMPLERS:-synk,numpyro-vec,numpyro,pymc}; draws=${DRAWS:-1000}
  else
    export JAX_PLATFORMS=cpu CUDA_VISIBLE_DEVICES=
  fi
  # a warm machine installed the wheels of an earlier call: nutpie's too, once
  python3 -c "import nutpie" 2>/dev/null || ! ls .whl/nutpie-*.whl >/dev/null 2>&1 || python3 -m pip install -q --no-index \
    --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/nutpie-*.whl .whl/arro3_core-*.whl \
    .whl/obstore-*.whl .whl/platformdirs-*.whl || status=1
  ranks=${RANKS_PYMC:-16}; [ -n "$gpu" ] && ranks=${RANKS_PYMC:-1}
  left=${PART_S:-510}
  if [ "${EVALS:-1}" != 0 ]; then
    begun=$SECONDS
    timeout 120 python3 benchmarks/bench_pymc.py $gpu --evals --rows "${ROWS:-1000000}" --ranks "$ranks" --calls 30 --batch 4 2>&1 \
      | tee "$OUT/${json}_evals.log" || status=1
    left=$((left - (SECONDS - begun)))
  fi
  n=$(tr ',' '\n' <<< "$samplers" | wc -l)
  limit=$((n * (${SAMPLER_S:-150} + 30))); [ "$limit" -gt "$left" ] && limit=$left
  echo "samplers $samplers, each ${SAMPLER_S:-150} s at most, all $limit s at most"
  # the benchmark stops a sampler in time to end within $limit s; the outer limit is a safety
  timeout $((limit + 30)) python3 benchmarks/bench_pymc.py $gpu --rows "${ROWS:-1000000}" --draws "$draws" \
    --tune "${TUNE:-$draws}" --chains 4 --ranks "$ranks" --samplers "$samplers" --timeout "${SAMPLER_S:-150}" \
    --budget "$limit" --json "$OUT/${json}_${samplers//,/_}.json" 2>&1 | tee "$OUT/${json}_sample.log" || status=1
fi
# The training step on every GPU against hand-written JAX and DDP, under XLA flag variants, then
# where the engine's step spends its host time (tools/probe_gpu_step.py)
if [ "$what" = step ]; then
  timeout 420 python3 tools/probe_gpu_step.py 2>&1 | tee "$OUT/probe_gpu_step.log" || status=1
  timeout 150 python3 tools/probe_gpu_step.py --phases 2>&1 | tee -a "$OUT/probe_gpu_step.log" || status=1
fi
# Where one PyMC evaluation's call goes in GPU mode, phase by phase (float64; tools/profile_engine_call.py --pymc)
if [ "$what" = pymc-profile ]; then
  timeout 400 python3 tools/profile_engine_call.py --pymc 2>&1 | tee "$OUT/profile_pymc_call.log" || status=1
fi
if [ "$what" = profile ]; then
  timeout 300 python3 tools/profile_gpu_step.py 2>&1 | tee "$OUT/profile_gpu_step.log" || status=1
fi
if [ "$what" = all ] || [ "$what" = bench ] || [ "$what" = comm ]; then
  timeout 180 python3 benchmarks/bench_comm_gpu.py 2>&1 | tee "$OUT/bench_comm_gpu.log" || status=1
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  timeout 480 python3 benchmarks/bench_gpu.py 2>&1 | tee "$OUT/bench_gpu.log" || status=1
fi
exit $status
