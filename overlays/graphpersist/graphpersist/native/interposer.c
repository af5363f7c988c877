/* graphpersist interposer (LD_PRELOAD): places every device allocation of the process at a deterministic
 * address inside one fixed virtual range, and records every module/library image the process loads.
 *
 * Why here: the CUDA runtime, cuBLAS, Triton and NCCL reach the driver through dlsym/cuGetProcAddress,
 * so catching the driver entry points (and handing out our wrappers through both lookups) is the one place
 * that sees every allocation. Nothing links against libcuda at build time: the real driver is dlopen'ed.
 *
 * Environment: GP_REGION_BASE (hex/dec; enables the region), GP_REGION_SIZE (bytes; default: GP_SIZE_FACTOR times
 * the device's memory, so allocator churn cannot exhaust it), GP_LOG=1 (log cuGetProcAddress names, loads and
 * allocations to stderr). Python drives the rest via ctypes.
 *
 * Fail-closed rules: device memory that bypasses the region (before it is enabled, managed memory, reservations
 * at a caller's address, cuMemMap outside the ranges we handed out) is passed through but logged as
 * GP_EV_OUTSIDE, and SAVE refuses; stream-ordered pools and a second device are refused outright. */
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fcntl.h>
#include <sys/random.h>
#include <unistd.h>

#include "gp_core.h"
#include "gp_ipc.h"

#define GP_EXPORT __attribute__((visibility("default")))

static pthread_mutex_t g_lock = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;
static gp_bump_t g_bump;
static gp_log_t g_log;
static gp_images_t g_images;
#define GP_SIZE_FACTOR 4ull
static pthread_once_t g_env_once = PTHREAD_ONCE_INIT;
static int g_enabled;       /* published by read_env() after the whole environment is parsed */
static uint64_t g_want_base, g_want_size; /* size 0: GP_SIZE_FACTOR x device memory */
static int g_log_on;
static int g_reuse;         /* layout frozen (after SAVE/LOAD): freed ranges may be handed out again */
static gp_free_t g_free;
static int g_failed;        /* region reservation failed: refuse all further allocations */
static char g_error[512];
static CUdevice g_dev;
static void *g_libcuda;

typedef struct {
    uint64_t addr;
    CUmemGenericAllocationHandle h;
    uint64_t size;
    int fd;             /* exported POSIX fd (cuIpcGetMemHandle), -1 until the first export; closed at free */
    uint64_t export_id; /* names this export in handles, so a reused pid/fd never matches */
} live_t;
static gp_ipc_table_t g_imports; /* peer allocations this process mapped (cuIpcOpenMemHandle) */
static live_t *g_live;
static size_t g_nlive, g_caplive;

static void *(*real_dlsym)(void *, const char *);

static void gp_log(const char *fmt, ...) {
    if (!g_log_on) return;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "[gp] ");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

static void set_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_error, sizeof g_error, fmt, ap);
    va_end(ap);
    fprintf(stderr, "[gp] ERROR: %s\n", g_error);
}

static void init_real_dlsym(void) {
    if (real_dlsym) return;
    real_dlsym = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!real_dlsym) real_dlsym = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
}

static void *real_fn(const char *name) {
    init_real_dlsym();
    if (!g_libcuda) g_libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!g_libcuda || !real_dlsym) return NULL;
    return real_dlsym(g_libcuda, name);
}

