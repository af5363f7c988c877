/* VMM-IPC building blocks (see gp_ipc.h): handle codec, the exporter's fd server and the importer's fetch, fd
 * passing, ownership bookkeeping. Linux only. */
#define _GNU_SOURCE
#include "gp_ipc.h"
#include "gp_glibc.h" /* symbol versions a manylinux_2_28 wheel may need (the fd server thread) */

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif
#define RECV_MAX_FDS 16 /* room to see (and close) what a misbehaving peer sends beyond one fd */

static uint32_t fnv1a(uint32_t h, const unsigned char *p, size_t n) {
    while (n--) h = (h ^ *p++) * 16777619u;
    return h;
}

static uint32_t handle_checksum(const gp_ipc_handle_t *h) {
    const unsigned char *p = (const unsigned char *)h;
    size_t at = offsetof(gp_ipc_handle_t, checksum), after = at + sizeof h->checksum;
    return fnv1a(fnv1a(2166136261u, p, at), p + after, sizeof *h - after);
}

int gp_ipc_encode(void *raw64, const gp_ipc_handle_t *in) {
    if (in->size == 0 || in->offset >= in->size) return GP_IPC_E_RANGE;
    gp_ipc_handle_t h = *in;
    h.magic = GP_IPC_MAGIC;
    h.version = GP_IPC_VERSION;
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

int gp_fd_send(int sock, int fd, const void *msg, size_t len) {
    if (!msg || len == 0) return -EINVAL; /* a stream socket drops fds sent without data */
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(sizeof(int))];
    } ctl;
    memset(&ctl, 0, sizeof ctl);
    struct iovec iov = {.iov_base = (void *)msg, .iov_len = len};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf, .msg_controllen = sizeof ctl.buf};
    if (fd >= 0) {
        struct cmsghdr *c = CMSG_FIRSTHDR(&m);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &fd, sizeof fd);
    } else { /* a payload-only message: an error answer */
        m.msg_control = NULL;
        m.msg_controllen = 0;
    }
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
    int bad = (m.msg_flags & MSG_TRUNC) ? -EMSGSIZE : (count > 1 || (m.msg_flags & MSG_CTRUNC)) ? -EBADMSG : 0;
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

/* ---- exporter: the fd server ---------------------------------------------------------------------------------- */

#define REQ_MAGIC 0x47504952u /* 'GPIR' */
typedef struct {
    uint32_t magic, version;
    uint64_t export_id;
} request_t;
typedef struct {
    int32_t status; /* 0 with the fd attached, or a negative code */
} answer_t;

typedef struct {
    uint64_t id;
    int fd; /* the exporter's fd (owned by the caller of gp_ipc_export) */
} served_t;

/* Everything the server shares with the rest of the process; `mu` guards all of it, and is held only to change
 * the registry or to look up and dup one fd. */
static struct {
    pthread_mutex_t mu;
    int running;   /* a server thread exists in this process */
    pid_t pid;     /* the process that started it */
    pthread_t thread;
    int lsock, stopfd;
    uint32_t token;
    served_t *ex;
    size_t n, cap;
} S = {.mu = PTHREAD_MUTEX_INITIALIZER, .lsock = -1, .stopfd = -1};
static pthread_once_t S_atfork_once = PTHREAD_ONCE_INIT;

static void atfork_prepare(void) { pthread_mutex_lock(&S.mu); }
static void atfork_parent(void) { pthread_mutex_unlock(&S.mu); }
/* The child has no server thread; it must not keep the parent's listening socket alive either. */
static void atfork_child(void) {
    if (S.lsock >= 0) close(S.lsock);
    if (S.stopfd >= 0) close(S.stopfd);
    S.lsock = S.stopfd = -1;
    S.running = 0;
    S.n = 0;
    pthread_mutex_unlock(&S.mu);
}
static void register_atfork(void) { pthread_atfork(atfork_prepare, atfork_parent, atfork_child); }

