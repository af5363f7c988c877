"""VMM-IPC building blocks (native/gp_ipc.c), built with gcc and driven through ctypes, no GPU: the handle codec,
fd passing between real processes (SCM_RIGHTS and pidfd_getfd) and the ownership rules of an IPC mapping."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import random
import shutil
import socket
import struct
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from graphpersist import region

NATIVE = region.NATIVE_DIR
LAYOUT = struct.Struct("<IHHIiQQQQI12x")  # the 64 bytes standing in a CUipcMemHandle
MAGIC, VERSION = 0x47504950, 1
E_NOT_OURS, E_VERSION, E_CHECKSUM, E_RANGE = -201, -202, -203, -204
E_ILLEGAL, E_PEER_GONE, E_NOT_FOUND = -210, -211, -212
EXPORTED, IMPORTED, MAPPED, UNMAPPED, RELEASED = 1, 2, 3, 4, 5
IMPORT, MAP, UNMAP, RELEASE, CLOSE, PEER_EXITED = 1, 2, 3, 4, 5, 6
# (state, event) -> next state; PEER_EXITED is a flag, legal in every live state, and blocks only IMPORT.
LEGAL = {(EXPORTED, IMPORT): IMPORTED, (EXPORTED, RELEASE): RELEASED, (IMPORTED, MAP): MAPPED,
         (IMPORTED, RELEASE): RELEASED, (MAPPED, UNMAP): UNMAPPED, (MAPPED, CLOSE): RELEASED,
         (UNMAPPED, RELEASE): RELEASED}  # fmt: skip
LEGAL |= {(s, PEER_EXITED): s for s in (EXPORTED, IMPORTED, MAPPED, UNMAPPED)}


class Handle(ctypes.Structure):
    _fields_ = [("magic", ctypes.c_uint32), ("version", ctypes.c_uint16), ("flags", ctypes.c_uint16),
                ("pid", ctypes.c_uint32), ("fd", ctypes.c_int32), ("base", ctypes.c_uint64),
                ("size", ctypes.c_uint64), ("offset", ctypes.c_uint64), ("export_id", ctypes.c_uint64),
                ("checksum", ctypes.c_uint32), ("reserved", ctypes.c_uint8 * 12)]  # fmt: skip


class State(ctypes.Structure):
    _fields_ = [("state", ctypes.c_uint32), ("peer_exited", ctypes.c_uint32)]


class Import(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint32), ("refs", ctypes.c_uint32), ("export_id", ctypes.c_uint64),
                ("offset", ctypes.c_uint64), ("size", ctypes.c_uint64), ("cu_handle", ctypes.c_uint64),
                ("map_addr", ctypes.c_uint64), ("st", State)]  # fmt: skip


class Table(ctypes.Structure):
    _fields_ = [("e", ctypes.POINTER(Import)), ("n", ctypes.c_size_t), ("cap", ctypes.c_size_t)]


@pytest.fixture(scope="module")
def ipc(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    out = tmp_path_factory.mktemp("gpipc") / "libgpipc_test.so"
    subprocess.run(["gcc", "-O2", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror", "-o", str(out),
                    str(NATIVE / "gp_ipc.c")], check=True)  # fmt: skip
    lib = ctypes.CDLL(str(out))
    u64, p = ctypes.c_uint64, ctypes.POINTER
    lib.gp_ipc_handle_size.restype = lib.gp_ipc_import_size.restype = ctypes.c_size_t
    lib.gp_ipc_encode.argtypes = [ctypes.c_char_p, ctypes.c_uint32, ctypes.c_int32, u64, u64, u64, u64,
                                  ctypes.c_uint16]  # fmt: skip
    lib.gp_ipc_decode.argtypes = [ctypes.c_char_p, p(Handle)]
    lib.gp_fd_from_pid.argtypes = [ctypes.c_int, ctypes.c_int, p(ctypes.c_int)]
    lib.gp_fd_send.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    lib.gp_fd_recv.argtypes = [ctypes.c_int, p(ctypes.c_int), ctypes.c_char_p, ctypes.c_size_t]
    lib.gp_ipc_listen.argtypes = lib.gp_ipc_connect.argtypes = [ctypes.c_char_p]
    lib.gp_ipc_peer_cred.argtypes = [ctypes.c_int, p(ctypes.c_int), p(ctypes.c_uint)]
    lib.gp_ipc_transition.argtypes = [p(State), ctypes.c_int]
    lib.gp_ipc_table_open.restype = ctypes.c_long
    lib.gp_ipc_table_open.argtypes = [p(Table), p(Handle), p(ctypes.c_int)]
    lib.gp_ipc_table_close.argtypes = [p(Table), u64, p(ctypes.c_long)]
    lib.gp_ipc_table_peer_exited.restype = ctypes.c_size_t
    lib.gp_ipc_table_peer_exited.argtypes = [p(Table), ctypes.c_uint32]
    lib.gp_ipc_table_free.argtypes = [p(Table)]
    return lib


def fnv1a(data: bytes) -> int:
    h = 2166136261
    for b in data:
        h = ((h ^ b) * 16777619) & 0xFFFFFFFF
    return h


def encode(lib: ctypes.CDLL, pid: int = 4242, fd: int = 7, base: int = 0x7F0000000000, size: int = 2 << 20,
           offset: int = 4096, export_id: int = 0x1234_5678_9ABC_DEF0, flags: int = 3) -> bytes:  # fmt: skip
    raw = ctypes.create_string_buffer(64)
    assert lib.gp_ipc_encode(raw, pid, fd, base, size, offset, export_id, flags) == 0
    return raw.raw


def decode(lib: ctypes.CDLL, raw: bytes) -> tuple[int, Handle]:
    h = Handle()
    return lib.gp_ipc_decode(raw, ctypes.byref(h)), h


def forge(fields: tuple) -> bytes:
    """A handle with a valid checksum for whatever fields: only the semantic checks can refuse it."""
    raw = bytearray(LAYOUT.pack(*fields[:9], 0))
    struct.pack_into("<I", raw, 48, fnv1a(raw[:48] + raw[52:]))
    return bytes(raw)


# ---- handle codec -------------------------------------------------------------------------------------------------


def test_handle_fills_a_cuipcmemhandle_exactly(ipc: ctypes.CDLL) -> None:
    assert ipc.gp_ipc_handle_size() == ctypes.sizeof(Handle) == LAYOUT.size == 64


def test_handle_round_trip_and_layout(ipc: ctypes.CDLL) -> None:
    raw = encode(ipc)
    rc, h = decode(ipc, raw)
    assert rc == 0
    got = (h.magic, h.version, h.flags, h.pid, h.fd, h.base, h.size, h.offset, h.export_id)
    assert got == (MAGIC, VERSION, 3, 4242, 7, 0x7F0000000000, 2 << 20, 4096, 0x1234_5678_9ABC_DEF0)
    assert LAYOUT.unpack(raw)[:9] == got  # the layout Python readers (inspect tools) may rely on
    assert LAYOUT.unpack(raw)[9] == fnv1a(raw[:48] + raw[52:])
    assert raw == forge(got)


def test_decode_refuses_each_problem_with_its_own_code(ipc: ctypes.CDLL) -> None:
    fields = LAYOUT.unpack(encode(ipc))
    wrong_magic = bytearray(encode(ipc))
    wrong_magic[0] ^= 1
    assert decode(ipc, bytes(wrong_magic))[0] == E_NOT_OURS
    assert decode(ipc, forge((MAGIC, 2, *fields[2:])))[0] == E_VERSION
    for at in (6, 8, 12, 16, 24, 32, 40, 48, 52, 63):  # any flipped bit outside the magic and version
        corrupt = bytearray(encode(ipc))
        corrupt[at] ^= 0x10
        assert decode(ipc, bytes(corrupt))[0] == E_CHECKSUM, at
    offset_past_end = (*fields[:6], 2 << 20, 2 << 20, fields[8])
    assert decode(ipc, forge(offset_past_end))[0] == E_RANGE
    assert decode(ipc, forge((*fields[:6], 0, 0, fields[8])))[0] == E_RANGE


def test_encode_refuses_an_offset_outside_the_allocation(ipc: ctypes.CDLL) -> None:
    raw = ctypes.create_string_buffer(64)
    assert ipc.gp_ipc_encode(raw, 1, 3, 0x1000, 4096, 4096, 1, 0) == E_RANGE
    assert ipc.gp_ipc_encode(raw, 1, 3, 0x1000, 0, 0, 1, 0) == E_RANGE


def test_legacy_handles_and_garbage_are_refused(ipc: ctypes.CDLL) -> None:
    """A legacy CUDA handle (opaque driver bytes) must pass through to the real driver, never be taken for ours."""
    rng = random.Random(4)
    blobs = [bytes(64), b"\xff" * 64] + [rng.randbytes(64) for _ in range(2000)]
    assert {decode(ipc, b)[0] for b in blobs} == {E_NOT_OURS}
    with_our_magic = [struct.pack("<IH", MAGIC, VERSION) + rng.randbytes(58) for _ in range(2000)]
    assert {decode(ipc, b)[0] for b in with_our_magic} == {E_CHECKSUM}


# ---- fd passing between processes ---------------------------------------------------------------------------------

EXPORTER = r"""
import ctypes, os, sys
lib = ctypes.CDLL(sys.argv[1])
mode, arg = sys.argv[2], sys.argv[3]
fd = os.memfd_create("gp-ipc-test")
os.write(fd, b"exported by %d" % os.getpid())
if mode == "scm":  # serve the fd on the abstract socket `arg`, telling the peer what pid it saw
    ls = lib.gp_ipc_listen(arg.encode())
    assert ls >= 0, ls
    print("ready", flush=True)
    conn = lib.gp_ipc_accept(ls)
    pid, uid = ctypes.c_int(), ctypes.c_uint()
    assert lib.gp_ipc_peer_cred(conn, ctypes.byref(pid), ctypes.byref(uid)) == 0 and uid.value == os.getuid()
    msg = b"peer %d" % pid.value
    assert lib.gp_fd_send(conn, fd, msg, len(msg)) == 0
