"""The vLLM connector's tests run in .venv-vllm (``make vllm``, a step of ``make test``),
with vllm==0.33.0 installed. In .venv (``make unit``) they are not collected: that venv
has no vLLM. Where .venv-vllm could not be built, ``make vllm`` runs them in .venv with
KVDIST_VLLM_SKIP set to why, and each module skips saying so (``vllm_or_skip``)."""

import importlib.util
import os

if importlib.util.find_spec("vllm") is None and not os.environ.get("KVDIST_VLLM_SKIP"):
    collect_ignore_glob = ["test_*.py"]
