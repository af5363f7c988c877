/* Pinned host memory at deterministic addresses: cuMemHostAlloc / cuMemAllocHost (what cudaHostAlloc and
 * cudaMallocHost end in) and cuMemFreeHost.
 *
 * Why: a kernel reads mapped pinned memory through a device pointer that, under unified addressing, is the host
 * address (DeepEP's receive counters are such words in its dispatch kernels' parameters, so a captured graph holds
 * them). The driver picks that address, and it differs from process to process. With the region enabled and
 * GP_HOST_BASE set (graphpersist.memory.region.DEFAULT_HOST_BASE is the recommended range; unset or 0: placement
 * off, every pinned allocation is the driver's as upstream's), each allocation is instead placed at a bump cursor in
 * that one fixed host range (GP_HOST_SIZE bytes, default GP_HOST_DEFAULT_SIZE): opt-in, because only graphs that
 * read pinned memory (DeepEP's dispatch captured in a graph) need it, and every other workload keeps the driver's:
 * fresh shared anonymous pages mapped there, pinned and mapped for every device with cuMemHostRegister
 * (PORTABLE | DEVICEMAP, as cuMemHostAlloc memory is under unified addressing), and kept only when the device
 * pointer the driver gives for it equals the host address (CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM): then the same
 * allocation sequence gives the same addresses in every process, the graph's words included.
 *
 * Fail-closed: what cannot be placed exactly (placement off or not yet enabled, write-combined memory, the range
 * exhausted or not reservable, a failed registration, a device pointer that differs) is passed through to the
 * driver and logged as GP_EV_HOST_OUTSIDE with the reason; SAVE refuses any graph word that points into pinned
 * memory outside the placed allocations (graph/walk.py). Host events go to their own log (gp_host_events), never
 * into the device allocation log that phases compare. Freed host ranges are not reused: the cursor only grows. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "gp_state.h"

#define HOST_ALLOC_PORTABLE 0x01u      /* CU_MEMHOSTALLOC_PORTABLE */
#define HOST_ALLOC_WRITECOMBINED 0x04u /* CU_MEMHOSTALLOC_WRITECOMBINED: no cuMemHostRegister equivalent */
#define HOST_REGISTER_FLAGS 0x03u      /* CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP */
#define HOST_PAGE 4096ull

typedef struct {
    uint64_t addr, size;
    int placed; /* 1: ours (unregister + give the pages back at free); 0: the driver's, only tracked */
} hlive_t;

static gp_log_t g_hlog;
static hlive_t *g_hlive;
static size_t g_nhlive, g_caphlive;
static uint64_t g_hbase, g_hsize, g_hcursor;
static int g_hreserved; /* 1 reserved, -1 reservation failed (placement off from then on) */
static pthread_once_t g_henv_once = PTHREAD_ONCE_INIT;

static void read_host_env(void) {
    const char *b = getenv("GP_HOST_BASE"), *s = getenv("GP_HOST_SIZE");
    g_hbase = b && *b ? gp_parse_u64(b, NULL) : 0; /* unset: placement off */
    g_hsize = s && *s ? gp_parse_u64(s, NULL) : GP_HOST_DEFAULT_SIZE;
    g_hbase = gp_round_up(g_hbase, HOST_PAGE);
    g_hsize = gp_round_up(g_hsize, HOST_PAGE);
}