elif mode == "pair":  # `arg`: an inherited socketpair end
    assert lib.gp_fd_send(int(arg), fd, b"pair", 4) == 0
    print("ready", flush=True)
elif mode == "pidfd":
    assert lib.gp_allow_peer_getfd() == 0
    print(f"ready {os.getpid()} {fd}", flush=True)
sys.stdin.readline()  # the importer has written into the file
print(os.pread(fd, 4, 64).decode(), flush=True)
"""


@contextlib.contextmanager
def exporter(lib: ctypes.CDLL, mode: str, arg: str, pass_fds: tuple[int, ...] = ()) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen([sys.executable, "-c", EXPORTER, lib._name, mode, arg], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, pass_fds=pass_fds)  # fmt: skip
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        proc.stdin.close()
        proc.stdout.close()


def ready(proc: subprocess.Popen) -> list[str]:
    line = proc.stdout.readline().split()
    assert line[:1] == ["ready"], f"exporter died before serving (exit {proc.wait(timeout=10)})"
    return line[1:]


def assert_shared_and_outlives(proc: subprocess.Popen, fd: int) -> None:
    """The received fd is the exporter's file (not a copy), and it stays valid after the exporter exits."""
    content = b"exported by %d" % proc.pid
    try:
        assert os.pread(fd, 64, 0) == content
        assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC, "received fds must be close-on-exec"
        os.pwrite(fd, b"pong", 64)
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "pong"
        assert proc.wait(timeout=30) == 0
        assert os.pread(fd, len(content), 0) == content
    finally:
        os.close(fd)