static long long now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/* 1 when `sock` is readable before the deadline, 0 on timeout or a stop request, -errno on errors. */
static int wait_readable(int sock, int stopfd, long long deadline) {
    for (;;) {
        long long left = deadline - now_ms();
        if (left <= 0) return 0;
        struct pollfd p[2] = {{.fd = sock, .events = POLLIN}, {.fd = stopfd, .events = POLLIN}};
        int n = poll(p, stopfd >= 0 ? 2 : 1, (int)(left > 60000 ? 60000 : left));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return -errno;
        if (stopfd >= 0 && p[1].revents) return 0;
        if (p[0].revents) return 1;
    }
}

static void answer(int c, int32_t status, int fd) {
    answer_t a = {.status = status};
    gp_fd_send(c, fd, &a, sizeof a); /* the socket is non-blocking: a client that does not read loses its answer */
}

static void serve_one(int c) {
    uid_t uid = (uid_t)-1;
    request_t rq;
    if (gp_ipc_peer_cred(c, NULL, &uid) != 0 || uid != geteuid()) {
        answer(c, GP_IPC_E_DENIED, -1);
        return;
    }
    if (wait_readable(c, S.stopfd, now_ms() + GP_IPC_SERVER_TIMEOUT_MS) != 1) return; /* stuck client or stop */
    ssize_t n = recv(c, &rq, sizeof rq, MSG_DONTWAIT | MSG_TRUNC);
    if (n != (ssize_t)sizeof rq || rq.magic != REQ_MAGIC || rq.version != GP_IPC_VERSION) {
        answer(c, GP_IPC_E_PROTOCOL, -1);
        return;
    }
    int dup = -1, status = GP_IPC_E_UNKNOWN;
    pthread_mutex_lock(&S.mu); /* gp_ipc_unserve cannot close the fd under us */
    for (size_t i = 0; i < S.n; i++) {
        if (S.ex[i].id != rq.export_id) continue;
        dup = fcntl(S.ex[i].fd, F_DUPFD_CLOEXEC, 0);
        status = dup < 0 ? -errno : 0;
        break;
    }
    pthread_mutex_unlock(&S.mu);
    answer(c, status, dup);
    if (dup >= 0) close(dup);
}

static void *server_main(void *arg) {
    (void)arg;
    for (;;) {
        struct pollfd p[2] = {{.fd = S.lsock, .events = POLLIN}, {.fd = S.stopfd, .events = POLLIN}};
        if (poll(p, 2, -1) < 0) {
            if (errno == EINTR) continue;
            break;
        }
        if (p[1].revents) break;
        int c = accept4(S.lsock, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (c < 0) continue; /* EAGAIN (the client went away), EMFILE, ...: the next poll tells */
        serve_one(c);
        close(c);
    }
    return NULL;
}

/* Binds a fresh socket name and starts the thread (S.mu held). */
static int server_start(void) {
    pthread_once(&S_atfork_once, register_atfork);
    char name[64];
    int ls = -EADDRINUSE;
    for (int tries = 0; tries < 8 && ls == -EADDRINUSE; tries++) { /* someone squats the name: draw another */
        if (getrandom(&S.token, sizeof S.token, 0) != sizeof S.token) S.token ^= (uint32_t)now_ms() * 2654435761u;
        snprintf(name, sizeof name, GP_IPC_SOCK_FMT, (unsigned)getpid(), S.token);
        ls = gp_ipc_listen(name);
    }
    if (ls < 0) return ls;
    int fl = fcntl(ls, F_GETFL);
    int sfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (fl < 0 || fcntl(ls, F_SETFL, fl | O_NONBLOCK) < 0 || sfd < 0) {
        int e = -errno;
        close(ls);
        if (sfd >= 0) close(sfd);
        return e;
    }
    S.lsock = ls;
    S.stopfd = sfd;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* the thread inherits it: the application's signals go elsewhere */
    int rc = pthread_create(&S.thread, NULL, server_main, NULL);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        close(ls);
        close(sfd);
        S.lsock = S.stopfd = -1;
        return -rc;
    }
    S.running = 1;
    S.pid = getpid();
    return 0;
}

