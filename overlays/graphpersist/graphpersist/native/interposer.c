/* graphpersist interposer (LD_PRELOAD): places every device allocation of the process at a deterministic
 * address inside one fixed virtual range, and records every module/library image the process loads.
 *
 * Why here: the CUDA runtime, cuBLAS, Triton and NCCL reach the driver through dlsym/cuGetProcAddress,
 * so catching the driver entry points (and handing out our wrappers through both lookups) is the one place
 * that sees every allocation. Nothing links against libcuda at build time: the real driver is dlopen'ed.
 *
 * Environment: GP_REGION_BASE (hex/dec; enables the region), GP_REGION_SIZE (bytes, default 128 GiB),
 * GP_LOG=1 (log cuGetProcAddress names, loads and allocations to stderr). Python drives the rest via ctypes. */
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gp_core.h"

#define GP_EXPORT __attribute__((visibility("default")))

static pthread_mutex_t g_lock = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;
static gp_bump_t g_bump;
static gp_log_t g_log;
static gp_images_t g_images;
static int g_enabled = -1;  /* -1: read env on first use */
static uint64_t g_want_base, g_want_size = 128ull << 30;
static int g_log_on;
static int g_failed;        /* region reservation failed: refuse all further allocations */
static char g_error[512];
static CUdevice g_dev;
static void *g_libcuda;

typedef struct {
    uint64_t addr;
    CUmemGenericAllocationHandle h;
    uint64_t size;
} live_t;
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

static void read_env(void) {
    if (g_enabled != -1) return;
    const char *b = getenv("GP_REGION_BASE"), *s = getenv("GP_REGION_SIZE"), *l = getenv("GP_LOG");
    g_log_on = l && *l && *l != '0';
    g_enabled = 0;
    if (b && *b) {
        g_want_base = strtoull(b, NULL, 0);
        g_enabled = g_want_base != 0;
    }
    if (s && *s) g_want_size = strtoull(s, NULL, 0);
}

