/* VMM-IPC building blocks for the interposer (DESIGN.md point 4), pure C without CUDA so a CPU test can drive them.
 * Legacy CUDA IPC handles do not work on cuMem allocations, so inside the region cuIpcGetMemHandle writes our own
 * 64-byte handle (gp_ipc_export), the importer fetches a duplicate of the exporter's POSIX fd (gp_ipc_fetch),
 * imports it and maps it where it chooses.
 *
 * Transports (GP_IPC_TRANSPORT, read by the exporter; the handle carries the choice in its flags):
 *  - "scm" (default): the exporter runs one server thread, started at its first export, on the abstract Unix socket
 *    GP_IPC_SOCK_FMT(pid, token) (token: random per process, stored in the handle). An importer connects, checks
 *    that the socket is served by the exporter (SO_PEERCRED pid and uid, and the pid's start time), asks for an
 *    export id and gets the fd over SCM_RIGHTS, or an error code. The server serves only its own user (SO_PEERCRED
 *    uid) and only exports still registered (gp_ipc_unserve at free). Nothing about the process is opened to ptrace,
 *    so this works under Yama ptrace_scope 2/3 and container seccomp profiles that refuse pidfd_getfd.
 *  - "pidfd" (opt-in): the importer takes the fd with pidfd_getfd; only then does the exporter call
 *    PR_SET_PTRACER_ANY (every same-user process may then ptrace it, for its whole life).
 *
 * The server thread: never calls CUDA and never takes the interposer's lock (only its own registry mutex, held to
 * look up and dup one fd), so it cannot block the exporter's CUDA calls; serves one client at a time, giving each
 * GP_IPC_SERVER_TIMEOUT_MS to send its request; runs with every signal blocked; stops at exit (a destructor wakes
 * and joins it). Fork: the thread does not exist in a child, and a child must not keep the listening socket alive
 * after the exporter exits (importers would then connect and wait for nobody), so a pthread_atfork child handler
 * closes the inherited server sockets and forgets the registry; a child that exports starts its own server under
 * its own pid and token.
 *
 * Pid reuse: the handle carries the exporter's start time (field 22 of /proc/<pid>/stat); gp_ipc_fetch refuses a
 * handle whose pid now belongs to another process (GP_IPC_E_PID_REUSED), before and after fetching the fd.
 *
 * Ownership of one IPC mapping (the rules gp_ipc_transition enforces):
 *  - The exporter creates the memory (its own cuMemCreate + map) and, on cuIpcGetMemHandle, exports one fd for the
 *    whole allocation (cuMemExportToShareableHandle) and registers it with its server. It unregisters and closes
 *    that fd when it frees the allocation. Nothing else ties the exporter to the importers.
 *  - The importer, in its own process, receives a duplicate of the fd (EXPORTED -> IMPORT -> IMPORTED; it closes
 *    its fd copy right after), maps the allocation at an address of its choice (MAP -> MAPPED) and hands out
 *    base + offset. Only the importer unmaps its mapping and releases its imported handle: CLOSE
 *    (cuIpcCloseMemHandle, MAPPED -> RELEASED); an import that failed is released from EXPORTED or IMPORTED.
 *  - Physical memory lives until every handle is released and every mapping unmapped, in every process: a live
 *    mapping keeps working after the exporter exits; a new fetch from a dead exporter fails (GP_IPC_E_PEER_GONE).
 *  - Illegal: any event from RELEASED (so CLOSE twice), MAP twice, RELEASE while MAPPED (CLOSE unmaps first), MAP
 *    before IMPORT, IMPORT twice, any event on an uninitialised (zero) state.
 *  - cuIpcOpenMemHandle of an already open handle returns the same mapping: the import table counts references
 *    per (exporter pid, export id, offset) and only the last close unmaps. The table is not locked: the interposer
 *    holds its lock across open + import + map and across close + unmap.
 *
 * fd functions return -errno (gp_fd_from_pid: -1 with *err) and close every descriptor they opened on errors. */