static int serve(uint64_t export_id, int fd, uint32_t *token) {
    pthread_mutex_lock(&S.mu);
    int rc = S.running ? 0 : server_start();
    size_t i = 0;
    while (rc == 0 && i < S.n && S.ex[i].id != export_id) i++;
    if (rc == 0 && i == S.n) {
        if (S.n == S.cap) {
            size_t nc = S.cap ? S.cap * 2 : 16;
            served_t *p = realloc(S.ex, nc * sizeof *p);
            if (p) {
                S.ex = p;
                S.cap = nc;
            }
        }
        if (S.n < S.cap)
            S.n++;
        else
            rc = GP_IPC_E_NOMEM;
    }
    if (rc == 0) {
        S.ex[i].id = export_id;
        S.ex[i].fd = fd;
        *token = S.token;
    }
    pthread_mutex_unlock(&S.mu);
    return rc;
}

void gp_ipc_unserve(uint64_t export_id) {
    pthread_mutex_lock(&S.mu);
    for (size_t i = 0; i < S.n; i++)
        if (S.ex[i].id == export_id) {
            S.ex[i] = S.ex[--S.n];
            break;
        }
    pthread_mutex_unlock(&S.mu);
}

/* At exit (or unload): wake the thread, even in the middle of a client, and join it. */
__attribute__((destructor)) static void server_stop(void) {
    pthread_mutex_lock(&S.mu);
    int mine = S.running && S.pid == getpid();
    S.running = 0;
    pthread_mutex_unlock(&S.mu);
    if (!mine) return;
    uint64_t one = 1;
    if (write(S.stopfd, &one, sizeof one) == sizeof one) pthread_join(S.thread, NULL);
    close(S.lsock);
    close(S.stopfd);
    S.lsock = S.stopfd = -1;
}

int gp_ipc_transport(const char *value) {
    if (!value || !*value || strcmp(value, "scm") == 0) return GP_IPC_F_SCM;
    if (strcmp(value, "pidfd") == 0) return GP_IPC_F_PIDFD;
    return GP_IPC_E_TRANSPORT;
}

/* PR_SET_PTRACER_ANY for this process, so peers may pidfd_getfd from it; 0 also when Yama is absent. */
static int allow_peer_getfd(void) {
    /* Yama ptrace_scope=1 only lets ancestors ptrace (and so pidfd_getfd); peers are siblings. EINVAL: no Yama. */
    if (prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) == 0 || errno == EINVAL) return 0;
    return -errno;
}

int gp_ipc_export(void *raw64, int fd, uint64_t base, uint64_t size, uint64_t offset, uint64_t export_id,
                  int transport) {
    gp_ipc_handle_t h;
    memset(&h, 0, sizeof h);
    h.flags = (uint16_t)transport;
    h.pid = (uint32_t)getpid();
    h.fd = fd;
    h.base = base;
    h.size = size;
    h.offset = offset;
    h.export_id = export_id;
    if (size == 0 || offset >= size) return GP_IPC_E_RANGE;
    int rc = gp_proc_start_time(getpid(), &h.start_time);
    if (rc) return rc;
    if (transport == GP_IPC_F_SCM)
        rc = serve(export_id, fd, &h.token);
    else if (transport == GP_IPC_F_PIDFD)
        rc = allow_peer_getfd();
    else
        rc = GP_IPC_E_TRANSPORT;
    return rc ? rc : gp_ipc_encode(raw64, &h);
}

/* ---- importer ------------------------------------------------------------------------------------------------- */

int gp_proc_start_time(pid_t pid, uint64_t *out) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int f = open(path, O_RDONLY | O_CLOEXEC);
    if (f < 0) return errno == ENOENT ? -ESRCH : -errno;
    ssize_t n = read(f, buf, sizeof buf - 1);
    int e = errno;
    close(f);
    if (n < 0) return e == ESRCH ? -ESRCH : -e; /* the process exited between open and read */
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* the command name may hold spaces and parentheses; it ends at the last ')' */
    if (!p) return -EPROTO;
    p++;
    for (int field = 3; field <= 22; field++) { /* field 3 (state) follows the name; 22 is starttime */
        while (*p == ' ') p++;
        if (!*p) return -EPROTO;
        if (field == 22) {
            *out = strtoull(p, NULL, 10);
            return 0;
        }
        while (*p && *p != ' ') p++;
    }
    return -EPROTO;
}

