"""VMM-IPC building blocks (native/gp_ipc.c), built with gcc and driven through ctypes, no GPU: the handle codec,
the exporter's fd server and the importer's fetch between real processes (SCM_RIGHTS by default, pidfd_getfd as
the opt-in), including an importer whose pidfd_getfd is blocked by seccomp, pid reuse, stuck clients, fork and
exit, and the ownership rules of an IPC mapping."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import inspect
import json
import os
import platform
import random
import shutil
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from graphpersist.memory import region

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))
import seccomp_block  # noqa: E402 - lives in tests/

NATIVE = region.NATIVE_DIR
LAYOUT = struct.Struct("<IHHIiQQQQIIQ")  # the 64 bytes standing in a CUipcMemHandle
MAGIC, VERSION = 0x47504950, 2
F_PIDFD, F_SCM = 1, 2
E_NOT_OURS, E_VERSION, E_CHECKSUM, E_RANGE = -201, -202, -203, -204
E_ILLEGAL, E_PEER_GONE, E_NOT_FOUND = -210, -211, -212
E_PID_REUSED, E_UNKNOWN, E_IMPOSTOR, E_TRANSPORT = -214, -215, -217, -218
EXPORTED, IMPORTED, MAPPED, RELEASED = 1, 2, 3, 4
IMPORT, MAP, RELEASE, CLOSE = 1, 2, 3, 4
# (state, event) -> next state
LEGAL = {(EXPORTED, IMPORT): IMPORTED, (EXPORTED, RELEASE): RELEASED, (IMPORTED, MAP): MAPPED,
         (IMPORTED, RELEASE): RELEASED, (MAPPED, CLOSE): RELEASED}  # fmt: skip
SERVER_TIMEOUT_S = 2.0  # GP_IPC_SERVER_TIMEOUT_MS
BASE, SIZE, OFFSET = 0x7F0000000000, 2 << 20, 4096


class Handle(ctypes.Structure):
    _fields_ = [("magic", ctypes.c_uint32), ("version", ctypes.c_uint16), ("flags", ctypes.c_uint16),
                ("pid", ctypes.c_uint32), ("fd", ctypes.c_int32), ("base", ctypes.c_uint64),
                ("size", ctypes.c_uint64), ("offset", ctypes.c_uint64), ("export_id", ctypes.c_uint64),
                ("checksum", ctypes.c_uint32), ("token", ctypes.c_uint32), ("start_time", ctypes.c_uint64)]  # fmt: skip


class Import(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint32), ("refs", ctypes.c_uint32), ("export_id", ctypes.c_uint64),
                ("offset", ctypes.c_uint64), ("size", ctypes.c_uint64), ("cu_handle", ctypes.c_uint64),
                ("map_addr", ctypes.c_uint64), ("state", ctypes.c_uint32), ("pad", ctypes.c_uint32)]  # fmt: skip


class Table(ctypes.Structure):
    _fields_ = [("e", ctypes.POINTER(Import)), ("n", ctypes.c_size_t), ("cap", ctypes.c_size_t)]


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """ctypes signatures; the helper processes run this too (PRELUDE)."""
    u64, p = ctypes.c_uint64, ctypes.POINTER
    lib.gp_ipc_encode.argtypes = [ctypes.c_char_p, p(Handle)]
    lib.gp_ipc_decode.argtypes = [ctypes.c_char_p, p(Handle)]
    lib.gp_ipc_transport.argtypes = [ctypes.c_char_p]
    lib.gp_ipc_export.argtypes = [ctypes.c_char_p, ctypes.c_int, u64, u64, u64, u64, ctypes.c_int]
    lib.gp_ipc_unserve.argtypes = [u64]
    lib.gp_ipc_fetch.argtypes = [p(Handle), p(ctypes.c_int)]
    lib.gp_ipc_strerror.restype = ctypes.c_char_p
    lib.gp_proc_start_time.argtypes = [ctypes.c_int, p(u64)]
    lib.gp_fd_from_pid.argtypes = [ctypes.c_int, ctypes.c_int, p(ctypes.c_int)]
    lib.gp_fd_send.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    lib.gp_fd_recv.argtypes = [ctypes.c_int, p(ctypes.c_int), ctypes.c_char_p, ctypes.c_size_t]
    lib.gp_ipc_listen.argtypes = lib.gp_ipc_connect.argtypes = [ctypes.c_char_p]
    lib.gp_ipc_peer_cred.argtypes = [ctypes.c_int, p(ctypes.c_int), p(ctypes.c_uint)]
    lib.gp_ipc_transition.argtypes = [p(ctypes.c_uint32), ctypes.c_int]
    lib.gp_ipc_table_open.restype = ctypes.c_long
    lib.gp_ipc_table_open.argtypes = [p(Table), p(Handle), p(ctypes.c_int)]
    lib.gp_ipc_table_close.argtypes = [p(Table), u64, p(ctypes.c_long)]
    return lib


@pytest.fixture(scope="module")
def ipc(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    out = tmp_path_factory.mktemp("gpipc") / "libgpipc_test.so"
    subprocess.run(["gcc", "-O2", "-fPIC", "-shared", "-pthread", "-Wall", "-Wextra", "-Werror", "-o", str(out),
                    str(NATIVE / "gp_ipc.c")], check=True)  # fmt: skip
    return declare(ctypes.CDLL(str(out)))


def fnv1a(data: bytes) -> int:
    h = 2166136261
    for b in data:
        h = ((h ^ b) * 16777619) & 0xFFFFFFFF
    return h


FIELDS = (MAGIC, VERSION, F_SCM, 4242, 7, BASE, SIZE, OFFSET, 0x1234_5678_9ABC_DEF0)


def encode(lib: ctypes.CDLL, fields: tuple = FIELDS, token: int = 0xCAFE, start: int = 987654) -> bytes:
    raw = ctypes.create_string_buffer(64)
    h = Handle(0, 0, *fields[2:], 0, token, start)
    assert lib.gp_ipc_encode(raw, ctypes.byref(h)) == 0
    return raw.raw


def decode(lib: ctypes.CDLL, raw: bytes) -> tuple[int, Handle]:
    h = Handle()
    return lib.gp_ipc_decode(raw, ctypes.byref(h)), h


def forge(fields: tuple, token: int = 0xCAFE, start: int = 987654) -> bytes:
    """A handle with a valid checksum for whatever fields: only the semantic checks can refuse it."""
    raw = bytearray(LAYOUT.pack(*fields[:9], 0, token, start))
    struct.pack_into("<I", raw, 48, fnv1a(raw[:48] + raw[52:]))
    return bytes(raw)


def strerror(lib: ctypes.CDLL, code: int) -> str:
    return lib.gp_ipc_strerror(code).decode()


# ---- handle codec -------------------------------------------------------------------------------------------------


def test_handle_round_trip_and_layout(ipc: ctypes.CDLL) -> None:
    assert ctypes.sizeof(Handle) == LAYOUT.size == 64
    raw = encode(ipc)
    rc, h = decode(ipc, raw)
    assert rc == 0
    got = (h.magic, h.version, h.flags, h.pid, h.fd, h.base, h.size, h.offset, h.export_id)
    assert got == FIELDS and (h.token, h.start_time) == (0xCAFE, 987654)
    fields = LAYOUT.unpack(raw)
    assert fields[:9] == got and fields[10:] == (0xCAFE, 987654)  # the layout Python readers may rely on
    assert fields[9] == fnv1a(raw[:48] + raw[52:])
    assert raw == forge(got)


def test_decode_refuses_each_problem_with_its_own_code(ipc: ctypes.CDLL) -> None:
    wrong_magic = bytearray(encode(ipc))
    wrong_magic[0] ^= 1
    assert decode(ipc, bytes(wrong_magic))[0] == E_NOT_OURS
    assert decode(ipc, forge((MAGIC, 1, *FIELDS[2:])))[0] == E_VERSION
    for at in (6, 8, 12, 16, 24, 32, 40, 48, 52, 56, 63):  # any flipped bit outside the magic and version
        corrupt = bytearray(encode(ipc))
        corrupt[at] ^= 0x10
        assert decode(ipc, bytes(corrupt))[0] == E_CHECKSUM, at
    assert decode(ipc, forge((*FIELDS[:6], SIZE, SIZE, FIELDS[8])))[0] == E_RANGE
    assert decode(ipc, forge((*FIELDS[:6], 0, 0, FIELDS[8])))[0] == E_RANGE


def test_encode_and_export_refuse_an_offset_outside_the_allocation(ipc: ctypes.CDLL) -> None:
    raw = ctypes.create_string_buffer(64)
    assert ipc.gp_ipc_encode(raw, ctypes.byref(Handle(size=4096, offset=4096))) == E_RANGE
    assert ipc.gp_ipc_encode(raw, ctypes.byref(Handle(size=0))) == E_RANGE
    assert ipc.gp_ipc_export(raw, 0, BASE, 4096, 4096, 1, F_SCM) == E_RANGE


def test_legacy_handles_and_garbage_are_refused(ipc: ctypes.CDLL) -> None:
    """A legacy CUDA handle (opaque driver bytes) must pass through to the real driver, never be taken for ours."""
    rng = random.Random(4)
    blobs = [bytes(64), b"\xff" * 64] + [rng.randbytes(64) for _ in range(2000)]
    assert {decode(ipc, b)[0] for b in blobs} == {E_NOT_OURS}
    with_our_magic = [struct.pack("<IH", MAGIC, VERSION) + rng.randbytes(58) for _ in range(2000)]
    assert {decode(ipc, b)[0] for b in with_our_magic} == {E_CHECKSUM}


def test_transport_setting(ipc: ctypes.CDLL) -> None:
    assert [ipc.gp_ipc_transport(v) for v in (None, b"", b"scm", b"pidfd")] == [F_SCM, F_SCM, F_SCM, F_PIDFD]
    assert ipc.gp_ipc_transport(b"ptrace") == E_TRANSPORT
    assert "GP_IPC_TRANSPORT must be unset, 'scm' or 'pidfd'" in strerror(ipc, E_TRANSPORT)
    raw = ctypes.create_string_buffer(64)
    assert ipc.gp_ipc_export(raw, 0, BASE, SIZE, 0, 1, 3) == E_TRANSPORT


def start_time(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def test_process_start_time(ipc: ctypes.CDLL) -> None:
    got = ctypes.c_uint64()
    assert ipc.gp_proc_start_time(os.getpid(), ctypes.byref(got)) == 0 and got.value == start_time(os.getpid())
    # a command name with spaces and parentheses must not shift the fields
    rename = "import ctypes, time; ctypes.CDLL(None).prctl(15, b'x) (y z', 0, 0, 0); print(1, flush=True)"  # SET_NAME
    odd = subprocess.Popen([sys.executable, "-c", rename + "; time.sleep(30)"], stdout=subprocess.PIPE)
    try:
        assert odd.stdout.readline() == b"1\n" and "(x) (y z)" in Path(f"/proc/{odd.pid}/stat").read_text()
        assert ipc.gp_proc_start_time(odd.pid, ctypes.byref(got)) == 0 and got.value == start_time(odd.pid)
    finally:
        odd.kill()
        odd.wait()
        odd.stdout.close()
    assert ipc.gp_proc_start_time(odd.pid, ctypes.byref(got)) == -errno.ESRCH


# ---- the exporter's server and the importer's fetch, between processes --------------------------------------------

# What the helper processes share with this file: the structures, their ctypes signatures, the test allocation.
PRELUDE = "\n".join(["import ctypes, os, sys, time", f"BASE, SIZE, OFFSET = {BASE}, {SIZE}, {OFFSET}",
                     *(inspect.getsource(o) for o in (Handle, Import, Table, declare))])  # fmt: skip

EXPORTER = r"""
lib = declare(ctypes.CDLL(sys.argv[1]))
transport, export_id = int(sys.argv[2]), int(sys.argv[3])
fd = os.memfd_create("gp-ipc-test")
os.write(fd, b"exported by %d" % os.getpid())
raw = ctypes.create_string_buffer(64)
rc = lib.gp_ipc_export(raw, fd, BASE, SIZE, OFFSET, export_id, transport)
print(f"ready {rc} {raw.raw.hex()} {fd}", flush=True)
for line in sys.stdin:  # commands from the test
    cmd = line.split()
    if cmd[0] == "read":  # what the importer wrote into the shared file
        print(os.pread(fd, 4, 64).decode(), flush=True)
    elif cmd[0] == "unserve":
        lib.gp_ipc_unserve(export_id)
        print("ok", flush=True)
    elif cmd[0] == "fork":  # a child that lives on after this process exits
        r, w = os.pipe()
        if os.fork() == 0:
            mine = set()
            for f in os.listdir("/proc/self/fd"):  # one of them, listdir's own, is gone by now
                try:
                    mine.add(os.readlink(f"/proc/self/fd/{f}"))
                except FileNotFoundError:
                    pass
            name = "@graphpersist-ipc-%d-%08x" % (int(cmd[1]), int(cmd[2]))  # the parent's socket
            listening = [ln.split()[-1] for ln in open("/proc/net/unix") if ln.split()[-1:] == [name]]
            inodes = {ln.split()[6] for ln in open("/proc/net/unix") if ln.split()[-1:] == [name]}
            kept = sorted(i for i in inodes if f"socket:[{i}]" in mine)
            own = ctypes.create_string_buffer(64)
            rc = lib.gp_ipc_export(own, fd, BASE, SIZE, OFFSET, export_id + 1, transport)
            os.write(w, f"child {os.getpid()} {len(listening)} {len(kept)} {rc} {own.raw.hex()}\n".encode())
            os.close(w)
            time.sleep(60)
            os._exit(0)
        os.close(w)
        print(os.read(r, 4096).decode().strip(), flush=True)
    elif cmd[0] == "exit":
        break
