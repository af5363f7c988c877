/* VMM-IPC building blocks for the interposer (DESIGN.md point 4), pure C without CUDA so a CPU test can drive them.
 * Legacy CUDA IPC handles do not work on cuMem allocations, so inside the region cuIpcGetMemHandle writes our own
 * 64-byte handle, the importer fetches the exporter's POSIX fd (pidfd_getfd, or SCM_RIGHTS over an abstract Unix
 * socket), imports it and maps it where it chooses.
 *
 * Ownership of one IPC mapping (the rules gp_ipc_transition enforces):
 *  - The exporter creates the memory (its own cuMemCreate + map) and, on cuIpcGetMemHandle, exports one fd for the
 *    whole allocation (cuMemExportToShareableHandle): EXPORTED. It keeps that fd open until it frees the allocation,
 *    then closes it (RELEASE from EXPORTED). Nothing else ties the exporter to the importers.
 *  - The importer, in its own process, receives a duplicate of the fd and imports it (IMPORT -> IMPORTED; it may
 *    close its fd copy right after), maps the allocation at an address of its choice (MAP -> MAPPED) and hands out
 *    base + offset. Only the importer unmaps its mapping (UNMAP -> UNMAPPED) and then releases its imported handle
 *    (RELEASE -> RELEASED); an import whose map failed is released straight from IMPORTED.
 *  - CLOSE is cuIpcCloseMemHandle: unmap + release of a MAPPED import in one step (MAPPED -> RELEASED).
 *  - Physical memory lives until every handle is released and every mapping unmapped, in every process. So
 *    PEER_EXITED (the exporter is gone) only sets a flag: a live mapping keeps working until the importer closes it.
 *    What it forbids is a new IMPORT, since the fd cannot be fetched from a dead process.
 *  - Illegal: any event from RELEASED (so CLOSE twice), MAP twice, MAP after UNMAP (we never remap), RELEASE while
 *    MAPPED (unmap first), UNMAP before MAP, IMPORT twice, any event on an uninitialised (zero) state.
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
#define GP_IPC_VERSION 1
#define GP_IPC_F_PIDFD 1u /* the importer may fetch `fd` with pidfd_getfd */
#define GP_IPC_F_SCM 2u   /* the exporter serves the fd on GP_IPC_SOCK_FMT(pid) */
#define GP_IPC_SOCK_FMT "graphpersist-ipc-%d"

/* Codec and state-machine results; a range of their own so they never read as -errno. */
enum {
    GP_IPC_E_NOT_OURS = -201,  /* wrong magic: a legacy CUDA handle or garbage */
    GP_IPC_E_VERSION = -202,   /* ours, from another graphpersist version */
    GP_IPC_E_CHECKSUM = -203,  /* ours, but corrupted */
    GP_IPC_E_RANGE = -204,     /* offset outside the allocation, or an empty allocation */
    GP_IPC_E_ILLEGAL = -210,   /* event not allowed in this state (or unknown event / state) */
    GP_IPC_E_PEER_GONE = -211, /* IMPORT after the exporter exited */
    GP_IPC_E_NOT_FOUND = -212, /* close of a pointer the table did not hand out */
    GP_IPC_E_NOMEM = -213
};

/* Stands in the 64 opaque bytes of a CUipcMemHandle; native byte order (both ends share one host). */
typedef struct {
    uint32_t magic;       /*  0 GP_IPC_MAGIC */
    uint16_t version;     /*  4 GP_IPC_VERSION */
    uint16_t flags;       /*  6 GP_IPC_F_* */
    uint32_t pid;         /*  8 exporter pid */
    int32_t fd;           /* 12 exporter's fd number of the exported allocation */
    uint64_t base;        /* 16 exporter's address of the allocation */
    uint64_t size;        /* 24 bytes of the whole cuMem allocation */
    uint64_t offset;      /* 32 requested pointer - base */
    uint64_t export_id;   /* 40 unique per export: a reused pid or fd number does not match */
    uint32_t checksum;    /* 48 FNV-1a of bytes 0..47 and 52..63 */
    uint8_t reserved[12]; /* 52 zero */
} gp_ipc_handle_t;
static_assert(sizeof(gp_ipc_handle_t) == 64, "gp_ipc_handle_t must fill a CUipcMemHandle exactly");
static_assert(offsetof(gp_ipc_handle_t, checksum) == 48, "gp_ipc_handle_t layout");

