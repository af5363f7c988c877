/* Region placement and the memory hooks: alloc, pitch, free, reserve, address free, map, unmap, managed, async.
 *
 * Every path that fails rolls back completely: host memory (live table, log room) is secured before the first
 * driver call, a driver failure undoes the calls before it, and the range goes back to the cursor or free list it
 * came from, so the next allocation lands where it would have landed without the failure. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gp_state.h"

/* Memory libraries mapped themselves into reservations we carved (torch's expandable segments, NCCL's buffers). */
static gp_range_t *g_libmaps;
static size_t g_nlibmaps, g_caplibmaps;

/* Room for one more entry (fault site live_grow, checked on every call so a test need not fill the table). */
static int grow_table(void **arr, size_t *cap, size_t n, size_t elem) {
    int fault = gp_fault("live_grow");
    if (n < *cap && !fault) return 0;
    size_t nc = *cap ? *cap * 2 : 256;
    void *p = fault ? NULL : realloc(*arr, nc * elem);
    if (!p) {
        set_error("out of host memory for the interposer's tables");
        return -1;
    }
    *arr = p;
    *cap = nc;
    return 0;
}

/* Reserve the region once a context exists (first intercepted allocation). */
int ensure_region(void) {
    if (g_bump.base) return 0;
    if (g_failed) return -1;
    const gp_driver_t *d = gp_driver();
    if (!d->cuMemAddressReserve || !d->cuMemGetAllocationGranularity || !d->cuCtxGetDevice ||
        !d->cuDeviceTotalMem_v2) {
        set_error("driver entry points missing");
        g_failed = 1;
        return -1;
    }
    if (d->cuCtxGetDevice(&g_dev) != CUDA_SUCCESS) {
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
    if (d->cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) != CUDA_SUCCESS || g == 0)
        g = 2u << 20;
    if (g_want_size == 0) {
        size_t mem = 0;
        if (d->cuDeviceTotalMem_v2(&mem, g_dev) != CUDA_SUCCESS || mem == 0) {
            set_error("cannot read the device's memory size to size the region (set GP_REGION_SIZE)");
            g_failed = 1;
            return -1;
        }
        g_want_size = gp_round_up(GP_SIZE_FACTOR * (uint64_t)mem, 1ull << 30);
    }
    CUdeviceptr got = 0;
    CUresult r = FAULTY("reserve", d->cuMemAddressReserve(&got, g_want_size, 0, (CUdeviceptr)g_want_base, 0));
    if (r != CUDA_SUCCESS || got != g_want_base) {
        set_error("region reservation at 0x%llx (%llu bytes) failed: result %d, got 0x%llx",
                  (unsigned long long)g_want_base, (unsigned long long)g_want_size, (int)r, (unsigned long long)got);
        if (r == CUDA_SUCCESS && d->cuMemAddressFree) d->cuMemAddressFree(got, g_want_size);
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
    const gp_driver_t *d = gp_driver();
    if (!d->cuMemMap || !d->cuMemSetAccess || !d->cuMemUnmap) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = FAULTY("map", d->cuMemMap((CUdeviceptr)addr, size, 0, h, 0));
    if (r != CUDA_SUCCESS) return r;
    CUmemAccessDesc acc;
    memset(&acc, 0, sizeof acc);
    acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc.location.id = g_dev;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = FAULTY("access", d->cuMemSetAccess((CUdeviceptr)addr, size, &acc, 1));
    if (r != CUDA_SUCCESS) d->cuMemUnmap((CUdeviceptr)addr, size);
    return r;
}

void unmap_release(uint64_t addr, uint64_t size, CUmemGenericAllocationHandle h) {
    const gp_driver_t *d = gp_driver();
    if (d->cuMemUnmap) d->cuMemUnmap((CUdeviceptr)addr, size);
    if (d->cuMemRelease) d->cuMemRelease(h);
}

/* Create + map + grant access for [addr, addr+size), entered in the live table; on failure nothing is left. */
CUresult map_at(uint64_t addr, uint64_t size) {
    const gp_driver_t *d = gp_driver();
    if (!d->cuMemCreate || !d->cuMemRelease) return CUDA_ERROR_NOT_INITIALIZED;
    if (grow_table((void **)&g_live, &g_caplive, g_nlive, sizeof *g_live)) return CUDA_ERROR_OUT_OF_MEMORY;
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = g_dev;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    CUmemGenericAllocationHandle h;
    CUresult r = FAULTY("create", d->cuMemCreate(&h, size, &prop, 0));
    if (r != CUDA_SUCCESS) return r;
    r = map_with_access(addr, size, h);
    if (r != CUDA_SUCCESS) {
        d->cuMemRelease(h);
        return r;
    }
    live_t *l = &g_live[g_nlive++];
    l->addr = addr;
    l->h = h;
    l->size = size;
    l->fd = -1;
    l->export_id = 0;
    return CUDA_SUCCESS;
}

int in_region(uint64_t a) { return g_bump.base && a >= g_bump.base && a < g_bump.base + g_bump.size; }

/* Device memory outside the region is logged in two steps around the driver call, so the event is never lost:
 * outside_begin takes the lock and secures room in the log (else the call is not made: OUT_OF_MEMORY), outside_end
 * logs the event if the call succeeded and drops the lock. */
static int outside_begin(void) {
    pthread_mutex_lock(&g_lock);
    if (log_reserve() == 0) return 0;
    pthread_mutex_unlock(&g_lock);
    return -1;
}

/* Appends the event into room log_reserve() secured. */
static void log_outside_locked(uint64_t addr, uint64_t size, uint32_t why) {
    gp_log_append(&g_log, GP_EV_OUTSIDE, addr, size, size);
    g_log.ev[g_log.n - 1].detail = why;
    gp_log("outside the region (reason %u): 0x%llx size %llu", why, (unsigned long long)addr,
           (unsigned long long)size);
}

static void outside_end(CUresult r, uint64_t addr, uint64_t size, uint32_t why) {
    if (r == CUDA_SUCCESS) log_outside_locked(addr, size, why);
    pthread_mutex_unlock(&g_lock);
}

/* One region, one device: an allocation with another device current would land in memory LOAD cannot place. */
static int same_device(void) {
    const gp_driver_t *d = gp_driver();
    CUdevice dev;
    if (!d->cuCtxGetDevice || d->cuCtxGetDevice(&dev) != CUDA_SUCCESS) {
        set_error("allocation without a current CUDA context");
        return 0;
    }
    if (dev == g_dev) return 1;
    set_error("allocation with device %d current, but the region belongs to device %d (one device per process)",
              (int)dev, (int)g_dev);
    return 0;
}

/* Where the next `size` bytes go: a freed range once the layout is frozen, else the bump cursor. On failure the
 * cursor is where it was. */
int next_range(uint64_t bytes, uint64_t align, uint64_t *addr, uint64_t *mapped, int *reused) {
    uint64_t sz = gp_round_up(bytes ? bytes : 1, g_bump.gran);
    *reused = 0;
    if (sz && g_reuse && gp_free_take(&g_free, sz, align > g_bump.gran ? align : g_bump.gran, addr) == 0) {
        *mapped = sz;
        *reused = 1;
        return 0;
    }
    uint64_t saved = g_bump.cursor;
    if (align > g_bump.gran) {
        uint64_t a = gp_round_up(g_bump.base + g_bump.cursor, align);
        if (a == 0 || a - g_bump.base > g_bump.size) return -1;
        g_bump.cursor = a - g_bump.base;
    }
    if (gp_bump_place(&g_bump, bytes, addr, mapped) == 0) return 0;
    g_bump.cursor = saved;
    return -1;
}

/* A range from next_range() that ends up unused: back to the free list (merging with the neighbours it was split
 * from, so no host allocation is needed) or the cursor back to where it was before next_range(). */
void give_back(uint64_t addr, uint64_t mapped, int reused, uint64_t saved_cursor) {
    if (reused)
        gp_free_add(&g_free, addr, mapped);
    else
        g_bump.cursor = saved_cursor;
}

static CUresult place(CUdeviceptr *dptr, size_t bytes) {
    if (ensure_region()) return CUDA_ERROR_OUT_OF_MEMORY;
    if (log_reserve()) return CUDA_ERROR_OUT_OF_MEMORY;
    if (!same_device()) {
        gp_log_append(&g_log, GP_EV_REFUSED, 0, 0, bytes);
        return CUDA_ERROR_INVALID_DEVICE;
    }
    uint64_t addr, mapped, saved = g_bump.cursor;
    int reused;
    if (next_range(bytes, 0, &addr, &mapped, &reused)) {
        gp_log_append(&g_log, GP_EV_REFUSED, 0, 0, bytes);
        set_error("region exhausted: %zu bytes requested at offset %llu of %llu", bytes,
                  (unsigned long long)g_bump.cursor, (unsigned long long)g_bump.size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    CUresult r = map_at(addr, mapped);
    if (r != CUDA_SUCCESS) { /* nothing mapped: give the VA back so the sequence stays deterministic */
        give_back(addr, mapped, reused, saved);
        set_error("allocating %zu bytes at 0x%llx failed with %d", bytes, (unsigned long long)addr, (int)r);
        return r;
    }
    gp_log_append(&g_log, GP_EV_ALLOC, addr, mapped, bytes);
    gp_log("alloc 0x%llx size %llu (req %zu)", (unsigned long long)addr, (unsigned long long)mapped, bytes);
    *dptr = (CUdeviceptr)addr;
    return CUDA_SUCCESS;
}

GP_EXPORT CUresult CUDAAPI cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    NEED(cuMemAlloc_v2);
    if (!enabled()) {
        if (outside_begin()) return CUDA_ERROR_OUT_OF_MEMORY;
        CUresult r = d->cuMemAlloc_v2(dptr, bytesize);
        outside_end(r, r == CUDA_SUCCESS ? *dptr : 0, bytesize, GP_OUT_NOT_ENABLED);
        return r;
    }
    pthread_mutex_lock(&g_lock);
    CUresult r = place(dptr, bytesize);
    pthread_mutex_unlock(&g_lock);
    return r;
}

GP_EXPORT CUresult CUDAAPI cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t w, size_t h, unsigned int e) {
    NEED(cuMemAllocPitch_v2);
    if (!enabled()) {
        if (outside_begin()) return CUDA_ERROR_OUT_OF_MEMORY;
        CUresult r = d->cuMemAllocPitch_v2(dptr, pitch, w, h, e);
        outside_end(r, r == CUDA_SUCCESS ? *dptr : 0, r == CUDA_SUCCESS ? *pitch * h : 0, GP_OUT_NOT_ENABLED);
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

static live_t *live_at(uint64_t addr) {
    for (size_t i = 0; i < g_nlive; i++)
        if (g_live[i].addr == addr) return &g_live[i];
    return NULL;
}

/* cuMemFree waits for the work pending on the device before it releases memory; unmap + release do not, and a
 * kernel still running on the range would fault, or, once freed ranges are reused after freeze(), write into the
 * next allocation. So a region free synchronizes the context first, as cuMemFree does, and fails with its error
 * (nothing freed) when that fails. During stream capture cuCtxSynchronize is not permitted: the free then fails
 * with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and the driver invalidates the capture (measured on an H200, CUDA 13.0,
 * in the relaxed mode as in the global one), and the allocation stays live until a free after capture. torch's
 * caching allocator never frees device memory while a capture is under way. */
GP_EXPORT CUresult CUDAAPI cuMemFree_v2(CUdeviceptr dptr) {
    NEED(cuMemFree_v2);
    if (!enabled() || !in_region(dptr)) return d->cuMemFree_v2(dptr);
    if (!d->cuCtxSynchronize || !d->cuMemUnmap || !d->cuMemRelease) return CUDA_ERROR_NOT_INITIALIZED;
    pthread_mutex_lock(&g_lock);
    int ours = live_at(dptr) != NULL;
    pthread_mutex_unlock(&g_lock);
    if (!ours) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = FAULTY("sync", d->cuCtxSynchronize()); /* not under the lock: other threads keep allocating */
    if (r != CUDA_SUCCESS) {
        set_error("cuMemFree(0x%llx): synchronizing before the unmap failed with %d; nothing was freed",
                  (unsigned long long)dptr, (int)r);
        return r;
    }
    pthread_mutex_lock(&g_lock);
    live_t *l = live_at(dptr);
    if (!l) {
        r = CUDA_ERROR_INVALID_VALUE; /* another thread freed it meanwhile */
    } else if (log_reserve()) {
        r = CUDA_ERROR_OUT_OF_MEMORY;
    } else if ((r = FAULTY("unmap", d->cuMemUnmap(dptr, l->size))) != CUDA_SUCCESS) {
        set_error("cuMemFree(0x%llx): unmap failed with %d; the allocation stays live", (unsigned long long)dptr,
                  (int)r);
    } else if ((r = FAULTY("release", d->cuMemRelease(l->h))) != CUDA_SUCCESS) {
        if (map_with_access(dptr, l->size, l->h) == CUDA_SUCCESS)
            set_error("cuMemFree(0x%llx): release failed with %d; the allocation was mapped again and stays live",
                      (unsigned long long)dptr, (int)r);
        else /* neither freed nor usable: the range stays in the live table, so it is never handed out again */
            set_error("cuMemFree(0x%llx): release failed with %d and mapping it again failed too; the range is "
                      "withdrawn from the region", (unsigned long long)dptr, (int)r);
    } else {
        gp_log_append(&g_log, GP_EV_FREE, dptr, l->size, 0);
        if (l->fd >= 0) { /* the exporter's side ends here; importers keep theirs */
            gp_ipc_unserve(l->export_id);
            close(l->fd);
        }
        gp_free_add(&g_free, dptr, l->size);
        gp_log("free 0x%llx", (unsigned long long)dptr);
        *l = g_live[--g_nlive];
    }
    pthread_mutex_unlock(&g_lock);
    return r;
}

/* Reservations made by libraries (NCCL, NVSHMEM) are carved from the region when they ask for no address. */
GP_EXPORT CUresult CUDAAPI cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                               unsigned long long flags) {
    NEED(cuMemAddressReserve);
    if (!enabled()) return d->cuMemAddressReserve(ptr, size, alignment, addr, flags);
    if (addr != 0) {
        if (outside_begin()) return CUDA_ERROR_OUT_OF_MEMORY;
        CUresult r = d->cuMemAddressReserve(ptr, size, alignment, addr, flags);
        outside_end(r, r == CUDA_SUCCESS ? *ptr : 0, size, GP_OUT_HINT);
        return r;
    }
    if (alignment & (alignment - 1)) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    CUresult r = CUDA_ERROR_OUT_OF_MEMORY;
    if (ensure_region() == 0 && log_reserve() == 0) {
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

static int libmap_inside(uint64_t lo, uint64_t size) {
    for (size_t i = 0; i < g_nlibmaps; i++)
        if (g_libmaps[i].addr >= lo && g_libmaps[i].addr - lo < size) return 1;
    return 0;
}

/* A carved reservation goes back to the region (reused once the layout is frozen), never to the driver; one that
 * still has memory mapped into it is refused, so a mapped range is never handed out again. */
GP_EXPORT CUresult CUDAAPI cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    NEED(cuMemAddressFree);
    if (!enabled() || !in_region(ptr)) return d->cuMemAddressFree(ptr, size);
    pthread_mutex_lock(&g_lock);
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    long i = gp_log_find_reservation(&g_log, ptr);
    if (i >= 0 && g_log.ev[i].addr == ptr) {
        uint64_t mapped = g_log.ev[i].size;
        if (libmap_inside(ptr, mapped)) {
            set_error("cuMemAddressFree(0x%llx): memory is still mapped in the reservation (unmap it first)",
                      (unsigned long long)ptr);
        } else if (log_reserve()) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            gp_log_append(&g_log, GP_EV_UNRESERVE, ptr, mapped, size);
            gp_free_add(&g_free, ptr, mapped);
            r = CUDA_SUCCESS;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return r;
}

/* Physical memory a library maps itself must go into a range we handed out (a carved reservation): it is logged
 * (GP_EV_LIB_MAP, req = offset inside the reservation) so LOAD knows it was there and SAVE knows it backs graph
 * addresses. Anywhere else it is an `outside` event. */
GP_EXPORT CUresult CUDAAPI cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                                    unsigned long long flags) {
    NEED(cuMemMap);
    if (!enabled()) return d->cuMemMap(ptr, size, offset, h, flags);
    pthread_mutex_lock(&g_lock);
    long i = in_region(ptr) ? gp_log_find_reservation(&g_log, ptr) : -1;
    const gp_event_t *res = i >= 0 ? &g_log.ev[i] : NULL;
    CUresult r = CUDA_ERROR_OUT_OF_MEMORY;
    if (!res || size > res->size - (ptr - res->addr)) { /* not wholly inside one reservation of ours */
        if (log_reserve() == 0 && (r = d->cuMemMap(ptr, size, offset, h, flags)) == CUDA_SUCCESS)
            log_outside_locked(ptr, size, GP_OUT_MAP);
    } else if (log_reserve() == 0 &&
               grow_table((void **)&g_libmaps, &g_caplibmaps, g_nlibmaps, sizeof *g_libmaps) == 0) {
        uint64_t base = res->addr; /* read before the append below may move the log */
        r = d->cuMemMap(ptr, size, offset, h, flags);
        if (r == CUDA_SUCCESS) {
            gp_log_append(&g_log, GP_EV_LIB_MAP, ptr, size, ptr - base);
            g_libmaps[g_nlibmaps].addr = ptr;
            g_libmaps[g_nlibmaps++].size = size;
            gp_log("library map 0x%llx size %llu", (unsigned long long)ptr, (unsigned long long)size);
        }
    }
    pthread_mutex_unlock(&g_lock);
    return r;
}

/* The other half of cuMemMap: a library's unmap inside its reservation is logged (GP_EV_LIB_UNMAP). */
GP_EXPORT CUresult CUDAAPI cuMemUnmap(CUdeviceptr ptr, size_t size) {
    NEED(cuMemUnmap);
    if (!enabled() || !in_region(ptr)) return d->cuMemUnmap(ptr, size);
    pthread_mutex_lock(&g_lock);
    long i = gp_log_find_reservation(&g_log, ptr);
    CUresult r = CUDA_ERROR_OUT_OF_MEMORY;
    if (i < 0) {
        r = d->cuMemUnmap(ptr, size);
    } else if (log_reserve() == 0) {
        uint64_t base = g_log.ev[i].addr;
        r = d->cuMemUnmap(ptr, size);
        if (r == CUDA_SUCCESS) {
            gp_log_append(&g_log, GP_EV_LIB_UNMAP, ptr, size, ptr - base);
            for (size_t k = 0; k < g_nlibmaps;)
                if (g_libmaps[k].addr >= ptr && g_libmaps[k].addr - ptr < size)
                    g_libmaps[k] = g_libmaps[--g_nlibmaps];
                else
                    k++;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return r;
}

GP_EXPORT CUresult CUDAAPI cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    NEED(cuMemAllocManaged);
    if (!enabled()) return d->cuMemAllocManaged(dptr, bytesize, flags);
    if (outside_begin()) return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = d->cuMemAllocManaged(dptr, bytesize, flags);
    outside_end(r, r == CUDA_SUCCESS ? *dptr : 0, bytesize, GP_OUT_MANAGED);
    return r;
}

live_t *live_containing(uint64_t p) {
    for (size_t i = 0; i < g_nlive; i++)
        if (p >= g_live[i].addr && p < g_live[i].addr + g_live[i].size) return &g_live[i];
    return NULL;
}

/* Region memory lives inside one big reservation, so the driver answers RANGE_START_ADDR / RANGE_SIZE with the whole
 * region. Code that shares memory over IPC (vLLM's and SGLang's custom all-reduce, DeepEP) asks for the allocation's
 * base before cuIpcGetMemHandle, as cudaMalloc memory would give it: answer with the allocation, as legacy memory. */
static int allocation_of(uint64_t p, uint64_t *base, uint64_t *size) {
    if (!enabled() || !in_region(p)) return 0;
    pthread_mutex_lock(&g_lock);
    live_t *l = live_containing(p);
    if (l) {
        *base = l->addr;
        *size = l->size;
    }
    pthread_mutex_unlock(&g_lock);
    return l != NULL;
}

static void answer_range(CUpointer_attribute attr, void *data, uint64_t base, uint64_t size) {
    if (attr == CU_POINTER_ATTRIBUTE_RANGE_START_ADDR) *(CUdeviceptr *)data = base;
    if (attr == CU_POINTER_ATTRIBUTE_RANGE_SIZE) *(size_t *)data = size;
}

GP_EXPORT CUresult CUDAAPI cuPointerGetAttribute(void *data, CUpointer_attribute attr, CUdeviceptr ptr) {
    NEED(cuPointerGetAttribute);
    uint64_t base, size;
    int range = attr == CU_POINTER_ATTRIBUTE_RANGE_START_ADDR || attr == CU_POINTER_ATTRIBUTE_RANGE_SIZE;
    if (range && data && allocation_of(ptr, &base, &size)) {
        answer_range(attr, data, base, size);
        return CUDA_SUCCESS;
    }
    return d->cuPointerGetAttribute(data, attr, ptr);
}

GP_EXPORT CUresult CUDAAPI cuPointerGetAttributes(unsigned int n, CUpointer_attribute *attrs, void **data,
                                                  CUdeviceptr ptr) {
    NEED(cuPointerGetAttributes);
    CUresult r = d->cuPointerGetAttributes(n, attrs, data, ptr);
    uint64_t base, size;
    if (r == CUDA_SUCCESS && attrs && data && allocation_of(ptr, &base, &size))
        for (unsigned int i = 0; i < n; i++)
            if (data[i]) answer_range(attrs[i], data[i], base, size);
    return r;
}

static CUresult async_refused(const char *what, size_t bytes) {
    pthread_mutex_lock(&g_lock);
    if (log_reserve() == 0) gp_log_append(&g_log, GP_EV_REFUSED, 0, 0, bytes);
    set_error("%s (stream-ordered pools) cannot be placed in the region; use the default caching allocator "
              "(no cudaMallocAsync backend in PYTORCH_CUDA_ALLOC_CONF)", what);
    pthread_mutex_unlock(&g_lock);
    return CUDA_ERROR_NOT_SUPPORTED;
}

#define ASYNC_HOOK(name, params, args)                 \
    GP_EXPORT CUresult CUDAAPI name params {           \
        NEED(name);                                    \
        if (!enabled()) return d->name args;           \
        return async_refused(#name, bytesize);         \
    }
ASYNC_HOOK(cuMemAllocAsync, (CUdeviceptr * dptr, size_t bytesize, CUstream s), (dptr, bytesize, s))
ASYNC_HOOK(cuMemAllocAsync_ptsz, (CUdeviceptr * dptr, size_t bytesize, CUstream s), (dptr, bytesize, s))
ASYNC_HOOK(cuMemAllocFromPoolAsync, (CUdeviceptr * dptr, size_t bytesize, CUmemoryPool p, CUstream s),
           (dptr, bytesize, p, s))
ASYNC_HOOK(cuMemAllocFromPoolAsync_ptsz, (CUdeviceptr * dptr, size_t bytesize, CUmemoryPool p, CUstream s),
           (dptr, bytesize, p, s))