def recv(lib: ctypes.CDLL, sock: int, cap: int = 64) -> tuple[int, int, bytes]:
    fd, buf = ctypes.c_int(-2), ctypes.create_string_buffer(cap)
    n = lib.gp_fd_recv(sock, ctypes.byref(fd), buf, cap)
    return n, fd.value, buf.raw[: max(n, 0)]


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(60)
def test_scm_rights_over_an_abstract_socket(ipc: ctypes.CDLL) -> None:
    name = f"graphpersist-ipc-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with exporter(ipc, "scm", name) as proc:
        ready(proc)
        sock = ipc.gp_ipc_connect(name.encode())
        assert sock >= 0, os.strerror(-sock)
        try:
            pid, uid = ctypes.c_int(), ctypes.c_uint()
            assert ipc.gp_ipc_peer_cred(sock, ctypes.byref(pid), ctypes.byref(uid)) == 0
            assert (pid.value, uid.value) == (proc.pid, os.getuid())
            n, fd, msg = recv(ipc, sock)
            assert (n, msg) == (len(msg), b"peer %d" % os.getpid()) and fd >= 0
            assert_shared_and_outlives(proc, fd)
        finally:
            os.close(sock)


@pytest.mark.timeout(60)
def test_scm_rights_over_a_socketpair(ipc: ctypes.CDLL) -> None:
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with mine, exporter(ipc, "pair", str(theirs.fileno()), pass_fds=(theirs.fileno(),)) as proc:
        theirs.close()
        ready(proc)
        n, fd, msg = recv(ipc, mine.fileno())
        assert (n, msg) == (4, b"pair") and fd >= 0
        assert_shared_and_outlives(proc, fd)


