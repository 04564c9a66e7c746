#!/usr/bin/env bash
# Here, before a session's first call to the lent GPU: what the device machine lacks, in
# ignored folders the call carries (run: carry [".whl", ".tok"]).
#   .whl  wheels of Shoal's pure-Python needs its python3 (3.12) does not have, no deps
#         pulled: the device has torch, Triton, transformers, numpy, jinja2, anyio, ...
#   .tok  SmolLM2's tokenizer files (bench structured / structured_trace: a random
#         checkpoint of its shape with these copied in)
# Then each call starts with:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD SHOAL_CACHE=/tmp/shoal-cache
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >>.git/info/exclude
grep -qx '/.tok/' .git/info/exclude 2>/dev/null || echo /.tok/ >>.git/info/exclude
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" --platform manylinux2014_x86_64 -d .whl \
  gguf==0.19.0 redis==8.1.0 hiredis==3.4.2 llguidance==1.9.1 fastapi==0.165.0 \
  starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 typing-extensions==4.16.0 opentelemetry-api==1.45.3 \
  uvicorn==0.55.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
  referencing==0.37.0 rpds-py==2026.9.1 2>&1 | grep -v "is ignored" || true
.venv/bin/python -c "
from shoal.model.loader import load_tokenizer_only
load_tokenizer_only('smollm2').hf.save_pretrained('.tok')"
du -sh .whl .tok
