"""Blocks pidfd_getfd in the calling process with a seccomp filter, as container default profiles and Yama
ptrace_scope 2/3 effectively do, so the IPC tests can prove the default transport does not need it.

Irreversible for the process (and its children): call it only in a helper process."""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct

SYS_PIDFD_GETFD = 438  # the same number on x86_64 and aarch64 (the generic syscall table)
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_LD_W_ABS, _JEQ_K, _RET_K = 0x20, 0x15, 0x06
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2


def supported() -> bool:
    return platform.machine() in AUDIT_ARCH


def block_pidfd_getfd() -> None:
    """pidfd_getfd returns EPERM from now on; every other syscall is untouched. Raises OSError if refused."""
    prog = [
        (_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        (_JEQ_K, 0, 3, AUDIT_ARCH[platform.machine()]),  # another ABI: allow
        (_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
        (_JEQ_K, 0, 1, SYS_PIDFD_GETFD),
        (_RET_K, 0, 0, _RET_ERRNO | errno.EPERM),
        (_RET_K, 0, 0, _RET_ALLOW),
    ]
    insns = ctypes.create_string_buffer(b"".join(struct.pack("=HBBI", *i) for i in prog))
    fprog = ctypes.create_string_buffer(struct.pack("=HxxxxxxQ", len(prog), ctypes.addressof(insns)))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER,
                                                                       fprog, 0, 0) != 0:  # fmt: skip
        err = ctypes.get_errno()
        raise OSError(err, f"installing the seccomp filter failed: {os.strerror(err)}")