@pytest.mark.timeout(60)
def test_pidfd_getfd_from_a_peer(ipc: ctypes.CDLL) -> None:
    with exporter(ipc, "pidfd", "-") as proc:
        pid, fd_number = map(int, ready(proc))
        err = ctypes.c_int()
        before = open_fds()
        fd = ipc.gp_fd_from_pid(pid, fd_number, ctypes.byref(err))
        if fd < 0 and err.value == errno.ENOSYS:
            pytest.skip("kernel lacks pidfd_open/pidfd_getfd (ENOSYS, Linux < 5.6): only SCM_RIGHTS is available")
        assert fd >= 0, (
            f"pidfd_getfd({pid}, {fd_number}) refused: {os.strerror(err.value)}. The importer needs ptrace access to "
            "the exporter: same user, Yama ptrace_scope <= 1 (the exporter calls gp_allow_peer_getfd), no seccomp "
            "filter on pidfd_getfd"
        )  # fmt: skip
        assert open_fds() - before == {str(fd)}, "the pidfd must be closed"
        assert_shared_and_outlives(proc, fd)


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
        a.send(b"no fd")
        assert recv(ipc, b.fileno())[:2] == (-errno.EBADMSG, -1)
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
    finally:
        os.close(ls)
    assert ipc.gp_ipc_listen(b"x" * 200) == -errno.ENAMETOOLONG
    assert ipc.gp_ipc_listen(b"") == -errno.EINVAL


# ---- ownership state machine ---------------------------------------------------------------------------------------


def walk(lib: ctypes.CDLL, events: list[int]) -> tuple[list[int], State]:
    s = State(EXPORTED, 0)
    return [lib.gp_ipc_transition(ctypes.byref(s), ev) for ev in events], s


@pytest.mark.parametrize(
    "path",
    [[RELEASE], [IMPORT, RELEASE], [IMPORT, MAP, UNMAP, RELEASE], [IMPORT, MAP, CLOSE]],
    ids=["exporter-frees", "map-failed", "unmap-then-release", "ipc-close"],
)
def test_every_legal_path_ends_released(ipc: ctypes.CDLL, path: list[int]) -> None:
    rcs, s = walk(ipc, path)
    assert rcs == [0] * len(path) and (s.state, s.peer_exited) == (RELEASED, 0)
    for at in range(1 if path[0] == IMPORT else 0, len(path)):  # the exporter may exit at any point after import
        rcs, s = walk(ipc, [*path[:at], PEER_EXITED, *path[at:]])
        assert rcs == [0] * (len(path) + 1) and (s.state, s.peer_exited) == (RELEASED, 1)


def test_every_other_transition_is_refused(ipc: ctypes.CDLL) -> None:
    """Exhaustive over (state, peer exited, event), including an uninitialised state and unknown events."""
    for state in range(7):
        for exited in (0, 1):
            for event in range(8):
                s = State(state, exited)
                rc = ipc.gp_ipc_transition(ctypes.byref(s), event)
                if (state, event) in LEGAL and not (exited and event == IMPORT):
                    want = (0, LEGAL[state, event], 1 if event == PEER_EXITED else exited)
                elif (state, event) in LEGAL:
                    want = (E_PEER_GONE, state, exited)
                else:
                    want = (E_ILLEGAL, state, exited)
                assert (rc, s.state, s.peer_exited) == want, (state, exited, event)