size_t gp_ipc_handle_size(void);
/* Writes 64 bytes to raw64; 0, or GP_IPC_E_RANGE when offset >= size. */
int gp_ipc_encode(void *raw64, uint32_t pid, int32_t fd, uint64_t base, uint64_t size, uint64_t offset,
                  uint64_t export_id, uint16_t flags);
/* 0 and *out filled, or GP_IPC_E_NOT_OURS / _VERSION / _CHECKSUM / _RANGE (checked in that order). */
int gp_ipc_decode(const void *raw64, gp_ipc_handle_t *out);

/* pidfd path: a duplicate of `fd` of process `pid` (close-on-exec), or -1 with *err = errno. Needs ptrace access
 * to `pid` (same user; under Yama ptrace_scope=1 the target must have called gp_allow_peer_getfd). */
int gp_fd_from_pid(pid_t pid, int fd, int *err);
/* PR_SET_PTRACER_ANY for this process, so peers may pidfd_getfd from it; 0 also when Yama is absent. */
int gp_allow_peer_getfd(void);

/* SCM_RIGHTS path: one fd plus a payload of 1..len bytes per message (use SOCK_SEQPACKET to keep boundaries).
 * send: 0 or -errno. recv: payload bytes and *fd (close-on-exec), or -errno with *fd = -1: -EBADMSG for a message
 * without exactly one fd (all received fds are closed), -EMSGSIZE for a payload larger than cap, -ECONNRESET at EOF. */
int gp_fd_send(int sock, int fd, const void *msg, size_t len);
int gp_fd_recv(int sock, int *fd, void *msg, size_t cap);
/* Abstract-namespace SOCK_SEQPACKET sockets named by `name` (no filesystem entry, gone with the process). */
int gp_ipc_listen(const char *name);
int gp_ipc_accept(int lsock);
int gp_ipc_connect(const char *name);
/* The connected peer's pid and uid (SO_PEERCRED): the exporter serves only its own user. 0 or -errno. */
int gp_ipc_peer_cred(int sock, pid_t *pid, uid_t *uid);

enum { GP_IPC_EXPORTED = 1, GP_IPC_IMPORTED, GP_IPC_MAPPED, GP_IPC_UNMAPPED, GP_IPC_RELEASED };
enum { GP_IPC_EV_IMPORT = 1, GP_IPC_EV_MAP, GP_IPC_EV_UNMAP, GP_IPC_EV_RELEASE, GP_IPC_EV_CLOSE, GP_IPC_EV_PEER_EXITED };

typedef struct {
    uint32_t state;       /* GP_IPC_EXPORTED.. ; 0 is uninitialised and refuses every event */
    uint32_t peer_exited; /* set by PEER_EXITED, never cleared */
} gp_ipc_state_t;

/* 0, or GP_IPC_E_ILLEGAL / GP_IPC_E_PEER_GONE with *s unchanged. */
int gp_ipc_transition(gp_ipc_state_t *s, int event);

typedef struct {
    uint32_t pid, refs;
    uint64_t export_id, offset, size;
    uint64_t cu_handle; /* importer's CUmemGenericAllocationHandle, set by the caller after IMPORT */
    uint64_t map_addr;  /* importer's mapping of the whole allocation, set by the caller with MAP; the user
                           pointer is map_addr + offset */
    gp_ipc_state_t st;
} gp_ipc_import_t;

typedef struct {
    gp_ipc_import_t *e;
    size_t n, cap;
} gp_ipc_table_t;

size_t gp_ipc_import_size(void);
/* Index of the MAPPED import of this handle with one more reference (*created = 0), else of a new EXPORTED entry
 * with one reference (*created = 1) that the caller imports and maps. GP_IPC_E_NOMEM on allocation failure. */
long gp_ipc_table_open(gp_ipc_table_t *t, const gp_ipc_handle_t *h, int *created);
/* Drops one reference of the import handing out `ptr`: 0 still referenced, 1 the last one (CLOSE applied, the
 * caller now unmaps and releases), GP_IPC_E_NOT_FOUND otherwise. *idx gets the entry (may be NULL). */
int gp_ipc_table_close(gp_ipc_table_t *t, uint64_t ptr, long *idx);
/* PEER_EXITED on every live import from `pid`; returns how many. */
size_t gp_ipc_table_peer_exited(gp_ipc_table_t *t, uint32_t pid);
void gp_ipc_table_free(gp_ipc_table_t *t);
#endif