/* 0 when the handle's pid is still its exporter, GP_IPC_E_PEER_GONE, GP_IPC_E_PID_REUSED or -errno. */
static int exporter_alive(const gp_ipc_handle_t *h) {
    uint64_t st;
    int rc = gp_proc_start_time((pid_t)h->pid, &st);
    if (rc == -ESRCH) return GP_IPC_E_PEER_GONE;
    if (rc) return rc;
    return st == h->start_time ? 0 : GP_IPC_E_PID_REUSED;
}

static int fetch_scm(const gp_ipc_handle_t *h, int *fd) {
    char name[64];
    snprintf(name, sizeof name, GP_IPC_SOCK_FMT, (unsigned)h->pid, h->token);
    int s = gp_ipc_connect(name);
    if (s < 0) {
        int alive = exporter_alive(h); /* a refused connection from a dead exporter is the usual case */
        return alive ? alive : s;
    }
    pid_t pid = 0;
    uid_t uid = (uid_t)-1;
    int rc = gp_ipc_peer_cred(s, &pid, &uid);
    if (rc == 0 && (pid != (pid_t)h->pid || uid != geteuid())) rc = GP_IPC_E_IMPOSTOR;
    if (rc == 0) rc = exporter_alive(h); /* the listener is pid h->pid: is that pid still the exporter? */
    request_t rq = {.magic = REQ_MAGIC, .version = GP_IPC_VERSION, .export_id = h->export_id};
    if (rc == 0 && send(s, &rq, sizeof rq, MSG_NOSIGNAL) != (ssize_t)sizeof rq) rc = -errno;
    if (rc == 0) {
        rc = wait_readable(s, -1, now_ms() + GP_IPC_CLIENT_TIMEOUT_MS);
        rc = rc == 0 ? -ETIMEDOUT : rc < 0 ? rc : 0;
    }
    answer_t a;
    if (rc == 0) {
        int n = gp_fd_recv(s, fd, &a, sizeof a);
        if (n == -ECONNRESET) { /* dropped: the exporter exited or stopped its server meanwhile */
            int alive = exporter_alive(h);
            rc = alive ? alive : n;
        } else if (n < 0) {
            rc = n;
        } else if (n != (int)sizeof a || (a.status == 0) != (*fd >= 0)) {
            rc = GP_IPC_E_PROTOCOL;
        } else {
            rc = a.status;
        }
        if (rc != 0 && *fd >= 0) {
            close(*fd);
            *fd = -1;
        }
    }
    close(s);
    return rc;
}

static int fetch_pidfd(const gp_ipc_handle_t *h, int *fd) {
    int err = 0;
    *fd = gp_fd_from_pid((pid_t)h->pid, h->fd, &err);
    if (*fd < 0) return err == ESRCH ? GP_IPC_E_PEER_GONE : -err;
    int rc = exporter_alive(h); /* checked again after: the fd came from the process that had the pid then */
    if (rc) {
        close(*fd);
        *fd = -1;
    }
    return rc;
}

int gp_ipc_fetch(const gp_ipc_handle_t *h, int *fd) {
    *fd = -1;
    int rc = exporter_alive(h);
    if (rc) return rc;
    if (h->flags == GP_IPC_F_SCM) return fetch_scm(h, fd);
    if (h->flags == GP_IPC_F_PIDFD) return fetch_pidfd(h, fd);
    return GP_IPC_E_TRANSPORT;
}