#define REAL(name, type)                                  \
    static type r_##name;                                 \
    if (!r_##name) r_##name = (type)real_fn(#name);       \
    if (!r_##name) return CUDA_ERROR_NOT_INITIALIZED;

static void read_env_once(void) {
    const char *b = getenv("GP_REGION_BASE"), *s = getenv("GP_REGION_SIZE"), *l = getenv("GP_LOG");
    g_log_on = l && *l && *l != '0';
    if (s && *s) g_want_size = strtoull(s, NULL, 0);
    if (b && *b) g_want_base = strtoull(b, NULL, 0);
    __atomic_store_n(&g_enabled, g_want_base != 0, __ATOMIC_RELEASE); /* last: the region is fully described */
}

/* Parses the environment exactly once, whichever thread gets here first; others wait for it. */
static void read_env(void) { pthread_once(&g_env_once, read_env_once); }

static int enabled(void) {
    read_env();
    return __atomic_load_n(&g_enabled, __ATOMIC_ACQUIRE);
}

/* Reserve the region once a context exists (first intercepted allocation). */
static int ensure_region(void) {
    if (g_bump.base) return 0;
    if (g_failed) return -1;
    typedef CUresult (*reserve_t)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    typedef CUresult (*gran_t)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags);
    typedef CUresult (*getdev_t)(CUdevice *);
    typedef CUresult (*totalmem_t)(size_t *, CUdevice);
    reserve_t reserve = (reserve_t)real_fn("cuMemAddressReserve");
    gran_t gran = (gran_t)real_fn("cuMemGetAllocationGranularity");
    getdev_t getdev = (getdev_t)real_fn("cuCtxGetDevice");
    totalmem_t totalmem = (totalmem_t)real_fn("cuDeviceTotalMem_v2");
    if (!reserve || !gran || !getdev || !totalmem) {
        set_error("driver entry points missing");
        g_failed = 1;
        return -1;
    }
    if (getdev(&g_dev) != CUDA_SUCCESS) {
        set_error("no current CUDA context at the first allocation");
        g_failed = 1;
        return -1;
    }
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = g_dev;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    size_t g = 0;
    if (gran(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) != CUDA_SUCCESS || g == 0) g = 2u << 20;
    if (g_want_size == 0) {
        size_t mem = 0;
        if (totalmem(&mem, g_dev) != CUDA_SUCCESS || mem == 0) {
            set_error("cannot read the device's memory size to size the region (set GP_REGION_SIZE)");
            g_failed = 1;
            return -1;
        }
        g_want_size = gp_round_up(GP_SIZE_FACTOR * (uint64_t)mem, 1ull << 30);
    }
    CUdeviceptr got = 0;
    CUresult r = reserve(&got, g_want_size, 0, (CUdeviceptr)g_want_base, 0);
    if (r != CUDA_SUCCESS || got != g_want_base) {
        set_error("region reservation at 0x%llx (%llu bytes) failed: result %d, got 0x%llx",
                  (unsigned long long)g_want_base, (unsigned long long)g_want_size, (int)r, (unsigned long long)got);
        if (r == CUDA_SUCCESS) {
            typedef CUresult (*afree_t)(CUdeviceptr, size_t);
            afree_t afree = (afree_t)real_fn("cuMemAddressFree");
            if (afree) afree(got, g_want_size);
        }
        g_failed = 1;
        return -1;
    }
    g_bump.base = got;
    g_bump.size = g_want_size;
    g_bump.gran = g;
    g_bump.cursor = 0;
    gp_log("region reserved at 0x%llx size %llu gran %zu dev %d", (unsigned long long)got,
           (unsigned long long)g_want_size, g, (int)g_dev);
    return 0;
}

/* Maps `h` at [addr, addr+size) and grants this device read/write; nothing stays mapped on failure. Shared by
 * our own allocations and imported IPC allocations. */
static CUresult map_with_access(uint64_t addr, uint64_t size, CUmemGenericAllocationHandle h) {
    typedef CUresult (*map_t)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
    typedef CUresult (*access_t)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
    typedef CUresult (*unmap_t)(CUdeviceptr, size_t);
    static map_t map;
    static access_t access;
    static unmap_t unmap;
    if (!map) {
        map = (map_t)real_fn("cuMemMap");
        access = (access_t)real_fn("cuMemSetAccess");
        unmap = (unmap_t)real_fn("cuMemUnmap");
    }
    if (!map || !access || !unmap) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = map((CUdeviceptr)addr, size, 0, h, 0);
    if (r != CUDA_SUCCESS) return r;
    CUmemAccessDesc acc;
    memset(&acc, 0, sizeof acc);
    acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc.location.id = g_dev;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = access((CUdeviceptr)addr, size, &acc, 1);
    if (r != CUDA_SUCCESS) unmap((CUdeviceptr)addr, size);
    return r;
}

/* Create + map + grant access for [addr, addr+size). */
static CUresult map_at(uint64_t addr, uint64_t size) {
    typedef CUresult (*create_t)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                                 unsigned long long);
    typedef CUresult (*release_t)(CUmemGenericAllocationHandle);
    static create_t create;
    static release_t release;
    if (!create) {
        create = (create_t)real_fn("cuMemCreate");
        release = (release_t)real_fn("cuMemRelease");
    }
    if (!create || !release) return CUDA_ERROR_NOT_INITIALIZED;
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = g_dev;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    CUmemGenericAllocationHandle h;
    CUresult r = create(&h, size, &prop, 0);
    if (r != CUDA_SUCCESS) return r;
    r = map_with_access(addr, size, h);
    if (r != CUDA_SUCCESS) {
        release(h);
        return r;
    }
    if (g_nlive == g_caplive) {
        size_t nc = g_caplive ? g_caplive * 2 : 256;
        live_t *p = realloc(g_live, nc * sizeof *p);
        if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
        g_live = p;
        g_caplive = nc;
    }
    g_live[g_nlive].addr = addr;
    g_live[g_nlive].h = h;
    g_live[g_nlive].size = size;
    g_live[g_nlive].fd = -1;
    g_live[g_nlive].export_id = 0;
    g_nlive++;
    return CUDA_SUCCESS;
}

static int in_region(uint64_t a) { return g_bump.base && a >= g_bump.base && a < g_bump.base + g_bump.size; }

static void log_outside(uint64_t addr, uint64_t size, uint32_t why) {
    pthread_mutex_lock(&g_lock);
    if (gp_log_append(&g_log, GP_EV_OUTSIDE, addr, size, size) != UINT64_MAX) g_log.ev[g_log.n - 1].detail = why;
    pthread_mutex_unlock(&g_lock);
    gp_log("outside the region (reason %u): 0x%llx size %llu", why, (unsigned long long)addr,
           (unsigned long long)size);
}

/* One region, one device: an allocation with another device current would land in memory LOAD cannot place. */
static int same_device(void) {
    typedef CUresult (*getdev_t)(CUdevice *);
    static getdev_t getdev;
    if (!getdev) getdev = (getdev_t)real_fn("cuCtxGetDevice");
    CUdevice d;
    if (!getdev || getdev(&d) != CUDA_SUCCESS) {
        set_error("allocation without a current CUDA context");
        return 0;
    }
    if (d == g_dev) return 1;
    set_error("allocation with device %d current, but the region belongs to device %d (one device per process)",
              (int)d, (int)g_dev);
    return 0;
}

/* Where the next `size` bytes go: a freed range once the layout is frozen, else the bump cursor. */
static int next_range(uint64_t bytes, uint64_t align, uint64_t *addr, uint64_t *mapped, int *reused) {
    uint64_t sz = gp_round_up(bytes ? bytes : 1, g_bump.gran);
    *reused = 0;
    if (sz && g_reuse && gp_free_take(&g_free, sz, align > g_bump.gran ? align : g_bump.gran, addr) == 0) {
        *mapped = sz;
        *reused = 1;
        return 0;
    }
    if (align > g_bump.gran) {
        uint64_t a = gp_round_up(g_bump.base + g_bump.cursor, align);
        if (a == 0 || a - g_bump.base > g_bump.size) return -1;
        g_bump.cursor = a - g_bump.base;
    }
    return gp_bump_place(&g_bump, bytes, addr, mapped);
}