"""


Exported = tuple[subprocess.Popen, bytes, int]


@contextlib.contextmanager
def exporter(lib: ctypes.CDLL, transport: int = F_SCM, export_id: int = 0xE1) -> Iterator[Exported]:
    """An exporter process: a memfd exported with gp_ipc_export, as the interposer exports an allocation; yields
    the process, its handle and its fd number."""
    proc = subprocess.Popen([sys.executable, "-c", PRELUDE + EXPORTER, lib._name, str(transport), str(export_id)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        line = proc.stdout.readline().split()
        assert line[:1] == ["ready"], f"exporter died before exporting (exit {proc.wait(timeout=10)})"
        assert int(line[1]) == 0, strerror(lib, int(line[1]))
        yield proc, bytes.fromhex(line[2]), int(line[3])
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        proc.stdin.close()
        proc.stdout.close()


def command(proc: subprocess.Popen, cmd: str) -> str:
    proc.stdin.write(cmd + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def quit_(proc: subprocess.Popen) -> None:
    """A normal exit (so the library's destructor runs), without waiting for output a forked child may hold."""
    proc.stdin.write("exit\n")
    proc.stdin.flush()
    assert proc.wait(timeout=30) == 0


def fetch(lib: ctypes.CDLL, raw: bytes) -> tuple[int, int]:
    rc, h = decode(lib, raw)
    assert rc == 0
    fd = ctypes.c_int(-2)
    return lib.gp_ipc_fetch(ctypes.byref(h), ctypes.byref(fd)), fd.value


def assert_shared_and_outlives(proc: subprocess.Popen, fd: int) -> None:
    """The received fd is the exporter's file (not a copy), and it stays valid after the exporter exits."""
    content = b"exported by %d" % proc.pid
    try:
        assert os.pread(fd, 64, 0) == content
        assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC, "received fds must be close-on-exec"
        os.pwrite(fd, b"pong", 64)
        assert command(proc, "read") == "pong"
        quit_(proc)
        assert os.pread(fd, len(content), 0) == content
    finally:
        os.close(fd)


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(60)
def test_default_transport_serves_the_fd_over_scm_rights(ipc: ctypes.CDLL) -> None:
    with exporter(ipc) as (proc, raw, fd_number):
        rc, h = decode(ipc, raw)
        assert rc == 0 and h.flags == F_SCM and (h.pid, h.export_id) == (proc.pid, 0xE1)
        assert (h.base, h.size, h.offset, h.fd) == (BASE, SIZE, OFFSET, fd_number)
        assert h.start_time == start_time(proc.pid)
        name = f"@graphpersist-ipc-{proc.pid}-{h.token:08x}"
        assert name in Path("/proc/net/unix").read_text().split(), "the server listens on the name the handle gives"
        before = open_fds()
        for _ in range(3):  # the server keeps serving; each fetch is a fresh descriptor
            rc, fd = fetch(ipc, raw)
            assert rc == 0 and fd >= 0, strerror(ipc, rc)
            os.close(fd)
        assert open_fds() == before, "the client socket must be closed"
        rc, fd = fetch(ipc, raw)
        assert rc == 0, strerror(ipc, rc)
        assert_shared_and_outlives(proc, fd)


@pytest.mark.timeout(60)
def test_pidfd_transport_is_opt_in(ipc: ctypes.CDLL) -> None:
    with exporter(ipc, F_PIDFD) as (proc, raw, fd_number):
        rc, h = decode(ipc, raw)
        assert rc == 0 and h.flags == F_PIDFD and h.fd == fd_number
        assert f"@graphpersist-ipc-{proc.pid}-" not in Path("/proc/net/unix").read_text(), "no server for pidfd"
        rc, fd = fetch(ipc, raw)
        if rc == -errno.ENOSYS:
            pytest.skip("kernel lacks pidfd_open/pidfd_getfd (ENOSYS, Linux < 5.6): only SCM_RIGHTS is available")
        assert rc == 0, (
            f"pidfd_getfd refused: {strerror(ipc, rc)}. The importer needs ptrace access to the exporter: same user, "
            "Yama ptrace_scope <= 1, no seccomp filter on pidfd_getfd"
        )
        assert_shared_and_outlives(proc, fd)


SECCOMP_IMPORTER = r"""
import errno, json
sys.path.insert(0, sys.argv[5])
from seccomp_block import block_pidfd_getfd
lib = declare(ctypes.CDLL(sys.argv[1]))
raw, exporter_pid, exporter_fd = bytes.fromhex(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
err = ctypes.c_int()

def pidfd_getfd_errno(pid, fd):
    got = lib.gp_fd_from_pid(pid, fd, ctypes.byref(err))
    if got >= 0:
        os.close(got)
        return 0
    return err.value

out = {"self_before": pidfd_getfd_errno(os.getpid(), 0)}  # the control: allowed before the filter
block_pidfd_getfd()
out["self_after"] = pidfd_getfd_errno(os.getpid(), 0)
out["exporter_pidfd"] = pidfd_getfd_errno(exporter_pid, exporter_fd)
h, fd = Handle(), ctypes.c_int(-1)
assert lib.gp_ipc_decode(raw, ctypes.byref(h)) == 0
out["fetch"] = lib.gp_ipc_fetch(ctypes.byref(h), ctypes.byref(fd))
out["content"] = os.pread(fd.value, 64, 0).decode() if fd.value >= 0 else None
if fd.value >= 0:
    os.pwrite(fd.value, b"seen", 64)
print(json.dumps(out), flush=True)
"""


@pytest.mark.timeout(60)
def test_scm_works_where_pidfd_getfd_is_blocked_by_seccomp(ipc: ctypes.CDLL) -> None:
    """The default transport needs no ptrace: an importer whose pidfd_getfd is refused (container seccomp profiles,
    Yama ptrace_scope 2/3) still gets the exporter's shared memory."""
    if not seccomp_block.supported():
        pytest.skip(f"the seccomp filter of this test knows x86_64 and aarch64, not {platform.machine()}")
    with exporter(ipc) as (proc, raw, fd_number):
        run = subprocess.run([sys.executable, "-c", PRELUDE + SECCOMP_IMPORTER, ipc._name, raw.hex(), str(proc.pid),
                              str(fd_number), str(TESTS)], capture_output=True, text=True, timeout=45)  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        out = json.loads(run.stdout)
        if out["self_before"] == errno.ENOSYS:
            pytest.skip("kernel lacks pidfd_getfd (ENOSYS): the seccomp filter cannot be shown to bite")
        assert out["self_before"] == 0, f"pidfd_getfd on itself fails even without the filter: {out['self_before']}"
        assert (out["self_after"], out["exporter_pidfd"]) == (errno.EPERM, errno.EPERM), "the filter must bite"
        assert out["fetch"] == 0, strerror(ipc, out["fetch"])
        assert out["content"] == f"exported by {proc.pid}"
        assert command(proc, "read") == "seen", "the importer wrote into the exporter's memory"


@pytest.mark.timeout(60)
def test_dead_exporter_and_reused_pid_are_refused(ipc: ctypes.CDLL) -> None:
    with exporter(ipc) as (proc, raw, _):
        _, h = decode(ipc, raw)
        quit_(proc)
    assert fetch(ipc, raw) == (E_PEER_GONE, -1)
    assert "the exporter must be alive" in strerror(ipc, E_PEER_GONE)
    # a live process under the handle's pid whose start time differs: the pid was reused
    other = subprocess.Popen(["sleep", "30"])
    try:
        fields = (MAGIC, VERSION, F_SCM, other.pid, 3, BASE, SIZE, 0, 1)
        reused = forge(fields, token=h.token, start=start_time(other.pid) - 1)
        assert fetch(ipc, reused) == (E_PID_REUSED, -1)
        assert "pid now belongs to another process" in strerror(ipc, E_PID_REUSED)
        pidfd_reused = forge((MAGIC, VERSION, F_PIDFD, *fields[3:]), start=start_time(other.pid) + 7)
        assert fetch(ipc, pidfd_reused) == (E_PID_REUSED, -1)
        # the right start time but nobody serving: the exporter's server is missing, not the exporter
        assert fetch(ipc, forge(fields, token=h.token, start=start_time(other.pid))) == (-errno.ECONNREFUSED, -1)
    finally:
        other.kill()
        other.wait()


@pytest.mark.timeout(60)
def test_a_socket_squatted_by_another_process_is_refused(ipc: ctypes.CDLL) -> None:
    """Only the handle's exporter may answer: a process that binds the name (after the exporter died, say) is an
    impostor, and its descriptor is never accepted."""
    victim = subprocess.Popen(["sleep", "30"])
    try:
        token = random.getrandbits(32)
        ls = ipc.gp_ipc_listen(b"graphpersist-ipc-%d-%08x" % (victim.pid, token))
        assert ls >= 0
        try:
            raw = forge((MAGIC, VERSION, F_SCM, victim.pid, 3, BASE, SIZE, 0, 1), token, start_time(victim.pid))
            before = open_fds()
            assert fetch(ipc, raw) == (E_IMPOSTOR, -1)
            assert open_fds() == before, "the client socket must be closed"
        finally:
            os.close(ls)
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.timeout(60)
def test_unknown_and_freed_exports_get_an_error_answer(ipc: ctypes.CDLL) -> None:
    with exporter(ipc) as (proc, raw, _):
        fields = LAYOUT.unpack(raw)
        other = forge((*fields[:8], fields[8] + 99), token=fields[10], start=fields[11])
        assert fetch(ipc, other) == (E_UNKNOWN, -1)
        assert command(proc, "unserve") == "ok"
        assert fetch(ipc, raw) == (E_UNKNOWN, -1)
        assert "freed since it was exported" in strerror(ipc, E_UNKNOWN)


@pytest.mark.timeout(60)
def test_a_stuck_client_is_dropped_and_the_next_one_served(ipc: ctypes.CDLL) -> None:
    with exporter(ipc) as (proc, raw, _):
        _, h = decode(ipc, raw)
        stuck = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        stuck.connect(b"\0graphpersist-ipc-%d-%08x" % (proc.pid, h.token))
        time.sleep(0.2)  # the server is now waiting for this client's request
        t0 = time.monotonic()
        rc, fd = fetch(ipc, raw)
        took = time.monotonic() - t0
        assert rc == 0, strerror(ipc, rc)
        os.close(fd)
        assert took < SERVER_TIMEOUT_S + 3, f"the next client waited {took:.1f} s"
        stuck.settimeout(10)
        assert stuck.recv(64) == b"", "the server must close a client that never asks"
        stuck.close()


@pytest.mark.timeout(60)
def test_the_server_stops_at_exit_even_with_a_stuck_client(ipc: ctypes.CDLL) -> None:
    with exporter(ipc) as (proc, raw, _):
        _, h = decode(ipc, raw)
        stuck = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        stuck.connect(b"\0graphpersist-ipc-%d-%08x" % (proc.pid, h.token))
        time.sleep(0.2)
        t0 = time.monotonic()
        quit_(proc)
        assert time.monotonic() - t0 < SERVER_TIMEOUT_S, "exit must not wait out a stuck client"
        stuck.settimeout(10)
        assert stuck.recv(64) == b""
        stuck.close()


@pytest.mark.timeout(90)
def test_a_forked_child_neither_serves_nor_keeps_the_parents_socket(ipc: ctypes.CDLL) -> None:
    with exporter(ipc) as (proc, raw, _):
        _, h = decode(ipc, raw)
        child_line = command(proc, f"fork {proc.pid} {h.token}").split()
        assert child_line[0] == "child", child_line
        child = int(child_line[1])
        try:
            listening, kept, rc, child_raw = int(child_line[2]), int(child_line[3]), int(child_line[4]), child_line[5]
            assert listening == 1 and kept == 0, "the child must close the inherited listening socket"
            assert rc == 0, strerror(ipc, rc)
            _, ch = decode(ipc, bytes.fromhex(child_raw))
            assert ch.pid == child and ch.start_time == start_time(child), "a child exports under its own pid"
            rc, fd = fetch(ipc, raw)  # the parent still serves after the fork
            assert rc == 0, strerror(ipc, rc)
            os.close(fd)
            rc, fd = fetch(ipc, bytes.fromhex(child_raw))  # and the child has a server of its own
            assert rc == 0, strerror(ipc, rc)
            assert os.pread(fd, 64, 0) == b"exported by %d" % proc.pid  # the same inherited memfd
            os.close(fd)
            quit_(proc)
            sock = ipc.gp_ipc_connect(b"graphpersist-ipc-%d-%08x" % (proc.pid, h.token))
            assert sock == -errno.ECONNREFUSED, "the parent's socket must die with the parent, child alive or not"
            assert fetch(ipc, raw) == (E_PEER_GONE, -1)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, 9)