const char *gp_ipc_strerror(int code) {
    switch (code) {
    case GP_IPC_E_NOT_OURS: return "not a graphpersist handle";
    case GP_IPC_E_VERSION: return "a handle of another graphpersist version: exporter and importer must match";
    case GP_IPC_E_CHECKSUM: return "a corrupted handle (checksum)";
    case GP_IPC_E_RANGE: return "the handle's offset lies outside its allocation";
    case GP_IPC_E_ILLEGAL: return "an IPC ownership event not allowed in this state";
    case GP_IPC_E_PEER_GONE: return "the exporter has exited; the exporter must be alive when a handle is opened";
    case GP_IPC_E_NOT_FOUND: return "not a pointer cuIpcOpenMemHandle handed out";
    case GP_IPC_E_NOMEM: return "out of host memory";
    case GP_IPC_E_PID_REUSED:
        return "the exporter has exited and its pid now belongs to another process (start time differs); the "
               "exporter must be alive when a handle is opened";
    case GP_IPC_E_UNKNOWN: return "the exporter does not serve this allocation (freed since it was exported)";
    case GP_IPC_E_DENIED: return "the exporter refused: it serves only processes of its own user";
    case GP_IPC_E_IMPOSTOR:
        return "the exporter's socket is served by another process or user: refusing its descriptor";
    case GP_IPC_E_TRANSPORT:
        return "unknown transport: GP_IPC_TRANSPORT must be unset, 'scm' or 'pidfd' (the handle names neither)";
    case GP_IPC_E_PROTOCOL: return "a malformed request or answer on the exporter's socket";
    case -ETIMEDOUT: return "the exporter did not answer in time (its server thread is stuck or busy)";
    case -ECONNREFUSED: return "the exporter is alive but does not serve descriptors (no server socket)";
    case -EPERM:
        return "pidfd_getfd refused (EPERM): use the default transport (unset GP_IPC_TRANSPORT) where ptrace is "
               "restricted (Yama ptrace_scope 2/3, container seccomp profiles)";
    default: return code < 0 ? strerror(-code) : "success";
    }
}

int gp_ipc_transition(uint32_t *state, int event) {
    uint32_t to = 0, s = *state;
    switch (event) {
    case GP_IPC_EV_IMPORT:
        if (s == GP_IPC_EXPORTED) to = GP_IPC_IMPORTED;
        break;
    case GP_IPC_EV_MAP:
        if (s == GP_IPC_IMPORTED) to = GP_IPC_MAPPED;
        break;
    case GP_IPC_EV_RELEASE: /* an import that failed before or after IMPORT */
        if (s == GP_IPC_EXPORTED || s == GP_IPC_IMPORTED) to = GP_IPC_RELEASED;
        break;
    case GP_IPC_EV_CLOSE:
        if (s == GP_IPC_MAPPED) to = GP_IPC_RELEASED;
        break;
    }
    if (!to) return GP_IPC_E_ILLEGAL;
    *state = to;
    return 0;
}

static int same_key(const gp_ipc_import_t *e, const gp_ipc_handle_t *h) {
    return e->pid == h->pid && e->export_id == h->export_id && e->offset == h->offset;
}

long gp_ipc_table_open(gp_ipc_table_t *t, const gp_ipc_handle_t *h, int *created) {
    size_t slot = t->n;
    for (size_t i = 0; i < t->n; i++) {
        gp_ipc_import_t *e = &t->e[i];
        if (e->state == GP_IPC_MAPPED && same_key(e, h)) {
            e->refs++;
            *created = 0;
            return (long)i;
        }
        if (e->state == GP_IPC_RELEASED && slot == t->n) slot = i; /* reuse: opens and closes do not grow it */
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
    e->state = GP_IPC_EXPORTED;
    *created = 1;
    return (long)slot;
}

int gp_ipc_table_close(gp_ipc_table_t *t, uint64_t ptr, long *idx) {
    for (size_t i = 0; i < t->n; i++) {
        gp_ipc_import_t *e = &t->e[i];
        if (e->state != GP_IPC_MAPPED || e->map_addr + e->offset != ptr) continue;
        if (idx) *idx = (long)i;
        if (--e->refs > 0) return 0;
        gp_ipc_transition(&e->state, GP_IPC_EV_CLOSE);
        return 1;
    }
    return GP_IPC_E_NOT_FOUND;
}
