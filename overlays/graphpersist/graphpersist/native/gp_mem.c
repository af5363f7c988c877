/* Region placement and the memory hooks: alloc, pitch, free, reserve, address free, map, managed, async. */
#define _GNU_SOURCE
#include <string.h>
#include <unistd.h>

#include "gp_state.h"

/* Reserve the region once a context exists (first intercepted allocation). */
int ensure_region(void) {
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
CUresult map_with_access(uint64_t addr, uint64_t size, CUmemGenericAllocationHandle h) {
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
CUresult map_at(uint64_t addr, uint64_t size) {
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

int in_region(uint64_t a) { return g_bump.base && a >= g_bump.base && a < g_bump.base + g_bump.size; }

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
int next_range(uint64_t bytes, uint64_t align, uint64_t *addr, uint64_t *mapped, int *reused) {
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
        if (g_live[i].fd >= 0) { /* the exporter's side ends here; importers keep theirs */
            gp_ipc_unserve(g_live[i].export_id);
            close(g_live[i].fd);
        }
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

live_t *live_containing(uint64_t p) {
    for (size_t i = 0; i < g_nlive; i++)
        if (p >= g_live[i].addr && p < g_live[i].addr + g_live[i].size) return &g_live[i];
    return NULL;
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