# ---- SCM_RIGHTS helpers --------------------------------------------------------------------------------------------


def recv(lib: ctypes.CDLL, sock: int, cap: int = 64) -> tuple[int, int, bytes]:
    fd, buf = ctypes.c_int(-2), ctypes.create_string_buffer(cap)
    n = lib.gp_fd_recv(sock, ctypes.byref(fd), buf, cap)
    return n, fd.value, buf.raw[: max(n, 0)]


def test_fd_passing_over_a_socketpair(ipc: ctypes.CDLL) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    r, w = os.pipe()
    with a, b:
        assert ipc.gp_fd_send(a.fileno(), w, b"pipe", 4) == 0
        n, fd, msg = recv(ipc, b.fileno())
        assert (n, msg) == (4, b"pipe") and fd >= 0 and fd not in (r, w)
        assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC, "received fds must be close-on-exec"
        os.write(fd, b"through the copy")
        assert os.read(r, 64) == b"through the copy"
        os.close(fd)
        assert ipc.gp_fd_send(a.fileno(), -1, b"answer", 6) == 0  # a payload-only message: an error answer
        assert recv(ipc, b.fileno()) == (6, -1, b"answer")
    os.close(r)
    os.close(w)


def test_pidfd_errors_leak_nothing(ipc: ctypes.CDLL) -> None:
    err = ctypes.c_int()
    before = open_fds()
    unused = 1 << 20  # never open (a just-closed number would be reused by the pidfd itself)
    assert ipc.gp_fd_from_pid(os.getpid(), unused, ctypes.byref(err)) == -1
    assert err.value in (errno.EBADF, errno.ENOSYS)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert ipc.gp_fd_from_pid(dead.pid, 0, ctypes.byref(err)) == -1
    assert err.value in (errno.ESRCH, errno.ENOSYS)
    assert open_fds() == before


