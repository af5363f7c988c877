/* VMM-IPC building blocks (see gp_ipc.h): handle codec, fd passing, ownership bookkeeping. Linux only. */
#define _GNU_SOURCE
#include "gp_ipc.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif
#define RECV_MAX_FDS 16 /* room to see (and close) what a misbehaving peer sends beyond one fd */

size_t gp_ipc_handle_size(void) { return sizeof(gp_ipc_handle_t); }
size_t gp_ipc_import_size(void) { return sizeof(gp_ipc_import_t); }

static uint32_t fnv1a(uint32_t h, const unsigned char *p, size_t n) {
    while (n--) h = (h ^ *p++) * 16777619u;
    return h;
}

static uint32_t handle_checksum(const gp_ipc_handle_t *h) {
    const unsigned char *p = (const unsigned char *)h;
    size_t at = offsetof(gp_ipc_handle_t, checksum), after = at + sizeof h->checksum;
    return fnv1a(fnv1a(2166136261u, p, at), p + after, sizeof *h - after);
}

int gp_ipc_encode(void *raw64, uint32_t pid, int32_t fd, uint64_t base, uint64_t size, uint64_t offset,
                  uint64_t export_id, uint16_t flags) {
    if (size == 0 || offset >= size) return GP_IPC_E_RANGE;
    gp_ipc_handle_t h;
    memset(&h, 0, sizeof h);
    h.magic = GP_IPC_MAGIC;
    h.version = GP_IPC_VERSION;
    h.flags = flags;
    h.pid = pid;
    h.fd = fd;
    h.base = base;
    h.size = size;
    h.offset = offset;
    h.export_id = export_id;
    h.checksum = handle_checksum(&h);
    memcpy(raw64, &h, sizeof h);
    return 0;
}

int gp_ipc_decode(const void *raw64, gp_ipc_handle_t *out) {
    gp_ipc_handle_t h;
    if (!raw64) return GP_IPC_E_NOT_OURS;
    memcpy(&h, raw64, sizeof h);
    if (h.magic != GP_IPC_MAGIC) return GP_IPC_E_NOT_OURS;
    /* Version before checksum: another version may checksum differently. */
    if (h.version != GP_IPC_VERSION) return GP_IPC_E_VERSION;
    if (h.checksum != handle_checksum(&h)) return GP_IPC_E_CHECKSUM;
    if (h.size == 0 || h.offset >= h.size) return GP_IPC_E_RANGE;
    *out = h;
    return 0;
}

int gp_fd_from_pid(pid_t pid, int fd, int *err) {
    int e = 0, got = -1;
    int pfd = (int)syscall(SYS_pidfd_open, pid, 0);
    if (pfd < 0) {
        e = errno;
    } else {
        got = (int)syscall(SYS_pidfd_getfd, pfd, fd, 0); /* the new fd is always close-on-exec */
        if (got < 0) e = errno;
        close(pfd);
    }
    if (err) *err = e;
    return got < 0 ? -1 : got;
}

int gp_allow_peer_getfd(void) {
    /* Yama ptrace_scope=1 only lets ancestors ptrace (and so pidfd_getfd); peers are siblings. EINVAL: no Yama. */
    if (prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) == 0 || errno == EINVAL) return 0;
    return -errno;
}

int gp_fd_send(int sock, int fd, const void *msg, size_t len) {
    if (!msg || len == 0 || fd < 0) return -EINVAL; /* a stream socket drops fds sent without data */
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(sizeof(int))];
    } ctl;
    memset(&ctl, 0, sizeof ctl);
    struct iovec iov = {.iov_base = (void *)msg, .iov_len = len};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf, .msg_controllen = sizeof ctl.buf};
    struct cmsghdr *c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
    ssize_t n;
    do n = sendmsg(sock, &m, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    if (n < 0) return -errno;
    return (size_t)n == len ? 0 : -EMSGSIZE;
}

int gp_fd_recv(int sock, int *fd, void *msg, size_t cap) {
    *fd = -1;
    if (!msg || cap == 0) return -EINVAL;
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(RECV_MAX_FDS * sizeof(int))];
    } ctl;
    memset(&ctl, 0, sizeof ctl);
    struct iovec iov = {.iov_base = msg, .iov_len = cap};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf, .msg_controllen = sizeof ctl.buf};
    ssize_t n;
    do n = recvmsg(sock, &m, MSG_CMSG_CLOEXEC);
    while (n < 0 && errno == EINTR);
    if (n < 0) return -errno;
    int first = -1, count = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < k; i++) {
            int x;
            memcpy(&x, CMSG_DATA(c) + i * sizeof(int), sizeof x);
            if (count++ == 0)
                first = x;
            else
                close(x); /* extras never reach the caller */
        }
    }
    if (n == 0 && count == 0) return -ECONNRESET;
    int bad = (m.msg_flags & MSG_TRUNC) ? -EMSGSIZE : (count != 1 || (m.msg_flags & MSG_CTRUNC)) ? -EBADMSG : 0;
    if (bad) {
        if (first >= 0) close(first);
        return bad;
    }
    *fd = first;
    return (int)n;
}

/* Abstract address: sun_path starts with NUL and the length, not a terminator, ends the name. */
static int abstract_addr(const char *name, struct sockaddr_un *a, socklen_t *len) {
    size_t n = name ? strlen(name) : 0;
    if (n == 0) return -EINVAL;
    if (n + 1 > sizeof a->sun_path) return -ENAMETOOLONG;
    memset(a, 0, sizeof *a);
    a->sun_family = AF_UNIX;
    memcpy(a->sun_path + 1, name, n);
    *len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
    return 0;
}

