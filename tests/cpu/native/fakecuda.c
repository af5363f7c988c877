/* A fake CUDA driver for the CPU tests of the interposer (never shipped): the driver entry points the interposer
 * calls, on top of host memory. A reservation is a PROT_NONE mapping, a physical allocation a memfd (so exporting
 * and importing POSIX fds works between processes), cuMemMap maps the memfd into the reservation, cuMemSetAccess
 * makes it readable and writable, cuMemUnmap puts PROT_NONE back. It counts live handles, mappings and
 * reservations and records the order of the calls that matter, so a test can prove that nothing leaked and that
 * a free synchronized before it unmapped. The interposer loads it through GP_LIBCUDA.
 *
 * Types are spelled as their ABI (the interposer's gp_cuda.h names them): CUresult int, CUdeviceptr and handles
 * 64-bit, CUdevice int. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))
typedef int CUresult;
typedef unsigned long long devptr_t;
enum { OK = 0, E_INVALID_VALUE = 1, E_OUT_OF_MEMORY = 2, E_NOT_SUPPORTED = 801, E_NOT_FOUND = 500 };

#define MAXN 4096
typedef struct {
    int fd; /* -1: slot free */
    size_t size;
} handle_t;
typedef struct {
    uint64_t addr, size;
    int used;
} range_t;

static handle_t g_handles[MAXN];
static range_t g_maps[MAXN], g_resv[MAXN], g_plain[MAXN];
static int g_nhandles_live, g_nmaps_live, g_nresv_live, g_nplain_live;
static int g_device, g_sync_result, g_sync_calls;
static char g_trace[8192];

static void trace(const char *what, uint64_t addr) {
    size_t n = strlen(g_trace);
    if (n + 40 < sizeof g_trace) snprintf(g_trace + n, sizeof g_trace - n, "%s:%llx ", what, (unsigned long long)addr);
}

static range_t *add_range(range_t *t, uint64_t addr, uint64_t size, int *live) {
    for (int i = 0; i < MAXN; i++)
        if (!t[i].used) {
            t[i] = (range_t){addr, size, 1};
            ++*live;
            return &t[i];
        }
    return NULL;
}

static range_t *find_range(range_t *t, uint64_t addr, int containing, uint64_t size) {
    for (int i = 0; i < MAXN; i++) {
        if (!t[i].used) continue;
        if (!containing && t[i].addr == addr) return &t[i];
        if (containing && addr >= t[i].addr && addr + size <= t[i].addr + t[i].size) return &t[i];
    }
    return NULL;
}

static int overlaps(range_t *t, uint64_t addr, uint64_t size) {
    for (int i = 0; i < MAXN; i++)
        if (t[i].used && addr < t[i].addr + t[i].size && t[i].addr < addr + size) return 1;
    return 0;
}

static handle_t *handle_of(unsigned long long h) {
    return h >= 1 && h <= MAXN && g_handles[h - 1].fd >= 0 && g_handles[h - 1].size ? &g_handles[h - 1] : NULL;
}

static CUresult new_handle(int fd, size_t size, unsigned long long *out) {
    for (int i = 0; i < MAXN; i++)
        if (g_handles[i].size == 0) {
            g_handles[i] = (handle_t){fd, size};
            g_nhandles_live++;
            *out = (unsigned long long)i + 1;
            return OK;
        }
    close(fd);
    return E_OUT_OF_MEMORY;
}

/* ---- what the tests read and set ---- */
EXPORT int fake_live_handles(void) { return g_nhandles_live; }
EXPORT int fake_live_mappings(void) { return g_nmaps_live; }
EXPORT int fake_live_reservations(void) { return g_nresv_live; }
EXPORT int fake_live_plain(void) { return g_nplain_live; }
EXPORT int fake_sync_calls(void) { return g_sync_calls; }
EXPORT void fake_set_sync_result(int r) { g_sync_result = r; }
EXPORT void fake_set_device(int d) { g_device = d; }
EXPORT const char *fake_trace(void) { return g_trace; }
EXPORT void fake_clear_trace(void) { g_trace[0] = 0; }

/* ---- the driver ---- */
EXPORT CUresult cuCtxGetDevice(int *dev) {
    *dev = g_device;
    return OK;
}

EXPORT CUresult cuCtxSynchronize(void) {
    g_sync_calls++;
    trace("sync", 0);
    return g_sync_result;
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t *bytes, int dev) {
    *bytes = 1ull << 30;
    return OK;
}

EXPORT CUresult cuMemGetAllocationGranularity(size_t *g, const void *prop, int flags) {
    *g = 2u << 20;
    return OK;
}