/* The host range as PROT_NONE address space, reserved on first use at exactly GP_HOST_BASE (the lock is held). */
static int host_reserve(void) {
    if (g_hreserved) return g_hreserved > 0 ? 0 : -1;
    g_hreserved = -1;
    if (!g_hbase || !g_hsize) return -1;
    void *p = mmap((void *)(uintptr_t)g_hbase, g_hsize, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
    if (p == MAP_FAILED || (uint64_t)(uintptr_t)p != g_hbase) {
        if (p != MAP_FAILED) munmap(p, g_hsize); /* an old kernel took the address as a hint */
        set_error("reserving the pinned host range at 0x%llx (%llu bytes) failed: %s; pinned host memory is left "
                  "to the driver (SAVE refuses graphs that read it). Set GP_HOST_BASE to a free range",
                  (unsigned long long)g_hbase, (unsigned long long)g_hsize,
                  p == MAP_FAILED ? strerror(errno) : "the kernel placed it elsewhere");
        return -1;
    }
    g_hreserved = 1;
    gp_log("host range reserved at 0x%llx size %llu", (unsigned long long)g_hbase, (unsigned long long)g_hsize);
    return 0;
}

static int hlive_grow(void) {
    if (g_nhlive < g_caphlive) return 0;
    size_t nc = g_caphlive ? g_caphlive * 2 : 64;
    hlive_t *p = realloc(g_hlive, nc * sizeof *p);
    if (!p) {
        set_error("out of host memory for the interposer's tables");
        return -1;
    }
    g_hlive = p;
    g_caphlive = nc;
    return 0;
}

/* Gives [addr, addr+size) back to the reservation: its pages are dropped, the address space stays ours. */
static void host_unmap(uint64_t addr, uint64_t size) {
    mmap((void *)(uintptr_t)addr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
}

/* Places `bytes` at the host cursor; 0 with *out set, or a GP_HOUT_* reason (nothing left behind, cursor as it
 * was). The lock is held. */
static uint32_t host_place(size_t bytes, unsigned int flags, void **out, uint64_t *mapped) {
    const gp_driver_t *d = gp_driver();
    if (flags & HOST_ALLOC_WRITECOMBINED) return GP_HOUT_WRITECOMBINED;
    if (!g_hbase) return GP_HOUT_OFF;
    if (host_reserve()) return GP_HOUT_RESERVE;
    if (!d->cuMemHostRegister_v2 || !d->cuMemHostUnregister || !d->cuMemHostGetDevicePointer_v2)
        return GP_HOUT_REGISTER;
    uint64_t sz = gp_round_up(bytes ? bytes : 1, HOST_PAGE);
    if (!sz || sz > g_hsize - g_hcursor) return GP_HOUT_EXHAUSTED;
    uint64_t addr = g_hbase + g_hcursor;
    void *p = mmap((void *)(uintptr_t)addr, sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS | MAP_FIXED, -1,
                   0);
    if (p == MAP_FAILED) return GP_HOUT_EXHAUSTED;
    CUresult r = d->cuMemHostRegister_v2(p, sz, HOST_REGISTER_FLAGS);
    if (r != CUDA_SUCCESS) {
        host_unmap(addr, sz);
        set_error("cuMemHostRegister(0x%llx, %llu) failed with %d: pinned memory left to the driver",
                  (unsigned long long)addr, (unsigned long long)sz, (int)r);
        return GP_HOUT_REGISTER;
    }
    CUdeviceptr dp = 0;
    r = d->cuMemHostGetDevicePointer_v2(&dp, p, 0);
    if (r != CUDA_SUCCESS || dp != addr) {
        d->cuMemHostUnregister(p);
        host_unmap(addr, sz);
        set_error("pinned host memory at 0x%llx has device pointer 0x%llx (result %d): this device cannot use the "
                  "host pointer, so it is left to the driver", (unsigned long long)addr, (unsigned long long)dp,
                  (int)r);
        return GP_HOUT_DEVPTR;
    }
    g_hcursor += sz;
    *out = p;
    *mapped = sz;
    return 0;
}

/* Both allocation hooks: placed when it can be exact, else the driver's call (`real`, with `flags` where it takes
 * them), logged either way. */
static CUresult host_alloc(void **pp, size_t bytes, unsigned int flags, int with_flags) {
    const gp_driver_t *d = gp_driver();
    if (with_flags ? !d->cuMemHostAlloc : !d->cuMemAllocHost_v2) return CUDA_ERROR_NOT_INITIALIZED;
    if (!pp) return CUDA_ERROR_INVALID_VALUE;
    pthread_once(&g_henv_once, read_host_env);
    pthread_mutex_lock(&g_lock);
    CUresult r;
    if (gp_log_reserve(&g_hlog) || hlive_grow()) {
        r = CUDA_ERROR_OUT_OF_MEMORY;
        goto out;
    }
    uint64_t mapped = 0;
    uint32_t why = enabled() ? host_place(bytes, flags, pp, &mapped) : GP_HOUT_NOT_ENABLED;
    if (why == 0) {
        gp_log_append(&g_hlog, GP_EV_HOST_ALLOC, (uint64_t)(uintptr_t)*pp, mapped, bytes);
        g_hlog.ev[g_hlog.n - 1].detail = flags;
        g_hlive[g_nhlive++] = (hlive_t){(uint64_t)(uintptr_t)*pp, mapped, 1};
        gp_log("host alloc 0x%llx size %llu (req %zu flags %u)", (unsigned long long)(uintptr_t)*pp,
               (unsigned long long)mapped, bytes, flags);
        r = CUDA_SUCCESS;
        goto out;
    }
    r = with_flags ? d->cuMemHostAlloc(pp, bytes, flags) : d->cuMemAllocHost_v2(pp, bytes);
    if (r == CUDA_SUCCESS) {
        gp_log_append(&g_hlog, GP_EV_HOST_OUTSIDE, (uint64_t)(uintptr_t)*pp, bytes, bytes);
        g_hlog.ev[g_hlog.n - 1].detail = why;
        g_hlive[g_nhlive++] = (hlive_t){(uint64_t)(uintptr_t)*pp, bytes, 0};
        gp_log("host alloc outside the host range (reason %u): %p size %zu", why, *pp, bytes);
    }
out:
    pthread_mutex_unlock(&g_lock);
    return r;
}

GP_EXPORT CUresult CUDAAPI cuMemHostAlloc(void **pp, size_t bytesize, unsigned int flags) {
    return host_alloc(pp, bytesize, flags, 1);
}

GP_EXPORT CUresult CUDAAPI cuMemAllocHost_v2(void **pp, size_t bytesize) {
    return host_alloc(pp, bytesize, HOST_ALLOC_PORTABLE, 0);
}

static long hlive_at(uint64_t addr) {
    for (size_t i = 0; i < g_nhlive; i++)
        if (g_hlive[i].addr == addr) return (long)i;
    return -1;
}

/* A placed allocation is unpinned and its pages dropped after the device finished pending work (it may still read
 * or write them; cuMemFree's reasoning in gp_mem.c, stream capture included); a tracked driver allocation goes
 * back to the driver. Either way the free is logged. */
GP_EXPORT CUresult CUDAAPI cuMemFreeHost(void *p) {
    NEED(cuMemFreeHost);
    uint64_t a = (uint64_t)(uintptr_t)p;
    pthread_mutex_lock(&g_lock);
    long i = hlive_at(a);
    int placed = i >= 0 && g_hlive[i].placed;
    pthread_mutex_unlock(&g_lock);
    CUresult r;
    if (placed) {
        if (!d->cuCtxSynchronize || !d->cuMemHostUnregister) return CUDA_ERROR_NOT_INITIALIZED;
        r = d->cuCtxSynchronize();
        if (r != CUDA_SUCCESS) {
            set_error("cuMemFreeHost(%p): synchronizing before the unpin failed with %d; nothing was freed", p, (int)r);
            return r;
        }
    }
    pthread_mutex_lock(&g_lock);
    i = hlive_at(a);
    if (i < 0 || !g_hlive[i].placed) {
        r = d->cuMemFreeHost(p);
    } else if ((r = d->cuMemHostUnregister(p)) == CUDA_SUCCESS) {
        host_unmap(a, g_hlive[i].size);
    } else {
        set_error("cuMemFreeHost(%p): cuMemHostUnregister failed with %d; the allocation stays", p, (int)r);
    }
    if (r == CUDA_SUCCESS && i >= 0) {
        if (gp_log_reserve(&g_hlog) == 0) gp_log_append(&g_hlog, GP_EV_HOST_FREE, a, g_hlive[i].size, 0);
        gp_log("host free %p", p);
        g_hlive[i] = g_hlive[--g_nhlive];
    }
    pthread_mutex_unlock(&g_lock);
    return r;
}

typedef struct {
    uint64_t base, size, cursor;
    int64_t reserved, n_events;
} gp_host_info_t;

/* Where the host range lies (base 0: placement off), how far its cursor got, how many host events there are. */
GP_EXPORT int gp_host_info(gp_host_info_t *out) {
    pthread_once(&g_henv_once, read_host_env);
    pthread_mutex_lock(&g_lock);
    out->base = g_hbase;
    out->size = g_hsize;
    out->cursor = g_hcursor;
    out->reserved = g_hreserved;
    out->n_events = (int64_t)g_hlog.n;
    pthread_mutex_unlock(&g_lock);
    return 0;
}

/* The host log (GP_EV_HOST_*): copies up to `cap` events, returns how many there are. */
GP_EXPORT size_t gp_host_events(gp_event_t *buf, size_t cap) {
    pthread_mutex_lock(&g_lock);
    size_t total = gp_log_copy(&g_hlog, buf, cap);
    pthread_mutex_unlock(&g_lock);
    return total;
}
