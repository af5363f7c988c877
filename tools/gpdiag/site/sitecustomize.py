"""On PYTHONPATH only for a diagnosis run (the vLLM driver puts it there when a `GP_DIAG_*` switch is set): wires
gpdiag into every Python process of the run (gpdiag.vllm.install), then runs the next `sitecustomize` on the path,
if any (recipes/gpu-host/stacksample's), as if this one were not there."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(_here)))  # tools/: gpdiag itself
if any(name.startswith("GP_DIAG_") for name in os.environ):
    from gpdiag import vllm as _gpdiag_vllm

    _gpdiag_vllm.install()
_rest = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _next = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_next)