EXPORT CUresult cuMemAddressReserve(devptr_t *ptr, size_t size, size_t align, devptr_t addr, unsigned long long f) {
    void *p = mmap((void *)(uintptr_t)addr, size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | (addr ? MAP_FIXED_NOREPLACE : 0), -1, 0);
    if (p == MAP_FAILED) return E_OUT_OF_MEMORY;
    if (addr && (uintptr_t)p != addr) {
        munmap(p, size);
        return E_OUT_OF_MEMORY;
    }
    add_range(g_resv, (uintptr_t)p, size, &g_nresv_live);
    *ptr = (uintptr_t)p;
    trace("reserve", *ptr);
    return OK;
}

EXPORT CUresult cuMemAddressFree(devptr_t ptr, size_t size) {
    range_t *r = find_range(g_resv, ptr, 0, 0);
    if (!r || r->size != size || overlaps(g_maps, ptr, size)) return E_INVALID_VALUE;
    munmap((void *)(uintptr_t)ptr, size);
    r->used = 0;
    g_nresv_live--;
    return OK;
}

EXPORT CUresult cuMemCreate(unsigned long long *h, size_t size, const void *prop, unsigned long long flags) {
    int fd = memfd_create("fakecuda", MFD_CLOEXEC);
    if (fd < 0) return E_OUT_OF_MEMORY;
    if (ftruncate(fd, (off_t)size) != 0) {
        close(fd);
        return E_OUT_OF_MEMORY;
    }
    CUresult r = new_handle(fd, size, h);
    if (r == OK) trace("create", *h);
    return r;
}

EXPORT CUresult cuMemRelease(unsigned long long h) {
    handle_t *x = handle_of(h);
    if (!x) return E_INVALID_VALUE;
    close(x->fd); /* mappings keep the memory, as on the driver */
    *x = (handle_t){-1, 0};
    g_nhandles_live--;
    trace("release", h);
    return OK;
}

EXPORT CUresult cuMemMap(devptr_t ptr, size_t size, size_t offset, unsigned long long h, unsigned long long flags) {
    handle_t *x = handle_of(h);
    if (!x || offset + size > x->size || !find_range(g_resv, ptr, 1, size) || overlaps(g_maps, ptr, size))
        return E_INVALID_VALUE;
    if (mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, x->fd, (off_t)offset) == MAP_FAILED)
        return E_OUT_OF_MEMORY;
    add_range(g_maps, ptr, size, &g_nmaps_live);
    trace("map", ptr);
    return OK;
}

EXPORT CUresult cuMemSetAccess(devptr_t ptr, size_t size, const void *desc, size_t count) {
    if (!find_range(g_maps, ptr, 1, size)) return E_INVALID_VALUE;
    return mprotect((void *)(uintptr_t)ptr, size, PROT_READ | PROT_WRITE) == 0 ? OK : E_INVALID_VALUE;
}

EXPORT CUresult cuMemUnmap(devptr_t ptr, size_t size) {
    range_t *r = find_range(g_maps, ptr, 0, 0);
    if (!r || r->size != size) return E_INVALID_VALUE;
    mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    r->used = 0;
    g_nmaps_live--;
    trace("unmap", ptr);
    return OK;
}

