"""Build of the patched vLLM/SGLang distribution: fetch, verify, unpack, patch, overlay, stamp, repack."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