static CUresult place(CUdeviceptr *dptr, size_t bytes) {
    if (ensure_region()) return CUDA_ERROR_OUT_OF_MEMORY;
    if (!same_device()) {
        gp_log_append(&g_log, GP_EV_REFUSED, 0, 0, bytes);
        return CUDA_ERROR_INVALID_DEVICE;
    }
    uint64_t addr, mapped;
    int reused;
    if (next_range(bytes, 0, &addr, &mapped, &reused)) {
        gp_log_append(&g_log, GP_EV_REFUSED, 0, 0, bytes);
        set_error("region exhausted: %zu bytes requested at offset %llu of %llu", bytes,
                  (unsigned long long)g_bump.cursor, (unsigned long long)g_bump.size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult r = map_at(addr, mapped);
    if (r != CUDA_SUCCESS) { /* nothing mapped: give the VA back so the sequence stays deterministic */
        if (reused)
            gp_free_add(&g_free, addr, mapped);
        else
            g_bump.cursor -= mapped;
        return r;
    }
    gp_log_append(&g_log, GP_EV_ALLOC, addr, mapped, bytes);
    gp_log("alloc 0x%llx size %llu (req %zu)", (unsigned long long)addr, (unsigned long long)mapped, bytes);
    *dptr = (CUdeviceptr)addr;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult CUDAAPI cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    typedef CUresult (*fn_t)(CUdeviceptr *, size_t);
    REAL(cuMemAlloc_v2, fn_t);
    if (!enabled()) {
        CUresult r = r_cuMemAlloc_v2(dptr, bytesize);
        if (r == CUDA_SUCCESS) log_outside(*dptr, bytesize, GP_OUT_NOT_ENABLED);
        return r;
    }
    pthread_mutex_lock(&g_lock);
    CUresult r = place(dptr, bytesize);
    pthread_mutex_unlock(&g_lock);
    return r;
}

GP_EXPORT CUresult CUDAAPI cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t w, size_t h, unsigned int e) {
    typedef CUresult (*fn_t)(CUdeviceptr *, size_t *, size_t, size_t, unsigned int);
    REAL(cuMemAllocPitch_v2, fn_t);
    if (!enabled()) {
        CUresult r = r_cuMemAllocPitch_v2(dptr, pitch, w, h, e);
        if (r == CUDA_SUCCESS) log_outside(*dptr, *pitch * h, GP_OUT_NOT_ENABLED);
        return r;
    }
    size_t p = (size_t)gp_round_up(w, 512);
    if (p == 0 || (h && p > SIZE_MAX / h)) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    CUresult r = place(dptr, p * h);
    pthread_mutex_unlock(&g_lock);
    if (r == CUDA_SUCCESS) *pitch = p;
    return r;
}

GP_EXPORT CUresult CUDAAPI cuMemFree_v2(CUdeviceptr dptr) {
    typedef CUresult (*fn_t)(CUdeviceptr);
    typedef CUresult (*unmap_t)(CUdeviceptr, size_t);
    typedef CUresult (*release_t)(CUmemGenericAllocationHandle);
    REAL(cuMemFree_v2, fn_t);
    if (!enabled() || !in_region(dptr)) return r_cuMemFree_v2(dptr);
    pthread_mutex_lock(&g_lock);
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < g_nlive; i++) {
        if (g_live[i].addr != dptr) continue;
        unmap_t unmap = (unmap_t)real_fn("cuMemUnmap");
        release_t release = (release_t)real_fn("cuMemRelease");
        r = unmap(dptr, g_live[i].size);
        if (r == CUDA_SUCCESS) r = release(g_live[i].h);
        gp_log_append(&g_log, GP_EV_FREE, dptr, g_live[i].size, 0);
        if (g_live[i].fd >= 0) close(g_live[i].fd); /* the exporter's side ends here; importers keep theirs */
        if (r == CUDA_SUCCESS) gp_free_add(&g_free, dptr, g_live[i].size);
        gp_log("free 0x%llx", (unsigned long long)dptr);
        g_live[i] = g_live[--g_nlive];
        break;
    }
    pthread_mutex_unlock(&g_lock);
    return r;
}

/* Reservations made by libraries (NCCL, NVSHMEM) are carved from the region when they ask for no address. */
GP_EXPORT CUresult CUDAAPI cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                               unsigned long long flags) {
    typedef CUresult (*fn_t)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    REAL(cuMemAddressReserve, fn_t);
    if (!enabled()) return r_cuMemAddressReserve(ptr, size, alignment, addr, flags);
    if (addr != 0) {
        CUresult r = r_cuMemAddressReserve(ptr, size, alignment, addr, flags);
        if (r == CUDA_SUCCESS) log_outside(*ptr, size, GP_OUT_HINT);
        return r;
    }
    if (alignment & (alignment - 1)) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    CUresult r = CUDA_ERROR_OUT_OF_MEMORY;
    if (ensure_region() == 0) {
        uint64_t a, mapped;
        int reused;
        if (next_range(size, alignment, &a, &mapped, &reused) == 0) {
            gp_log_append(&g_log, GP_EV_RESERVE, a, mapped, size);
            *ptr = (CUdeviceptr)a;
            r = CUDA_SUCCESS;
        } else {
            gp_log_append(&g_log, GP_EV_REFUSED, 0, 0, size);
            set_error("region exhausted: reservation of %zu bytes at offset %llu of %llu", size,
                      (unsigned long long)g_bump.cursor, (unsigned long long)g_bump.size);
        }
    }
    pthread_mutex_unlock(&g_lock);
    return r;
}

/* A carved reservation goes back to the region (reused once the layout is frozen), never to the driver. */
GP_EXPORT CUresult CUDAAPI cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    typedef CUresult (*fn_t)(CUdeviceptr, size_t);
    REAL(cuMemAddressFree, fn_t);
    if (!enabled() || !in_region(ptr)) return r_cuMemAddressFree(ptr, size);
    pthread_mutex_lock(&g_lock);
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    long i = gp_log_find_live(&g_log, ptr);
    if (i >= 0 && g_log.ev[i].kind == GP_EV_RESERVE) {
        uint64_t mapped = g_log.ev[i].size;
        gp_log_append(&g_log, GP_EV_UNRESERVE, ptr, mapped, size);
        gp_free_add(&g_free, ptr, mapped);
        r = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_lock);
    return r;
}