#ifndef GP_IPC_H
#define GP_IPC_H
#include <assert.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define GP_IPC_MAGIC 0x47504950u /* 'GPIP' */
#define GP_IPC_VERSION 2
#define GP_IPC_F_PIDFD 1u /* the importer fetches `fd` with pidfd_getfd */
#define GP_IPC_F_SCM 2u   /* the exporter serves the fd on GP_IPC_SOCK_FMT(pid, token) */
#define GP_IPC_SOCK_FMT "graphpersist-ipc-%u-%08x"
#define GP_IPC_SERVER_TIMEOUT_MS 2000 /* a client that sends no request in this time is dropped */
#define GP_IPC_CLIENT_TIMEOUT_MS 20000 /* an importer waits this long for the server's answer */

/* Results in a range of their own so they never read as -errno. */
enum {
    GP_IPC_E_NOT_OURS = -201,   /* wrong magic: a legacy CUDA handle or garbage */
    GP_IPC_E_VERSION = -202,    /* ours, from another graphpersist version */
    GP_IPC_E_CHECKSUM = -203,   /* ours, but corrupted */
    GP_IPC_E_RANGE = -204,      /* offset outside the allocation, or an empty allocation */
    GP_IPC_E_ILLEGAL = -210,    /* event not allowed in this state (or unknown event / state) */
    GP_IPC_E_PEER_GONE = -211,  /* the exporter has exited */
    GP_IPC_E_NOT_FOUND = -212,  /* close of a pointer the table did not hand out */
    GP_IPC_E_NOMEM = -213,
    GP_IPC_E_PID_REUSED = -214, /* the handle's pid belongs to another process now */
    GP_IPC_E_UNKNOWN = -215,    /* the exporter does not serve this export (freed, or never exported) */
    GP_IPC_E_DENIED = -216,     /* the exporter refused: another user */
    GP_IPC_E_IMPOSTOR = -217,   /* the socket is served by another process or user than the handle's exporter */
    GP_IPC_E_TRANSPORT = -218,  /* unknown GP_IPC_TRANSPORT, or a handle naming no transport */
    GP_IPC_E_PROTOCOL = -219    /* a malformed request or answer */
};

/* Stands in the 64 opaque bytes of a CUipcMemHandle; native byte order (both ends share one host). */
typedef struct {
    uint32_t magic;       /*  0 GP_IPC_MAGIC */
    uint16_t version;     /*  4 GP_IPC_VERSION */
    uint16_t flags;       /*  6 GP_IPC_F_*: exactly one transport */
    uint32_t pid;         /*  8 exporter pid */
    int32_t fd;           /* 12 exporter's fd number of the exported allocation (pidfd transport) */
    uint64_t base;        /* 16 exporter's address of the allocation */
    uint64_t size;        /* 24 bytes of the whole cuMem allocation */
    uint64_t offset;      /* 32 requested pointer - base */
    uint64_t export_id;   /* 40 unique per export: what the importer asks the server for */
    uint32_t checksum;    /* 48 FNV-1a of bytes 0..47 and 52..63 */
    uint32_t token;       /* 52 exporter's server socket token (scm transport) */
    uint64_t start_time;  /* 56 exporter's start time (clock ticks after boot, /proc/<pid>/stat field 22) */
} gp_ipc_handle_t;
static_assert(sizeof(gp_ipc_handle_t) == 64, "gp_ipc_handle_t must fill a CUipcMemHandle exactly");
static_assert(offsetof(gp_ipc_handle_t, checksum) == 48, "gp_ipc_handle_t layout");

/* Writes *h to raw64 with magic, version and checksum set; 0, or GP_IPC_E_RANGE when offset >= size. */
int gp_ipc_encode(void *raw64, const gp_ipc_handle_t *h);
/* 0 and *out filled, or GP_IPC_E_NOT_OURS / _VERSION / _CHECKSUM / _RANGE (checked in that order). */
int gp_ipc_decode(const void *raw64, gp_ipc_handle_t *out);
/* What follows GP_IPC_TRANSPORT: GP_IPC_F_SCM for NULL, "" or "scm", GP_IPC_F_PIDFD for "pidfd", else
 * GP_IPC_E_TRANSPORT. */
int gp_ipc_transport(const char *value);
/* Exporter: a handle for `fd` (this process's export of an allocation) written to raw64. scm registers the fd with
 * the server (starting it); pidfd allows peers to ptrace this process. 0 or a negative code. */