def test_named_illegal_transitions(ipc: ctypes.CDLL) -> None:
    assert walk(ipc, [IMPORT, MAP, CLOSE, CLOSE])[0][-1] == E_ILLEGAL
    assert walk(ipc, [IMPORT, RELEASE, MAP])[0][-1] == E_ILLEGAL
    assert walk(ipc, [IMPORT, MAP, MAP])[0][-1] == E_ILLEGAL
    assert walk(ipc, [IMPORT, MAP, RELEASE])[0][-1] == E_ILLEGAL  # unmap first
    assert walk(ipc, [IMPORT, MAP, UNMAP, MAP])[0][-1] == E_ILLEGAL
    assert walk(ipc, [PEER_EXITED, IMPORT])[0][-1] == E_PEER_GONE


def test_peer_exit_keeps_a_mapping_usable_until_close(ipc: ctypes.CDLL) -> None:
    rcs, s = walk(ipc, [IMPORT, MAP, PEER_EXITED])
    assert rcs == [0, 0, 0] and (s.state, s.peer_exited) == (MAPPED, 1)
    assert ipc.gp_ipc_transition(ctypes.byref(s), CLOSE) == 0 and s.state == RELEASED


# ---- import table --------------------------------------------------------------------------------------------------


@pytest.fixture
def table(ipc: ctypes.CDLL) -> Iterator[Table]:
    t = Table()
    yield t
    ipc.gp_ipc_table_free(ctypes.byref(t))


def handle(pid: int = 100, export_id: int = 1, offset: int = 0, size: int = 2 << 20) -> Handle:
    return Handle(MAGIC, VERSION, 0, pid, 5, 0x7F0000000000, size, offset, export_id)


def open_(lib: ctypes.CDLL, t: Table, h: Handle, map_addr: int = 0x600000000000) -> tuple[int, int]:
    """cuIpcOpenMemHandle as the interposer will do it: a new entry is imported and mapped by the caller."""
    created = ctypes.c_int(-1)
    idx = lib.gp_ipc_table_open(ctypes.byref(t), ctypes.byref(h), ctypes.byref(created))
    assert idx >= 0
    if created.value:
        e = t.e[idx]
        assert lib.gp_ipc_transition(ctypes.byref(e.st), IMPORT) == 0
        e.map_addr = map_addr
        assert lib.gp_ipc_transition(ctypes.byref(e.st), MAP) == 0
    return idx, created.value


def close(lib: ctypes.CDLL, t: Table, ptr: int) -> int:
    return lib.gp_ipc_table_close(ctypes.byref(t), ptr, None)


def test_opening_a_handle_twice_returns_the_same_mapping(ipc: ctypes.CDLL, table: Table) -> None:
    h = handle(offset=4096)
    assert open_(ipc, table, h) == (0, 1)
    assert open_(ipc, table, h, map_addr=0xBAD) == (0, 0)
    e = table.e[0]
    assert (e.refs, e.map_addr, e.st.state) == (2, 0x600000000000, MAPPED)
    ptr = 0x600000000000 + 4096  # what cuIpcOpenMemHandle handed out
    assert close(ipc, table, ptr) == 0
    assert (e.refs, e.st.state) == (1, MAPPED), "still referenced: must stay mapped"
    assert close(ipc, table, ptr) == 1, "last reference: the caller unmaps and releases now"
    assert e.st.state == RELEASED
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


def test_peer_exit_leaves_live_mappings_usable(ipc: ctypes.CDLL, table: Table) -> None:
    open_(ipc, table, handle())
    open_(ipc, table, handle(pid=101), 0x610000000000)
    created = ctypes.c_int()
    pending = ipc.gp_ipc_table_open(ctypes.byref(table), ctypes.byref(handle(export_id=9)), ctypes.byref(created))
    assert ipc.gp_ipc_table_peer_exited(ctypes.byref(table), 100) == 2
    assert (table.e[0].st.state, table.e[0].st.peer_exited) == (MAPPED, 1)
    assert table.e[1].st.peer_exited == 0
    assert ipc.gp_ipc_transition(ctypes.byref(table.e[pending].st), IMPORT) == E_PEER_GONE
    assert open_(ipc, table, handle()) == (0, 0), "the mapping still holds the memory: reopening shares it"
    assert close(ipc, table, 0x600000000000) == 0
    assert close(ipc, table, 0x600000000000) == 1 and table.e[0].st.state == RELEASED


def test_import_record_size_matches(ipc: ctypes.CDLL) -> None:
    assert ipc.gp_ipc_import_size() == ctypes.sizeof(Import)