/* Physical memory a library maps itself must go into a range we handed out (a carved reservation). */
GP_EXPORT CUresult CUDAAPI cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                                    unsigned long long flags) {
    typedef CUresult (*fn_t)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
    REAL(cuMemMap, fn_t);
    CUresult r = r_cuMemMap(ptr, size, offset, h, flags);
    if (r == CUDA_SUCCESS && enabled() && !in_region(ptr)) log_outside(ptr, size, GP_OUT_MAP);
    return r;
}

GP_EXPORT CUresult CUDAAPI cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    typedef CUresult (*fn_t)(CUdeviceptr *, size_t, unsigned int);
    REAL(cuMemAllocManaged, fn_t);
    CUresult r = r_cuMemAllocManaged(dptr, bytesize, flags);
    if (r == CUDA_SUCCESS && enabled()) log_outside(*dptr, bytesize, GP_OUT_MANAGED);
    return r;
}

static CUresult async_refused(const char *what, size_t bytes) {
    pthread_mutex_lock(&g_lock);
    gp_log_append(&g_log, GP_EV_REFUSED, 0, 0, bytes);
    set_error("%s (stream-ordered pools) cannot be placed in the region; use the default caching allocator "
              "(no cudaMallocAsync backend in PYTORCH_CUDA_ALLOC_CONF)", what);
    pthread_mutex_unlock(&g_lock);
    return CUDA_ERROR_NOT_SUPPORTED;
}

#define ASYNC_HOOK(name, params, args)                                       \
    GP_EXPORT CUresult CUDAAPI name params {                                 \
        typedef CUresult(*fn_t) params;                                      \
        REAL(name, fn_t);                                                    \
        if (!enabled()) return r_##name args;                                \
        return async_refused(#name, bytesize);                               \
    }
ASYNC_HOOK(cuMemAllocAsync, (CUdeviceptr * dptr, size_t bytesize, CUstream s), (dptr, bytesize, s))
ASYNC_HOOK(cuMemAllocAsync_ptsz, (CUdeviceptr * dptr, size_t bytesize, CUstream s), (dptr, bytesize, s))
ASYNC_HOOK(cuMemAllocFromPoolAsync, (CUdeviceptr * dptr, size_t bytesize, CUmemoryPool p, CUstream s),
           (dptr, bytesize, p, s))
ASYNC_HOOK(cuMemAllocFromPoolAsync_ptsz, (CUdeviceptr * dptr, size_t bytesize, CUmemoryPool p, CUstream s),
           (dptr, bytesize, p, s))

/* ---- VMM-IPC: legacy IPC handles do not work on cuMem allocations, so region memory gets our own handles ----
 * Ownership (gp_ipc.h): the exporter owns the allocation and one exported fd per allocation, closed when it frees
 * the allocation; the importer fetches a duplicate of that fd (pidfd_getfd), imports it, maps it into its own
 * region at the next deterministic place and is the only one who unmaps and releases it (cuIpcCloseMemHandle, last
 * reference). The physical memory lives until both sides let go, so an exporter exiting first does not invalidate
 * a live mapping. Like legacy IPC, a handle names the whole allocation and open returns its base. */

static live_t *live_containing(uint64_t p) {
    for (size_t i = 0; i < g_nlive; i++)
        if (p >= g_live[i].addr && p < g_live[i].addr + g_live[i].size) return &g_live[i];
    return NULL;
}

static uint64_t new_export_id(void) {
    static uint64_t seed, seq;
    if (!seed && getrandom(&seed, sizeof seed, 0) != sizeof seed) seed = (uint64_t)getpid() << 32;
    return seed ^ ++seq;
}

GP_EXPORT CUresult CUDAAPI cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr dptr) {
    typedef CUresult (*fn_t)(CUipcMemHandle *, CUdeviceptr);
    typedef CUresult (*export_t)(void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType, unsigned long long);
    REAL(cuIpcGetMemHandle, fn_t);
    if (!enabled() || !in_region(dptr)) return r_cuIpcGetMemHandle(handle, dptr);
    export_t exp = (export_t)real_fn("cuMemExportToShareableHandle");
    pthread_mutex_lock(&g_lock);
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    live_t *l = live_containing(dptr);
    if (!l) {
        set_error("cuIpcGetMemHandle(0x%llx): not inside a live region allocation", (unsigned long long)dptr);
    } else if (l->fd < 0 && (!exp || (r = exp(&l->fd, l->h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)) !=
                                         CUDA_SUCCESS)) {
        l->fd = -1;
        set_error("cuIpcGetMemHandle(0x%llx): exporting a file descriptor failed with %d", (unsigned long long)dptr,
                  (int)r);
    } else {
        if (!l->export_id) l->export_id = new_export_id();
        gp_allow_peer_getfd();
        gp_ipc_encode(handle->reserved, (uint32_t)getpid(), l->fd, l->addr, l->size, 0, l->export_id,
                      GP_IPC_F_PIDFD);
        gp_log("ipc export 0x%llx size %llu fd %d", (unsigned long long)l->addr, (unsigned long long)l->size, l->fd);
        r = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_lock);
    return r;
}