int gp_ipc_export(void *raw64, int fd, uint64_t base, uint64_t size, uint64_t offset, uint64_t export_id,
                  int transport);
/* Exporter: the server stops serving export_id; call before closing its fd. */
void gp_ipc_unserve(uint64_t export_id);
/* Importer: a duplicate of the handle's fd (close-on-exec) in *fd, through the handle's transport; 0 or a negative
 * code (GP_IPC_E_PEER_GONE, _PID_REUSED, _UNKNOWN, _DENIED, _IMPOSTOR, _TRANSPORT, _PROTOCOL, -errno). */
int gp_ipc_fetch(const gp_ipc_handle_t *h, int *fd);
/* A sentence for a code of this header or a -errno. */
const char *gp_ipc_strerror(int code);
/* Start time of `pid` (field 22 of /proc/<pid>/stat) in *out; 0, -ESRCH when there is no such process, or -errno. */
int gp_proc_start_time(pid_t pid, uint64_t *out);

/* pidfd path: a duplicate of `fd` of process `pid` (close-on-exec), or -1 with *err = errno. Needs ptrace access to
 * `pid` (same user; under Yama ptrace_scope=1 the target must have exported with the pidfd transport). */
int gp_fd_from_pid(pid_t pid, int fd, int *err);

/* SCM_RIGHTS: at most one fd plus a payload of 1..len bytes per message (SOCK_SEQPACKET keeps boundaries).
 * send: 0 or -errno. recv: payload bytes and *fd (close-on-exec; -1 for a message without fd, such as an error
 * answer), or -errno with *fd = -1: -EBADMSG for a message with more than one fd (all received fds are closed),
 * -EMSGSIZE for a payload larger than cap, -ECONNRESET at EOF. */
int gp_fd_send(int sock, int fd, const void *msg, size_t len);
int gp_fd_recv(int sock, int *fd, void *msg, size_t cap);
/* Abstract-namespace SOCK_SEQPACKET sockets named by `name` (no filesystem entry, gone with the process). */
int gp_ipc_listen(const char *name);
int gp_ipc_connect(const char *name);
/* The connected peer's pid and uid (SO_PEERCRED; a client sees the listener's). 0 or -errno. */
int gp_ipc_peer_cred(int sock, pid_t *pid, uid_t *uid);

enum { GP_IPC_EXPORTED = 1, GP_IPC_IMPORTED, GP_IPC_MAPPED, GP_IPC_RELEASED };
enum { GP_IPC_EV_IMPORT = 1, GP_IPC_EV_MAP, GP_IPC_EV_RELEASE, GP_IPC_EV_CLOSE };

/* 0, or GP_IPC_E_ILLEGAL with *state unchanged; state 0 is uninitialised and refuses every event. */
int gp_ipc_transition(uint32_t *state, int event);

typedef struct {
    uint32_t pid, refs;
    uint64_t export_id, offset, size;
    uint64_t cu_handle; /* importer's CUmemGenericAllocationHandle, set by the caller after IMPORT */
    uint64_t map_addr;  /* importer's mapping of the whole allocation, set by the caller with MAP; the user
                           pointer is map_addr + offset */
    uint32_t state;     /* GP_IPC_EXPORTED.. */
    uint32_t pad;
} gp_ipc_import_t;

typedef struct {
    gp_ipc_import_t *e;
    size_t n, cap;
} gp_ipc_table_t;

/* Index of the MAPPED import of this handle with one more reference (*created = 0), else of a new EXPORTED entry
 * with one reference (*created = 1) that the caller imports and maps. GP_IPC_E_NOMEM on allocation failure. */
long gp_ipc_table_open(gp_ipc_table_t *t, const gp_ipc_handle_t *h, int *created);
/* Drops one reference of the import handing out `ptr`: 0 still referenced, 1 the last one (CLOSE applied, the
 * caller now unmaps and releases), GP_IPC_E_NOT_FOUND otherwise. *idx gets the entry (may be NULL). */
int gp_ipc_table_close(gp_ipc_table_t *t, uint64_t ptr, long *idx);
#endif