def test_recv_refuses_malformed_messages_and_closes_what_came(ipc: ctypes.CDLL) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    r, w = os.pipe()
    with a, b:
        before = open_fds()
        socket.send_fds(a, [b"two"], [r, w])
        assert recv(ipc, b.fileno())[:2] == (-errno.EBADMSG, -1)
        socket.send_fds(a, [b"x" * 100], [r])
        assert recv(ipc, b.fileno(), cap=8)[:2] == (-errno.EMSGSIZE, -1)
        assert open_fds() == before, "every descriptor of a refused message must be closed"
        assert ipc.gp_fd_send(a.fileno(), r, b"", 0) == -errno.EINVAL
        a.shutdown(socket.SHUT_WR)
        assert recv(ipc, b.fileno())[:2] == (-errno.ECONNRESET, -1)
    assert ipc.gp_fd_send(a.fileno(), r, b"x", 1) == -errno.EBADF
    c, d = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with c, d:
        d.close()
        assert ipc.gp_fd_send(c.fileno(), r, b"x", 1) == -errno.EPIPE  # and no SIGPIPE
    os.close(r)
    os.close(w)


def test_abstract_socket_helpers_report_errno(ipc: ctypes.CDLL) -> None:
    name = f"graphpersist-ipc-test-{os.getpid()}-{uuid.uuid4().hex[:8]}".encode()
    assert ipc.gp_ipc_connect(name) == -errno.ECONNREFUSED
    ls = ipc.gp_ipc_listen(name)
    assert ls >= 0
    try:
        assert ipc.gp_ipc_listen(name) == -errno.EADDRINUSE
        sock = ipc.gp_ipc_connect(name)
        assert sock >= 0
        pid, uid = ctypes.c_int(), ctypes.c_uint()
        assert ipc.gp_ipc_peer_cred(sock, ctypes.byref(pid), ctypes.byref(uid)) == 0
        assert (pid.value, uid.value) == (os.getpid(), os.geteuid())
        os.close(sock)
    finally:
        os.close(ls)
    assert ipc.gp_ipc_listen(b"x" * 200) == -errno.ENAMETOOLONG
    assert ipc.gp_ipc_listen(b"") == -errno.EINVAL