/* Reserve the region once a context exists (first intercepted allocation). */
static int ensure_region(void) {
    if (g_bump.base) return 0;
    if (g_failed) return -1;
    typedef CUresult (*reserve_t)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    typedef CUresult (*gran_t)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags);
    typedef CUresult (*getdev_t)(CUdevice *);
    reserve_t reserve = (reserve_t)real_fn("cuMemAddressReserve");
    gran_t gran = (gran_t)real_fn("cuMemGetAllocationGranularity");
    getdev_t getdev = (getdev_t)real_fn("cuCtxGetDevice");
    if (!reserve || !gran || !getdev) {
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

/* Create + map + grant access for [addr, addr+size). */
static CUresult map_at(uint64_t addr, uint64_t size) {
    typedef CUresult (*create_t)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                                 unsigned long long);
    typedef CUresult (*map_t)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
    typedef CUresult (*access_t)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
    typedef CUresult (*release_t)(CUmemGenericAllocationHandle);
    typedef CUresult (*unmap_t)(CUdeviceptr, size_t);
    static create_t create;
    static map_t map;
    static access_t access;
    static release_t release;
    static unmap_t unmap;
    if (!create) {
        create = (create_t)real_fn("cuMemCreate");
        map = (map_t)real_fn("cuMemMap");
        access = (access_t)real_fn("cuMemSetAccess");
        release = (release_t)real_fn("cuMemRelease");
        unmap = (unmap_t)real_fn("cuMemUnmap");
    }
    if (!create || !map || !access || !release || !unmap) return CUDA_ERROR_NOT_INITIALIZED;
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = g_dev;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    CUmemGenericAllocationHandle h;
    CUresult r = create(&h, size, &prop, 0);
    if (r != CUDA_SUCCESS) return r;
    r = map((CUdeviceptr)addr, size, 0, h, 0);
    if (r != CUDA_SUCCESS) {
        release(h);
        return r;
    }
    CUmemAccessDesc acc;
    memset(&acc, 0, sizeof acc);
    acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc.location.id = g_dev;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = access((CUdeviceptr)addr, size, &acc, 1);
    if (r != CUDA_SUCCESS) {
        unmap((CUdeviceptr)addr, size);
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
    g_nlive++;
    return CUDA_SUCCESS;
}

static int in_region(uint64_t a) { return g_bump.base && a >= g_bump.base && a < g_bump.base + g_bump.size; }

static CUresult place(CUdeviceptr *dptr, size_t bytes) {
    if (ensure_region()) return CUDA_ERROR_OUT_OF_MEMORY;
    uint64_t addr, mapped;
    if (gp_bump_place(&g_bump, bytes, &addr, &mapped)) {
        gp_log_append(&g_log, GP_EV_REFUSED, 0, 0, bytes);
        set_error("region exhausted: %zu bytes requested at offset %llu of %llu", bytes,
                  (unsigned long long)g_bump.cursor, (unsigned long long)g_bump.size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult r = map_at(addr, mapped);
    if (r != CUDA_SUCCESS) {
        g_bump.cursor -= mapped; /* nothing mapped: give the VA back so the sequence stays deterministic */
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
    read_env();
    if (!g_enabled) return r_cuMemAlloc_v2(dptr, bytesize);
    pthread_mutex_lock(&g_lock);
    CUresult r = place(dptr, bytesize);
    pthread_mutex_unlock(&g_lock);
    return r;
}

GP_EXPORT CUresult CUDAAPI cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t w, size_t h, unsigned int e) {
    typedef CUresult (*fn_t)(CUdeviceptr *, size_t *, size_t, size_t, unsigned int);
    REAL(cuMemAllocPitch_v2, fn_t);
    read_env();
    if (!g_enabled) return r_cuMemAllocPitch_v2(dptr, pitch, w, h, e);
    size_t p = (size_t)gp_round_up(w, 512);
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
    read_env();
    if (!g_enabled || !in_region(dptr)) return r_cuMemFree_v2(dptr);
    pthread_mutex_lock(&g_lock);
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < g_nlive; i++) {
        if (g_live[i].addr != dptr) continue;
        unmap_t unmap = (unmap_t)real_fn("cuMemUnmap");
        release_t release = (release_t)real_fn("cuMemRelease");
        r = unmap(dptr, g_live[i].size);
        if (r == CUDA_SUCCESS) r = release(g_live[i].h);
        gp_log_append(&g_log, GP_EV_FREE, dptr, g_live[i].size, 0);
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
    read_env();
    if (!g_enabled || addr != 0) return r_cuMemAddressReserve(ptr, size, alignment, addr, flags);
    pthread_mutex_lock(&g_lock);
    CUresult r = CUDA_ERROR_OUT_OF_MEMORY;
    if (ensure_region() == 0) {
        uint64_t a, mapped;
        if (alignment > g_bump.gran) g_bump.cursor = gp_round_up(g_bump.cursor, alignment);
        if (gp_bump_place(&g_bump, size, &a, &mapped) == 0) {
            gp_log_append(&g_log, GP_EV_RESERVE, a, mapped, size);
            *ptr = (CUdeviceptr)a;
            r = CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return r;
}

GP_EXPORT CUresult CUDAAPI cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    typedef CUresult (*fn_t)(CUdeviceptr, size_t);
    REAL(cuMemAddressFree, fn_t);
    read_env();
    if (g_enabled && in_region(ptr)) return CUDA_SUCCESS; /* carved VA stays with the region */
    return r_cuMemAddressFree(ptr, size);
}

static CUresult async_refused(size_t bytes) {
    pthread_mutex_lock(&g_lock);
    gp_log_append(&g_log, GP_EV_REFUSED, 0, 0, bytes);
    set_error("cuMemAllocAsync (stream-ordered pools) cannot be placed in the region; "
              "use the default caching allocator (no cudaMallocAsync backend)");
    pthread_mutex_unlock(&g_lock);
    return CUDA_ERROR_NOT_SUPPORTED;
}

GP_EXPORT CUresult CUDAAPI cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream s) {
    typedef CUresult (*fn_t)(CUdeviceptr *, size_t, CUstream);
    REAL(cuMemAllocAsync, fn_t);
    read_env();
    if (!g_enabled) return r_cuMemAllocAsync(dptr, bytesize, s);
    return async_refused(bytesize);
}

GP_EXPORT CUresult CUDAAPI cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream s) {
    typedef CUresult (*fn_t)(CUdeviceptr *, size_t, CUstream);
    REAL(cuMemAllocAsync_ptsz, fn_t);
    read_env();
    if (!g_enabled) return r_cuMemAllocAsync_ptsz(dptr, bytesize, s);
    return async_refused(bytesize);
}

/* ---- module / library images ---- */

static void record_image(uint32_t kind, uint64_t handle, const void *image) {
    const void *start = image;
    uint64_t size = gp_image_size(image, &start);
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
    gp_images_append(&g_images, kind, handle, ptr, size, owned);
    pthread_mutex_unlock(&g_lock);
    gp_log("image kind %u handle 0x%llx size %llu owned %u", kind, (unsigned long long)handle,
           (unsigned long long)size, owned);
}

GP_EXPORT CUresult CUDAAPI cuModuleLoadData(CUmodule *module, const void *image) {
    typedef CUresult (*fn_t)(CUmodule *, const void *);
    REAL(cuModuleLoadData, fn_t);
    read_env();
    CUresult r = r_cuModuleLoadData(module, image);
    if (r == CUDA_SUCCESS) record_image(1, (uint64_t)*module, image);
    return r;
}

GP_EXPORT CUresult CUDAAPI cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int n, CUjit_option *o,
                                              void **v) {
    typedef CUresult (*fn_t)(CUmodule *, const void *, unsigned int, CUjit_option *, void **);
    REAL(cuModuleLoadDataEx, fn_t);
    read_env();
    CUresult r = r_cuModuleLoadDataEx(module, image, n, o, v);
    if (r == CUDA_SUCCESS) record_image(2, (uint64_t)*module, image);
    return r;
}

GP_EXPORT CUresult CUDAAPI cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin) {
    typedef CUresult (*fn_t)(CUmodule *, const void *);
    REAL(cuModuleLoadFatBinary, fn_t);
    read_env();
    CUresult r = r_cuModuleLoadFatBinary(module, fatCubin);
    if (r == CUDA_SUCCESS) record_image(3, (uint64_t)*module, fatCubin);
    return r;
}