int gp_ipc_listen(const char *name) {
    struct sockaddr_un a;
    socklen_t len;
    int rc = abstract_addr(name, &a, &len);
    if (rc) return rc;
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (s < 0) return -errno;
    if (bind(s, (struct sockaddr *)&a, len) < 0 || listen(s, 16) < 0) {
        rc = -errno;
        close(s);
        return rc;
    }
    return s;
}

int gp_ipc_accept(int lsock) {
    int s;
    do s = accept4(lsock, NULL, NULL, SOCK_CLOEXEC);
    while (s < 0 && errno == EINTR);
    return s < 0 ? -errno : s;
}

int gp_ipc_connect(const char *name) {
    struct sockaddr_un a;
    socklen_t len;
    int rc = abstract_addr(name, &a, &len);
    if (rc) return rc;
    for (;;) {
        int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        if (s < 0) return -errno;
        if (connect(s, (struct sockaddr *)&a, len) == 0) return s;
        rc = -errno;
        close(s); /* a fresh socket after EINTR: the old one's state is not worth reasoning about */
        if (rc != -EINTR) return rc;
    }
}

int gp_ipc_peer_cred(int sock, pid_t *pid, uid_t *uid) {
    struct ucred cr;
    socklen_t len = sizeof cr;
    if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cr, &len) < 0) return -errno;
    if (pid) *pid = cr.pid;
    if (uid) *uid = cr.uid;
    return 0;
}

int gp_ipc_transition(gp_ipc_state_t *s, int event) {
    uint32_t to = 0;
    switch (event) {
    case GP_IPC_EV_PEER_EXITED: /* a flag, not a state: live mappings outlive the exporter */
        if (s->state < GP_IPC_EXPORTED || s->state >= GP_IPC_RELEASED) return GP_IPC_E_ILLEGAL;
        s->peer_exited = 1;
        return 0;
    case GP_IPC_EV_IMPORT:
        if (s->state == GP_IPC_EXPORTED && s->peer_exited) return GP_IPC_E_PEER_GONE;
        if (s->state == GP_IPC_EXPORTED) to = GP_IPC_IMPORTED;
        break;
    case GP_IPC_EV_MAP:
        if (s->state == GP_IPC_IMPORTED) to = GP_IPC_MAPPED;
        break;
    case GP_IPC_EV_UNMAP:
        if (s->state == GP_IPC_MAPPED) to = GP_IPC_UNMAPPED;
        break;
    case GP_IPC_EV_RELEASE: /* EXPORTED: the exporter closes its fd, or an importer gives up before importing */
        if (s->state == GP_IPC_EXPORTED || s->state == GP_IPC_IMPORTED || s->state == GP_IPC_UNMAPPED)
            to = GP_IPC_RELEASED;
        break;
    case GP_IPC_EV_CLOSE:
        if (s->state == GP_IPC_MAPPED) to = GP_IPC_RELEASED;
        break;
    }
    if (!to) return GP_IPC_E_ILLEGAL;
    s->state = to;
    return 0;
}

static int same_key(const gp_ipc_import_t *e, const gp_ipc_handle_t *h) {
    return e->pid == h->pid && e->export_id == h->export_id && e->offset == h->offset;
}

long gp_ipc_table_open(gp_ipc_table_t *t, const gp_ipc_handle_t *h, int *created) {
    size_t slot = t->n;
    for (size_t i = 0; i < t->n; i++) {
        gp_ipc_import_t *e = &t->e[i];
        if (e->st.state == GP_IPC_MAPPED && same_key(e, h)) {
            e->refs++;
            *created = 0;
            return (long)i;
        }
        if (e->st.state == GP_IPC_RELEASED && slot == t->n) slot = i; /* reuse: opens and closes do not grow it */
    }
    if (slot == t->n) {
        if (t->n == t->cap) {
            size_t nc = t->cap ? t->cap * 2 : 16;
            void *p = realloc(t->e, nc * sizeof *t->e);
            if (!p) return GP_IPC_E_NOMEM;
            t->e = p;
            t->cap = nc;
        }
        t->n++;
    }
    gp_ipc_import_t *e = &t->e[slot];
    memset(e, 0, sizeof *e);
    e->pid = h->pid;
    e->export_id = h->export_id;
    e->offset = h->offset;
    e->size = h->size;
    e->refs = 1;
    e->st.state = GP_IPC_EXPORTED;
    *created = 1;
    return (long)slot;
}

int gp_ipc_table_close(gp_ipc_table_t *t, uint64_t ptr, long *idx) {
    for (size_t i = 0; i < t->n; i++) {
        gp_ipc_import_t *e = &t->e[i];
        if (e->st.state != GP_IPC_MAPPED || e->map_addr + e->offset != ptr) continue;
        if (idx) *idx = (long)i;
        if (--e->refs > 0) return 0;
        gp_ipc_transition(&e->st, GP_IPC_EV_CLOSE);
        return 1;
    }
    return GP_IPC_E_NOT_FOUND;
}

size_t gp_ipc_table_peer_exited(gp_ipc_table_t *t, uint32_t pid) {
    size_t n = 0;
    for (size_t i = 0; i < t->n; i++)
        if (t->e[i].pid == pid && gp_ipc_transition(&t->e[i].st, GP_IPC_EV_PEER_EXITED) == 0) n++;
    return n;
}

void gp_ipc_table_free(gp_ipc_table_t *t) {
    free(t->e);
    memset(t, 0, sizeof *t);
}