# ---- ownership state machine ---------------------------------------------------------------------------------------


def walk(lib: ctypes.CDLL, events: list[int]) -> tuple[list[int], int]:
    s = ctypes.c_uint32(EXPORTED)
    return [lib.gp_ipc_transition(ctypes.byref(s), ev) for ev in events], s.value


@pytest.mark.parametrize(
    "path", [[RELEASE], [IMPORT, RELEASE], [IMPORT, MAP, CLOSE]], ids=["fetch-failed", "map-failed", "ipc-close"]
)
def test_every_legal_path_ends_released(ipc: ctypes.CDLL, path: list[int]) -> None:
    assert walk(ipc, path) == ([0] * len(path), RELEASED)


def test_every_other_transition_is_refused(ipc: ctypes.CDLL) -> None:
    """Exhaustive over (state, event), including an uninitialised state and unknown events."""
    for state in range(6):
        for event in range(6):
            s = ctypes.c_uint32(state)
            rc = ipc.gp_ipc_transition(ctypes.byref(s), event)
            want = (0, LEGAL[state, event]) if (state, event) in LEGAL else (E_ILLEGAL, state)
            assert (rc, s.value) == want, (state, event)


def test_named_illegal_transitions(ipc: ctypes.CDLL) -> None:
    assert walk(ipc, [IMPORT, MAP, CLOSE, CLOSE])[0][-1] == E_ILLEGAL
    assert walk(ipc, [IMPORT, RELEASE, MAP])[0][-1] == E_ILLEGAL
    assert walk(ipc, [IMPORT, MAP, MAP])[0][-1] == E_ILLEGAL
    assert walk(ipc, [IMPORT, MAP, RELEASE])[0][-1] == E_ILLEGAL  # CLOSE unmaps first
    assert walk(ipc, [MAP])[0][-1] == E_ILLEGAL


