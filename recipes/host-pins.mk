# Included by every recipe's Makefile: the interpreter, and the pins every proof runs under on the GPU host (NVLink
# multicast stays off there: REFERENCE-GPU.md; a multi-rank SAVE refuses without them; the archive records them).
PYTHON ?= python3
export PYTHONUNBUFFERED := 1
export NCCL_NVLS_ENABLE := 0
export TORCH_SYMM_MEM_DISABLE_MULTICAST := 1
export NVSHMEM_DISABLE_NVLS := 1