/* Imports and maps one peer allocation (the lock is held). */
static CUresult ipc_import(gp_ipc_import_t *e, const gp_ipc_handle_t *h) {
    typedef CUresult (*import_t)(CUmemGenericAllocationHandle *, void *, CUmemAllocationHandleType);
    typedef CUresult (*release_t)(CUmemGenericAllocationHandle);
    import_t imp = (import_t)real_fn("cuMemImportFromShareableHandle");
    release_t release = (release_t)real_fn("cuMemRelease");
    if (!imp || !release) return CUDA_ERROR_NOT_INITIALIZED;
    int err = 0, fd = gp_fd_from_pid((pid_t)h->pid, h->fd, &err);
    if (fd < 0) {
        set_error("cuIpcOpenMemHandle: cannot fetch fd %d of exporter pid %u (%s): the exporter must be alive, same "
                  "user, and allow pidfd_getfd", h->fd, h->pid, strerror(err));
        return CUDA_ERROR_INVALID_HANDLE;
    }
    CUmemGenericAllocationHandle mh;
    CUresult r = imp(&mh, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    close(fd); /* the imported handle holds the memory now */
    if (r != CUDA_SUCCESS) {
        set_error("cuIpcOpenMemHandle: importing the exporter's fd failed with %d", (int)r);
        return r;
    }
    gp_ipc_transition(&e->st, GP_IPC_EV_IMPORT);
    uint64_t addr, mapped;
    int reused;
    if (next_range(h->size, 0, &addr, &mapped, &reused) || mapped != h->size) {
        release(mh);
        gp_ipc_transition(&e->st, GP_IPC_EV_RELEASE);
        set_error("cuIpcOpenMemHandle: no room for %llu bytes in the region (or not a multiple of the granularity)",
                  (unsigned long long)h->size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    r = map_with_access(addr, mapped, mh);
    if (r != CUDA_SUCCESS) {
        if (reused)
            gp_free_add(&g_free, addr, mapped);
        else
            g_bump.cursor -= mapped;
        release(mh);
        gp_ipc_transition(&e->st, GP_IPC_EV_RELEASE);
        set_error("cuIpcOpenMemHandle: mapping the peer allocation failed with %d", (int)r);
        return r;
    }
    gp_ipc_transition(&e->st, GP_IPC_EV_MAP);
    e->cu_handle = (uint64_t)mh;
    e->map_addr = addr;
    gp_log_append(&g_log, GP_EV_IPC_OPEN, addr, mapped, h->size);
    gp_log("ipc open pid %u fd %d -> 0x%llx size %llu", h->pid, h->fd, (unsigned long long)addr,
           (unsigned long long)mapped);
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult CUDAAPI cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int flags) {
    typedef CUresult (*fn_t)(CUdeviceptr *, CUipcMemHandle, unsigned int);
    REAL(cuIpcOpenMemHandle_v2, fn_t);
    gp_ipc_handle_t h;
    int d = gp_ipc_decode(handle.reserved, &h);
    if (d == GP_IPC_E_NOT_OURS) return r_cuIpcOpenMemHandle_v2(pdptr, handle, flags); /* a legacy handle */
    if (d != 0) {
        set_error("cuIpcOpenMemHandle: a graphpersist handle that does not decode (%d: version or checksum)", d);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (!enabled()) {
        set_error("cuIpcOpenMemHandle: graphpersist handles are opened only with the region enabled");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    if (h.pid == (uint32_t)getpid()) return CUDA_ERROR_INVALID_CONTEXT; /* like legacy IPC: not in the exporter */
    pthread_mutex_lock(&g_lock);
    CUresult r = CUDA_ERROR_OUT_OF_MEMORY;
    int created = 0;
    long i = ensure_region() == 0 ? gp_ipc_table_open(&g_imports, &h, &created) : -1;
    if (i >= 0) {
        gp_ipc_import_t *e = &g_imports.e[i];
        r = created ? ipc_import(e, &h) : CUDA_SUCCESS;
        if (r == CUDA_SUCCESS) {
            *pdptr = (CUdeviceptr)(e->map_addr + e->offset);
        } else { /* nothing mapped: the slot is dead and reusable */
            gp_ipc_transition(&e->st, GP_IPC_EV_RELEASE);
            e->refs = 0;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return r;
}

GP_EXPORT CUresult CUDAAPI cuIpcCloseMemHandle(CUdeviceptr dptr) {
    typedef CUresult (*fn_t)(CUdeviceptr);
    typedef CUresult (*release_t)(CUmemGenericAllocationHandle);
    typedef CUresult (*unmap_t)(CUdeviceptr, size_t);
    REAL(cuIpcCloseMemHandle, fn_t);
    pthread_mutex_lock(&g_lock);
    long idx = -1;
    int c = gp_ipc_table_close(&g_imports, dptr, &idx);
    CUresult r = CUDA_SUCCESS;
    if (c == 1) {
        gp_ipc_import_t *e = &g_imports.e[idx];
        unmap_t unmap = (unmap_t)real_fn("cuMemUnmap");
        release_t release = (release_t)real_fn("cuMemRelease");
        r = unmap(e->map_addr, e->size);
        if (r == CUDA_SUCCESS) r = release((CUmemGenericAllocationHandle)e->cu_handle);
        gp_log_append(&g_log, GP_EV_IPC_CLOSE, e->map_addr, e->size, 0);
        if (r == CUDA_SUCCESS) gp_free_add(&g_free, e->map_addr, e->size);
    }
    pthread_mutex_unlock(&g_lock);
    if (c == GP_IPC_E_NOT_FOUND) return r_cuIpcCloseMemHandle(dptr); /* not ours: a legacy mapping */
    return r;
}

/* ---- module / library images ---- */

static void record_image(uint32_t kind, uint64_t handle, const void *image, uint32_t n_jit) {
    const void *start = image;
    uint64_t size = gp_image_size(image, &start);
    uint32_t format = gp_image_format(image);
    uint64_t ptr = (uint64_t)start;
    uint32_t owned = 0;
    Dl_info info;
    /* Static data inside a loaded shared object stays valid; anything else (Triton's Python bytes) is copied. */
    if (!(dladdr(start, &info) && info.dli_fname)) {
        void *copy = malloc(size ? size : 1);
        if (copy) {
            memcpy(copy, start, size);
            ptr = (uint64_t)copy;
            owned = 1;
        }
    }
    pthread_mutex_lock(&g_lock);
    gp_images_append(&g_images, kind, handle, ptr, size, owned, format, n_jit);
    pthread_mutex_unlock(&g_lock);
    gp_log("image kind %u handle 0x%llx size %llu owned %u", kind, (unsigned long long)handle,
           (unsigned long long)size, owned);
}

GP_EXPORT CUresult CUDAAPI cuModuleLoadData(CUmodule *module, const void *image) {
    typedef CUresult (*fn_t)(CUmodule *, const void *);
    REAL(cuModuleLoadData, fn_t);
    CUresult r = r_cuModuleLoadData(module, image);
    if (r == CUDA_SUCCESS) record_image(1, (uint64_t)*module, image, 0);
    return r;
}

GP_EXPORT CUresult CUDAAPI cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int n, CUjit_option *o,
                                              void **v) {
    typedef CUresult (*fn_t)(CUmodule *, const void *, unsigned int, CUjit_option *, void **);
    REAL(cuModuleLoadDataEx, fn_t);
    CUresult r = r_cuModuleLoadDataEx(module, image, n, o, v);
    if (r == CUDA_SUCCESS) record_image(2, (uint64_t)*module, image, n);
    return r;
}

GP_EXPORT CUresult CUDAAPI cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin) {
    typedef CUresult (*fn_t)(CUmodule *, const void *);
    REAL(cuModuleLoadFatBinary, fn_t);
    CUresult r = r_cuModuleLoadFatBinary(module, fatCubin);
    if (r == CUDA_SUCCESS) record_image(3, (uint64_t)*module, fatCubin, 0);
    return r;
}

GP_EXPORT CUresult CUDAAPI cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jo, void **jv,
                                             unsigned int nj, CUlibraryOption *lo, void **lv, unsigned int nl) {
    typedef CUresult (*fn_t)(CUlibrary *, const void *, CUjit_option *, void **, unsigned int, CUlibraryOption *,
                             void **, unsigned int);
    REAL(cuLibraryLoadData, fn_t);
    CUresult r = r_cuLibraryLoadData(library, code, jo, jv, nj, lo, lv, nl);
    if (r == CUDA_SUCCESS) record_image(4, (uint64_t)*library, code, nj);
    return r;
}

/* ---- lookups: dlsym and cuGetProcAddress hand out our wrappers ---- */

typedef struct {
    const char *base;     /* name as requested through cuGetProcAddress */
    const char *symbol;   /* exported/versioned name as requested through dlsym */
    void *wrapper;
    void *wrapper_ptsz;   /* per-thread default-stream variant, if any */
} hook_t;

GP_EXPORT CUresult CUDAAPI cuGetProcAddress_v2(const char *symbol, void **pfn, int ver, cuuint64_t flags,
                                               CUdriverProcAddressQueryResult *st);
CUresult gp_cuGetProcAddress_v1(const char *symbol, void **pfn, int ver, cuuint64_t flags)
    __asm__("cuGetProcAddress") GP_EXPORT;

static const hook_t g_hooks[] = {
    {"cuMemAlloc", "cuMemAlloc_v2", (void *)cuMemAlloc_v2, NULL},
    {"cuMemAllocPitch", "cuMemAllocPitch_v2", (void *)cuMemAllocPitch_v2, NULL},
    {"cuMemFree", "cuMemFree_v2", (void *)cuMemFree_v2, NULL},
    {"cuMemAddressReserve", "cuMemAddressReserve", (void *)cuMemAddressReserve, NULL},
    {"cuMemAddressFree", "cuMemAddressFree", (void *)cuMemAddressFree, NULL},
    {"cuMemMap", "cuMemMap", (void *)cuMemMap, NULL},
    {"cuMemAllocManaged", "cuMemAllocManaged", (void *)cuMemAllocManaged, NULL},
    {"cuIpcGetMemHandle", "cuIpcGetMemHandle", (void *)cuIpcGetMemHandle, NULL},
    {"cuIpcOpenMemHandle", "cuIpcOpenMemHandle_v2", (void *)cuIpcOpenMemHandle_v2, NULL},
    {"cuIpcOpenMemHandle", "cuIpcOpenMemHandle", (void *)cuIpcOpenMemHandle_v2, NULL}, /* v1: same signature */
    {"cuIpcCloseMemHandle", "cuIpcCloseMemHandle", (void *)cuIpcCloseMemHandle, NULL},
    {"cuMemAllocAsync", "cuMemAllocAsync", (void *)cuMemAllocAsync, (void *)cuMemAllocAsync_ptsz},
    {"cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync", (void *)cuMemAllocFromPoolAsync,
     (void *)cuMemAllocFromPoolAsync_ptsz},
    {"cuModuleLoadData", "cuModuleLoadData", (void *)cuModuleLoadData, NULL},
    {"cuModuleLoadDataEx", "cuModuleLoadDataEx", (void *)cuModuleLoadDataEx, NULL},
    {"cuModuleLoadFatBinary", "cuModuleLoadFatBinary", (void *)cuModuleLoadFatBinary, NULL},
    {"cuLibraryLoadData", "cuLibraryLoadData", (void *)cuLibraryLoadData, NULL},
    {"cuGetProcAddress", "cuGetProcAddress_v2", (void *)cuGetProcAddress_v2, NULL},
};
#define NHOOKS (sizeof g_hooks / sizeof g_hooks[0])

static const hook_t *hook_by_base(const char *name) {
    for (size_t i = 0; i < NHOOKS; i++)
        if (strcmp(g_hooks[i].base, name) == 0) return &g_hooks[i];
    return NULL;
}

GP_EXPORT CUresult CUDAAPI cuGetProcAddress_v2(const char *symbol, void **pfn, int ver, cuuint64_t flags,
                                               CUdriverProcAddressQueryResult *st) {
    typedef CUresult (*fn_t)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *);
    REAL(cuGetProcAddress_v2, fn_t);
    read_env();
    CUresult r = r_cuGetProcAddress_v2(symbol, pfn, ver, flags, st);
    gp_log("cuGetProcAddress %s ver %d flags %llu -> %d", symbol, ver, (unsigned long long)flags, (int)r);
    if (r != CUDA_SUCCESS || !pfn || !*pfn || !symbol) return r;
    const hook_t *h = hook_by_base(symbol);
    if (!h) return r;
    if (strcmp(symbol, "cuMemAlloc") == 0 || strcmp(symbol, "cuMemFree") == 0 ||
        strcmp(symbol, "cuMemAllocPitch") == 0) {
        if (ver < 3020) return r; /* the 32-bit v1 entry points: not ours */
    }
    if (strcmp(symbol, "cuGetProcAddress") == 0 && ver < 12000) {
        *pfn = (void *)gp_cuGetProcAddress_v1;
        return r;
    }
    *pfn = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) && h->wrapper_ptsz ? h->wrapper_ptsz
                                                                                      : h->wrapper;
    return r;
}

CUresult gp_cuGetProcAddress_v1(const char *symbol, void **pfn, int ver, cuuint64_t flags) {
    CUdriverProcAddressQueryResult st;
    return cuGetProcAddress_v2(symbol, pfn, ver, flags, &st);
}

GP_EXPORT void *dlsym(void *handle, const char *name) {
    init_real_dlsym();
    if (name[0] == 'c' && name[1] == 'u') {
        if (strcmp(name, "cuGetProcAddress") == 0) return (void *)gp_cuGetProcAddress_v1;
        for (size_t i = 0; i < NHOOKS; i++) {
            const hook_t *h = &g_hooks[i];
            size_t n = strlen(h->symbol);
            if (strncmp(h->symbol, name, n) != 0) continue;
            if (name[n] == 0) {
                gp_log("dlsym %s -> wrapper", name);
                return h->wrapper;
            }
            if (h->wrapper_ptsz && strcmp(name + n, "_ptsz") == 0) return h->wrapper_ptsz;
        }
    }
    return real_dlsym(handle, name);
}

/* ---- control surface for Python (ctypes) ---- */

typedef struct {
    uint64_t base, size, cursor, gran;
    int64_t enabled, failed, n_events, n_images;
} gp_region_info_t;

GP_EXPORT int gp_region_info(gp_region_info_t *out) {
    read_env();
    pthread_mutex_lock(&g_lock);
    out->base = g_bump.base;
    out->size = g_bump.base ? g_bump.size : g_want_size;
    out->cursor = g_bump.cursor;
    out->gran = g_bump.gran;
    out->enabled = g_enabled;
    out->failed = g_failed;
    out->n_events = (int64_t)g_log.n;
    out->n_images = (int64_t)g_images.n;
    pthread_mutex_unlock(&g_lock);
    return 0;
}

/* Enable the region from Python (when GP_REGION_BASE was not set); only before the first placement. */
GP_EXPORT int gp_enable(uint64_t base, uint64_t size) {
    read_env();
    pthread_mutex_lock(&g_lock);
    int rc = -1;
    if (!g_bump.base) {
        g_want_base = base;
        if (size) g_want_size = size;
        __atomic_store_n(&g_enabled, base != 0, __ATOMIC_RELEASE);
        rc = 0;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* Force the reservation now (a context must be current). */
GP_EXPORT int gp_reserve_now(void) {
    read_env();
    pthread_mutex_lock(&g_lock);
    int rc = enabled() ? ensure_region() : -1;
    pthread_mutex_unlock(&g_lock);
    return rc;
}

GP_EXPORT size_t gp_events(gp_event_t *buf, size_t cap) {
    pthread_mutex_lock(&g_lock);
    size_t n = g_log.n < cap ? g_log.n : cap;
    if (buf && n) memcpy(buf, g_log.ev, n * sizeof *buf);
    size_t total = g_log.n;
    pthread_mutex_unlock(&g_lock);
    return total;
}

GP_EXPORT size_t gp_images(gp_image_t *buf, size_t cap) {
    pthread_mutex_lock(&g_lock);
    size_t n = g_images.n < cap ? g_images.n : cap;
    if (buf && n) memcpy(buf, g_images.im, n * sizeof *buf);
    size_t total = g_images.n;
    pthread_mutex_unlock(&g_lock);
    return total;
}

/* One recorded allocation at its recorded address: inside the region, aligned, above the cursor, on nothing. */
static int map_fixed_locked(uint64_t addr, uint64_t size) {
    if (!size || !in_region(addr) || !in_region(addr + size - 1) || size % g_bump.gran || addr % g_bump.gran ||
        addr - g_bump.base < g_bump.cursor) {
        set_error("restoring 0x%llx+%llu: outside the region, unaligned or below the cursor",
                  (unsigned long long)addr, (unsigned long long)size);
        return -1;
    }
    for (size_t i = 0; i < g_nlive; i++)
        if (addr < g_live[i].addr + g_live[i].size && g_live[i].addr < addr + size) {
            set_error("restoring 0x%llx overlaps the live allocation at 0x%llx", (unsigned long long)addr,
                      (unsigned long long)g_live[i].addr);
            return -1;
        }
    CUresult r = map_at(addr, size);
    if (r != CUDA_SUCCESS) {
        set_error("restoring 0x%llx+%llu: mapping failed with %d", (unsigned long long)addr,
                  (unsigned long long)size, (int)r);
        return -1;
    }
    gp_log_append(&g_log, GP_EV_MAP_FIXED, addr, size, size);
    return 0;
}

/* LOAD's memory restore as one step under the lock: no allocation may have happened since Python checked the
 * log (`expect_events`), then every range is mapped and the cursor moves to SAVE's final offset. */
GP_EXPORT int gp_restore(const uint64_t *addrs, const uint64_t *sizes, size_t n, uint64_t expect_events,
                         uint64_t final_offset) {
    pthread_mutex_lock(&g_lock);
    int rc = -1;
    if (ensure_region() != 0) goto out;
    if (g_log.n != expect_events) {
        set_error("%llu allocation event(s) happened while LOAD was restoring memory (another thread allocated)",
                  (unsigned long long)(g_log.n - expect_events));
        goto out;
    }
    for (size_t i = 0; i < n; i++)
        if (map_fixed_locked(addrs[i], sizes[i])) goto out;
    if (gp_bump_set_cursor(&g_bump, final_offset)) {
        set_error("cannot move the cursor to SAVE's final offset 0x%llx (now 0x%llx)",
                  (unsigned long long)final_offset, (unsigned long long)g_bump.cursor);
        goto out;
    }
    rc = 0;
out:
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* The layout is recorded (SAVE) or restored (LOAD): from now on freed ranges are handed out again. */
GP_EXPORT void gp_freeze(void) {
    pthread_mutex_lock(&g_lock);
    g_reuse = 1;
    pthread_mutex_unlock(&g_lock);
}

GP_EXPORT const char *gp_last_error(void) { return g_error; }

/* ---- LOAD fast path: add a graph's kernel nodes and edges without a Python round trip per node ---- */

#define GP_MAX_ATTR 64

/* Adds n kernel nodes (no dependencies) to `graph`; out[node_index] receives each node. A saved launch attribute
 * is set unless it equals what a fresh node of the same function reads back (learned per function, so a
 * kernel's own defaults, e.g. compiled-in cluster dimensions, are never taken for another's). */
GP_EXPORT int gp_add_kernel_nodes(void *graph, size_t n, const gp_knode_t *nodes, const unsigned char *blob,
                                  const uint32_t *offsets, const gp_kattr_t *attrs, void *const *funcs,
                                  size_t n_funcs, void **out) {
    typedef CUresult (*add_t)(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, const CUDA_KERNEL_NODE_PARAMS *);
    typedef CUresult (*set_t)(CUgraphNode, CUkernelNodeAttrID, const CUkernelNodeAttrValue *);
    typedef CUresult (*get_t)(CUgraphNode, CUkernelNodeAttrID, CUkernelNodeAttrValue *);
    static add_t add;
    static set_t set;
    static get_t get;
    if (!add) {
        add = (add_t)real_fn("cuGraphAddKernelNode_v2");
        set = (set_t)real_fn("cuGraphKernelNodeSetAttribute");
        get = (get_t)real_fn("cuGraphKernelNodeGetAttribute");
    }
    if (!add || !set || !get) {
        set_error("graph entry points missing in the driver");
        return -1;
    }
    /* per (function, attribute): 0 unknown, 1 default read, 2 unreadable (always set) */
    unsigned char *known = calloc(n_funcs * GP_MAX_ATTR + 1, 1);
    unsigned char(*defs)[64] = calloc(n_funcs * GP_MAX_ATTR + 1, 64);
    int rc = -1;
    if (!known || !defs) {
        set_error("out of host memory");
        goto out;
    }
    void *ptrs[4096];
    for (size_t i = 0; i < n; i++) {
        const gp_knode_t *k = &nodes[i];
        if (k->n_params > 4096 || k->func_index >= n_funcs) {
            set_error("node %u: %u parameters, function %u of %zu", k->node_index, k->n_params, k->func_index,
                      n_funcs);
            goto out;
        }
        for (uint32_t j = 0; j < k->n_params; j++) ptrs[j] = (void *)(blob + k->params_off + offsets[k->layout_off + j]);
        CUDA_KERNEL_NODE_PARAMS p;
        memset(&p, 0, sizeof p);
        p.func = (CUfunction)funcs[k->func_index];
        p.gridDimX = k->grid[0];
        p.gridDimY = k->grid[1];
        p.gridDimZ = k->grid[2];
        p.blockDimX = k->block[0];
        p.blockDimY = k->block[1];
        p.blockDimZ = k->block[2];
        p.sharedMemBytes = k->smem;
        p.kernelParams = k->n_params ? ptrs : NULL;
        CUgraphNode node;
        CUresult r = add(&node, (CUgraph)graph, NULL, 0, &p);
        if (r != CUDA_SUCCESS) {
            set_error("node %u: cuGraphAddKernelNode failed with %d", k->node_index, (int)r);
            goto out;
        }
        out[k->node_index] = node;
        for (uint32_t j = 0; j < k->n_attrs; j++) {
            const gp_kattr_t *a = &attrs[k->attrs_off + j];
            if (a->id >= GP_MAX_ATTR) {
                set_error("node %u: launch attribute id %u is newer than this interposer knows (< %d): SAVE and "
                          "LOAD need the same graphpersist build", k->node_index, a->id, GP_MAX_ATTR);
                goto out;
            }
            size_t key = (size_t)k->func_index * GP_MAX_ATTR + a->id;
            if (!known[key]) {
                CUkernelNodeAttrValue v;
                memset(&v, 0, sizeof v);
                known[key] = get(node, (CUkernelNodeAttrID)a->id, &v) == CUDA_SUCCESS ? 1 : 2;
                memcpy(defs[key], &v, sizeof v < 64 ? sizeof v : 64);
            }
            if (known[key] == 1 && memcmp(defs[key], a->value, 64) == 0) continue;
            CUkernelNodeAttrValue v;
            memcpy(&v, a->value, sizeof v < 64 ? sizeof v : 64);
            r = set(node, (CUkernelNodeAttrID)a->id, &v);
            if (r != CUDA_SUCCESS) {
                set_error("node %u: setting launch attribute %u failed with %d", k->node_index, a->id, (int)r);
                goto out;
            }
        }
    }
    rc = 0;
out:
    free(known);
    free(defs);
    return rc;
}

/* Adds plain edges (no edge data) between already created nodes. */
GP_EXPORT int gp_add_edges(void *graph, void *const *nodes, size_t n, const uint32_t *from, const uint32_t *to) {
    typedef CUresult (*dep_t)(CUgraph, const CUgraphNode *, const CUgraphNode *, const CUgraphEdgeData *, size_t);
    static dep_t dep;
    if (!dep) dep = (dep_t)real_fn("cuGraphAddDependencies_v2");
    if (!dep) return -1;
    CUgraphNode *f = malloc(n * sizeof *f), *t = malloc(n * sizeof *t);
    if (!f || !t) {
        free(f);
        free(t);
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        f[i] = (CUgraphNode)nodes[from[i]];
        t[i] = (CUgraphNode)nodes[to[i]];
    }
    CUresult r = dep((CUgraph)graph, f, t, NULL, n);
    free(f);
    free(t);
    if (r != CUDA_SUCCESS) set_error("cuGraphAddDependencies failed with %d", (int)r);
    return r == CUDA_SUCCESS ? 0 : -1;
}