# ---- import table --------------------------------------------------------------------------------------------------


@pytest.fixture
def table() -> Iterator[Table]:  # the interposer's table lives as long as the process; a test's is freed
    t = Table()
    yield t
    libc = ctypes.CDLL(None)
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free(ctypes.cast(t.e, ctypes.c_void_p))


def handle(pid: int = 100, export_id: int = 1, offset: int = 0, size: int = SIZE) -> Handle:
    return Handle(MAGIC, VERSION, 0, pid, 5, BASE, size, offset, export_id)


def open_(lib: ctypes.CDLL, t: Table, h: Handle, map_addr: int = 0x600000000000) -> tuple[int, int]:
    """cuIpcOpenMemHandle as the interposer does it: a new entry is imported and mapped by the caller."""
    created = ctypes.c_int(-1)
    idx = lib.gp_ipc_table_open(ctypes.byref(t), ctypes.byref(h), ctypes.byref(created))
    assert idx >= 0
    if created.value:
        e = t.e[idx]
        state = ctypes.c_uint32(e.state)
        assert lib.gp_ipc_transition(ctypes.byref(state), IMPORT) == 0
        assert lib.gp_ipc_transition(ctypes.byref(state), MAP) == 0
        e.state, e.map_addr = state.value, map_addr
        t.e[idx] = e
    return idx, created.value


