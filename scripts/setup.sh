#!/usr/bin/env bash
# Installs fusedattn (editable) with its test, benchmark and Hugging Face extras into the current Python.
# On a machine without torch it installs torch 2.13.0; without triton, triton 3.6.0 (the
# version the GPU suite is run with; its interpreter is what the CPU tests use).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
$PY -c "import torch" 2>/dev/null || $PY -m pip install -q "torch==2.13.0"
$PY -c "import triton" 2>/dev/null || $PY -m pip install -q "triton==3.6.0"
$PY -m pip install -q -e ".[test,bench,hf]"
$PY -c "import torch, triton, fusedattn; print(f'fusedattn {fusedattn.__version__}: torch {torch.__version__}, triton {triton.__version__}, cuda available: {torch.cuda.is_available()}')"