GP_EXPORT CUresult CUDAAPI cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jo, void **jv,
                                             unsigned int nj, CUlibraryOption *lo, void **lv, unsigned int nl) {
    typedef CUresult (*fn_t)(CUlibrary *, const void *, CUjit_option *, void **, unsigned int, CUlibraryOption *,
                             void **, unsigned int);
    REAL(cuLibraryLoadData, fn_t);
    read_env();
    CUresult r = r_cuLibraryLoadData(library, code, jo, jv, nj, lo, lv, nl);
    if (r == CUDA_SUCCESS) record_image(4, (uint64_t)*library, code);
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
    {"cuMemAllocAsync", "cuMemAllocAsync", (void *)cuMemAllocAsync, (void *)cuMemAllocAsync_ptsz},
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
        if (strcmp(name, "cuMemAllocAsync_ptsz") == 0) return (void *)cuMemAllocAsync_ptsz;
        for (size_t i = 0; i < NHOOKS; i++)
            if (strcmp(g_hooks[i].symbol, name) == 0) {
                gp_log("dlsym %s -> wrapper", name);
                return g_hooks[i].wrapper;
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
        g_enabled = base != 0;
        rc = 0;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* Force the reservation now (a context must be current). */
GP_EXPORT int gp_reserve_now(void) {
    read_env();
    pthread_mutex_lock(&g_lock);
    int rc = g_enabled ? ensure_region() : -1;
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

GP_EXPORT int gp_set_cursor(uint64_t offset) {
    pthread_mutex_lock(&g_lock);
    int rc = g_bump.base ? gp_bump_set_cursor(&g_bump, offset) : -1;
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* LOAD: map a recorded allocation at its recorded address (must lie in the region, above nothing live). */
GP_EXPORT int gp_map_fixed(uint64_t addr, uint64_t size) {
    pthread_mutex_lock(&g_lock);
    int rc = -1;
    if (ensure_region() == 0 && in_region(addr) && in_region(addr + size - 1) && size % g_bump.gran == 0 &&
        addr % g_bump.gran == 0) {
        int clash = 0;
        for (size_t i = 0; i < g_nlive; i++)
            if (addr < g_live[i].addr + g_live[i].size && g_live[i].addr < addr + size) clash = 1;
        if (clash) {
            set_error("gp_map_fixed 0x%llx overlaps a live allocation", (unsigned long long)addr);
        } else if (map_at(addr, size) == CUDA_SUCCESS) {
            gp_log_append(&g_log, GP_EV_MAP_FIXED, addr, size, size);
            rc = 0;
        }
    } else {
        set_error("gp_map_fixed 0x%llx+%llu is outside the region or unaligned", (unsigned long long)addr,
                  (unsigned long long)size);
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

GP_EXPORT const char *gp_last_error(void) { return g_error; }

/* ---- LOAD fast path: add a graph's kernel nodes and edges without a Python round trip per node ---- */

#define GP_MAX_ATTR 32
static unsigned char g_attr_default[GP_MAX_ATTR][64];
static int g_attr_known[GP_MAX_ATTR];

/* Adds n kernel nodes (no dependencies) to `graph`; out[node_index] receives each node. Launch attributes equal
 * to what a fresh node already has (learned from the first node added in this process) are skipped. */
GP_EXPORT int gp_add_kernel_nodes(void *graph, size_t n, const gp_knode_t *nodes, const unsigned char *blob,
                                  const uint32_t *offsets, const gp_kattr_t *attrs, void *const *funcs,
                                  void **out) {
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
    void *ptrs[4096];
    for (size_t i = 0; i < n; i++) {
        const gp_knode_t *k = &nodes[i];
        if (k->n_params > 4096) {
            set_error("node %u: %u parameters", k->node_index, k->n_params);
            return -1;
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
            return -1;
        }
        out[k->node_index] = node;
        for (uint32_t j = 0; j < k->n_attrs; j++) {
            const gp_kattr_t *a = &attrs[k->attrs_off + j];
            if (a->id >= GP_MAX_ATTR) continue;
            if (!g_attr_known[a->id]) {
                CUkernelNodeAttrValue v;
                memset(&v, 0, sizeof v);
                if (get(node, (CUkernelNodeAttrID)a->id, &v) == CUDA_SUCCESS) memcpy(g_attr_default[a->id], &v, 64);
                g_attr_known[a->id] = 1;
            }
            if (memcmp(g_attr_default[a->id], a->value, 64) == 0) continue;
            CUkernelNodeAttrValue v;
            memcpy(&v, a->value, sizeof v < 64 ? sizeof v : 64);
            r = set(node, (CUkernelNodeAttrID)a->id, &v);
            if (r != CUDA_SUCCESS) {
                set_error("node %u: setting launch attribute %u failed with %d", k->node_index, a->id, (int)r);
                return -1;
            }
        }
    }
    return 0;
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