def close(lib: ctypes.CDLL, t: Table, ptr: int) -> int:
    return lib.gp_ipc_table_close(ctypes.byref(t), ptr, None)


def test_opening_a_handle_twice_returns_the_same_mapping(ipc: ctypes.CDLL, table: Table) -> None:
    h = handle(offset=4096)
    assert open_(ipc, table, h) == (0, 1)
    assert open_(ipc, table, h, map_addr=0xBAD) == (0, 0)
    assert (table.e[0].refs, table.e[0].map_addr, table.e[0].state) == (2, 0x600000000000, MAPPED)
    ptr = 0x600000000000 + 4096  # what cuIpcOpenMemHandle handed out
    assert close(ipc, table, ptr) == 0
    assert (table.e[0].refs, table.e[0].state) == (1, MAPPED), "still referenced: must stay mapped"
    assert close(ipc, table, ptr) == 1, "last reference: the caller unmaps and releases now"
    assert table.e[0].state == RELEASED
    assert close(ipc, table, ptr) == E_NOT_FOUND
    assert close(ipc, table, 0x600000000000) == E_NOT_FOUND


def test_the_key_is_pid_export_id_and_offset(ipc: ctypes.CDLL, table: Table) -> None:
    assert open_(ipc, table, handle())[1] == 1
    assert open_(ipc, table, handle(offset=4096), 0x610000000000)[1] == 1
    assert open_(ipc, table, handle(export_id=2), 0x620000000000)[1] == 1  # an exporter restarted with this pid
    assert open_(ipc, table, handle(pid=101), 0x630000000000)[1] == 1
    assert table.n == 4
    assert close(ipc, table, 0x600000000000) == 1
    assert open_(ipc, table, handle(), 0x640000000000) == (0, 1), "a released slot is reused, the table stays small"
    for i in range(40):  # growth past the initial capacity keeps entries intact
        open_(ipc, table, handle(export_id=100 + i), 0x700000000000 + (i << 24))
    assert table.e[1].map_addr == 0x610000000000 and table.e[4 + 39].export_id == 139