EXPORT CUresult cuMemExportToShareableHandle(void *out, unsigned long long h, int type, unsigned long long flags) {
    handle_t *x = handle_of(h);
    if (!x) return E_INVALID_VALUE;
    int fd = fcntl(x->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return E_OUT_OF_MEMORY;
    *(int *)out = fd;
    return OK;
}

EXPORT CUresult cuMemImportFromShareableHandle(unsigned long long *h, void *os_handle, int type) {
    struct stat st;
    int fd = fcntl((int)(intptr_t)os_handle, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return E_INVALID_VALUE;
    if (fstat(fd, &st) != 0 || st.st_size <= 0) {
        close(fd);
        return E_INVALID_VALUE;
    }
    return new_handle(fd, (size_t)st.st_size, h);
}

static CUresult plain_alloc(devptr_t *p, size_t size) {
    void *m = mmap(NULL, size ? size : 1, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return E_OUT_OF_MEMORY;
    add_range(g_plain, (uintptr_t)m, size ? size : 1, &g_nplain_live);
    *p = (uintptr_t)m;
    return OK;
}

EXPORT CUresult cuMemAlloc_v2(devptr_t *p, size_t size) { return plain_alloc(p, size); }
EXPORT CUresult cuMemAllocManaged(devptr_t *p, size_t size, unsigned int flags) { return plain_alloc(p, size); }
EXPORT CUresult cuMemAllocPitch_v2(devptr_t *p, size_t *pitch, size_t w, size_t h, unsigned int e) {
    *pitch = (w + 511) / 512 * 512;
    return plain_alloc(p, *pitch * h);
}

EXPORT CUresult cuMemFree_v2(devptr_t p) {
    range_t *r = find_range(g_plain, p, 0, 0);
    if (!r) return E_INVALID_VALUE;
    munmap((void *)(uintptr_t)p, r->size);
    r->used = 0;
    g_nplain_live--;
    return OK;
}

EXPORT CUresult cuIpcGetMemHandle(void *handle, devptr_t p) { return E_NOT_SUPPORTED; }
EXPORT CUresult cuIpcOpenMemHandle_v2(devptr_t *p, char handle[64], unsigned int flags) { return E_NOT_SUPPORTED; }
EXPORT CUresult cuIpcCloseMemHandle(devptr_t p) { return E_NOT_SUPPORTED; }

/* ---- pinned host memory: the driver's own allocations land wherever mmap puts them; registrations are counted,
 * and a test can make cuMemHostRegister fail or the device pointer differ from the host address ---- */
static int g_register_result, g_nregistered;
static uint64_t g_devptr_skew;
static range_t g_host[MAXN], g_reg[MAXN];
static int g_nhost_live, g_nreg_live;

EXPORT int fake_live_registered(void) { return g_nreg_live; }
EXPORT int fake_live_host(void) { return g_nhost_live; }
EXPORT void fake_set_register_result(int r) { g_register_result = r; }
EXPORT void fake_set_devptr_skew(unsigned long long s) { g_devptr_skew = s; }

EXPORT CUresult cuMemHostAlloc(void **pp, size_t size, unsigned int flags) {
    void *m = mmap(NULL, size ? size : 1, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return E_OUT_OF_MEMORY;
    add_range(g_host, (uintptr_t)m, size ? size : 1, &g_nhost_live);
    *pp = m;
    trace("hostalloc", (uintptr_t)m);
    return OK;
}

EXPORT CUresult cuMemAllocHost_v2(void **pp, size_t size) { return cuMemHostAlloc(pp, size, 0); }

EXPORT CUresult cuMemFreeHost(void *p) {
    range_t *r = find_range(g_host, (uintptr_t)p, 0, 0);
    if (!r) return E_INVALID_VALUE;
    munmap(p, r->size);
    r->used = 0;
    g_nhost_live--;
    trace("freehost", (uintptr_t)p);
    return OK;
}

EXPORT CUresult cuMemHostRegister_v2(void *p, size_t size, unsigned int flags) {
    if (g_register_result) return g_register_result;
    if (flags != 3 || overlaps(g_reg, (uintptr_t)p, size)) return E_INVALID_VALUE; /* PORTABLE | DEVICEMAP */
    add_range(g_reg, (uintptr_t)p, size, &g_nreg_live);
    g_nregistered++;
    trace("register", (uintptr_t)p);
    return OK;
}

EXPORT CUresult cuMemHostUnregister(void *p) {
    range_t *r = find_range(g_reg, (uintptr_t)p, 0, 0);
    if (!r) return E_INVALID_VALUE;
    r->used = 0;
    g_nreg_live--;
    trace("unregister", (uintptr_t)p);
    return OK;
}

EXPORT CUresult cuMemHostGetDevicePointer_v2(devptr_t *d, void *p, unsigned int flags) {
    if (!find_range(g_reg, (uintptr_t)p, 1, 1) && !find_range(g_host, (uintptr_t)p, 1, 1)) return E_INVALID_VALUE;
    *d = (uintptr_t)p + g_devptr_skew;
    return OK;
}

/* Launch attributes of a "kernel node": any handle works. Attribute ids divisible by 3 are not readable (801);
 * the others read as 64 bytes of (id + low byte of the node handle), so a test can tell attributes and nodes apart. */
EXPORT CUresult cuGraphKernelNodeGetAttribute(void *node, int id, unsigned char *value) {
    if (id % 3 == 0) return E_NOT_SUPPORTED;
    memset(value, (unsigned char)(id + ((uintptr_t)node & 0xff)), 64);
    return OK;
}

/* Kernel functions and nodes, for LOAD's native rebuild (gp_add_kernel_nodes). fake_make_func(n, offsets, sizes)
 * makes a function whose cuFuncGetParamInfo answers like the driver's (CUDA_ERROR_INVALID_VALUE past the last
 * parameter; fake_set_param_info_result makes it fail instead). cuGraphAddKernelNode_v2 reads every parameter from
 * kernelParams[j] for as many bytes as the *function's* parameter j is long, as the driver does, into the node's
 * parameter buffer at the function's offset; fake_node_params hands that buffer back. */
#define MAXF 512
#define MAXP 32
#define MAXK 1024
typedef struct {
    uint32_t n, off[MAXP], size[MAXP];
} func_t;
typedef struct {
    void *func;
    unsigned grid[3], block[3], smem;
    void **kernelParams, **extra;
    void *kern, *ctx;
} kparams_t; /* CUDA_KERNEL_NODE_PARAMS_v2 */
static func_t g_funcs[MAXF];
static int g_nfuncs, g_nknodes, g_param_info_calls, g_param_info_result = E_INVALID_VALUE, g_set_attrs;
static struct {
    int func;
    unsigned char params[256];
} g_knodes[MAXK];

EXPORT void *fake_make_func(uint32_t n, const uint32_t *off, const uint32_t *size) {
    if (g_nfuncs == MAXF || n > MAXP) return NULL;
    func_t *f = &g_funcs[g_nfuncs++];
    f->n = n;
    for (uint32_t j = 0; j < n; j++) f->off[j] = off[j], f->size[j] = size[j];
    return f;
}
EXPORT int fake_param_info_calls(void) { return g_param_info_calls; }
EXPORT void fake_set_param_info_result(int r) { g_param_info_result = r; }
EXPORT int fake_kernel_nodes(void) { return g_nknodes; }
EXPORT int fake_set_attrs(void) { return g_set_attrs; }
EXPORT int fake_node_params(int i, unsigned char *out, size_t cap) {
    if (i < 0 || i >= g_nknodes || i >= MAXK) return -1;
    memcpy(out, g_knodes[i].params, cap < 256 ? cap : 256);
    return g_knodes[i].func;
}

EXPORT CUresult cuFuncGetParamInfo(void *func, size_t i, size_t *off, size_t *size) {
    const func_t *f = func;
    g_param_info_calls++;
    if (f < g_funcs || f >= g_funcs + g_nfuncs) return 400; /* CUDA_ERROR_INVALID_HANDLE */
    if (i >= f->n) return g_param_info_result;
    *off = f->off[i];
    *size = f->size[i];
    return OK;
}

EXPORT CUresult cuGraphAddKernelNode_v2(void **node, void *graph, const void *deps, size_t ndeps, const kparams_t *p) {
    const func_t *f = p->func;
    if (f < g_funcs || f >= g_funcs + g_nfuncs) return 400;
    int k = g_nknodes++ % MAXK; /* the first MAXK nodes are kept for fake_node_params; later ones reuse slots */
    g_knodes[k].func = (int)(f - g_funcs);
    memset(g_knodes[k].params, 0, sizeof g_knodes[k].params);
    for (uint32_t j = 0; j < f->n; j++) {
        if (f->off[j] + f->size[j] > sizeof g_knodes[k].params) return E_INVALID_VALUE;
        memcpy(g_knodes[k].params + f->off[j], p->kernelParams[j], f->size[j]);
    }
    *node = (void *)(uintptr_t)(0x1000 * (k + 1));
    return OK;
}

EXPORT CUresult cuGraphKernelNodeSetAttribute(void *node, int id, const unsigned char *value) {
    g_set_attrs++;
    return OK;
}

static const struct {
    const char *name;
    void *fn;
} g_procs[] = {
    {"cuCtxGetDevice", (void *)cuCtxGetDevice},
    {"cuCtxSynchronize", (void *)cuCtxSynchronize},
    {"cuMemAlloc", (void *)cuMemAlloc_v2},
    {"cuMemFree", (void *)cuMemFree_v2},
    {"cuMemAddressReserve", (void *)cuMemAddressReserve},
    {"cuMemAddressFree", (void *)cuMemAddressFree},
    {"cuMemMap", (void *)cuMemMap},
    {"cuMemUnmap", (void *)cuMemUnmap},
    {"cuMemHostAlloc", (void *)cuMemHostAlloc},
    {"cuMemAllocHost", (void *)cuMemAllocHost_v2},
    {"cuMemFreeHost", (void *)cuMemFreeHost},
};

EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int ver, unsigned long long flags, int *status) {
    for (size_t i = 0; i < sizeof g_procs / sizeof g_procs[0]; i++)
        if (strcmp(g_procs[i].name, symbol) == 0) {
            *pfn = g_procs[i].fn;
            if (status) *status = 0;
            return OK;
        }
    *pfn = NULL;
    if (status) *status = 1;
    return E_NOT_FOUND;
}

__attribute__((constructor)) static void init(void) {
    for (int i = 0; i < MAXN; i++) g_handles[i] = (handle_t){-1, 0};
}
