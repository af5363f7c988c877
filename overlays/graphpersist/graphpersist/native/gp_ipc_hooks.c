/* VMM-IPC: legacy IPC handles do not work on cuMem allocations, so region memory gets our own handles.
 * Ownership (gp_ipc.h): the exporter owns the allocation and one exported fd per allocation, which its fd server
 * thread hands out (SCM_RIGHTS; pidfd_getfd only with GP_IPC_TRANSPORT=pidfd) until it frees the allocation and
 * closes the fd; the importer fetches a duplicate of that fd, imports it, maps it into its own region at the next
 * deterministic place and is the only one who unmaps and releases it (cuIpcCloseMemHandle, last reference). The
 * physical memory lives until both sides let go, so an exporter exiting first does not invalidate a live mapping.
 * Like legacy IPC, a handle names the whole allocation and open returns its base. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "gp_state.h"

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
    int transport = gp_ipc_transport(getenv("GP_IPC_TRANSPORT"));
    pthread_mutex_lock(&g_lock);
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    live_t *l = live_containing(dptr);
    if (transport < 0) {
        set_error("cuIpcGetMemHandle: GP_IPC_TRANSPORT='%s': %s", getenv("GP_IPC_TRANSPORT"),
                  gp_ipc_strerror(transport));
    } else if (!l) {
        set_error("cuIpcGetMemHandle(0x%llx): not inside a live region allocation", (unsigned long long)dptr);
    } else if (l->fd < 0 && (!exp || (r = exp(&l->fd, l->h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)) !=
                                         CUDA_SUCCESS)) {
        l->fd = -1;
        set_error("cuIpcGetMemHandle(0x%llx): exporting a file descriptor failed with %d", (unsigned long long)dptr,
                  (int)r);
    } else {
        if (!l->export_id) l->export_id = new_export_id();
        int e = gp_ipc_export(handle->reserved, l->fd, l->addr, l->size, 0, l->export_id, transport);
        if (e == 0) {
            gp_log("ipc export 0x%llx size %llu fd %d (%s)", (unsigned long long)l->addr,
                   (unsigned long long)l->size, l->fd, transport == GP_IPC_F_SCM ? "scm" : "pidfd");
            r = CUDA_SUCCESS;
        } else {
            set_error("cuIpcGetMemHandle(0x%llx): serving the exported fd failed: %s", (unsigned long long)dptr,
                      gp_ipc_strerror(e));
        }
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
    int fd, got = gp_ipc_fetch(h, &fd);
    if (got != 0) {
        set_error("cuIpcOpenMemHandle: cannot fetch the allocation from exporter pid %u (%s transport): %s", h->pid,
                  h->flags == GP_IPC_F_PIDFD ? "pidfd" : "scm", gp_ipc_strerror(got));
        return CUDA_ERROR_INVALID_HANDLE;
    }
    CUmemGenericAllocationHandle mh;
    CUresult r = imp(&mh, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    close(fd); /* the imported handle holds the memory now */
    if (r != CUDA_SUCCESS) {
        set_error("cuIpcOpenMemHandle: importing the exporter's fd failed with %d", (int)r);
        return r;
    }
    gp_ipc_transition(&e->state, GP_IPC_EV_IMPORT);
    uint64_t addr, mapped;
    int reused;
    if (next_range(h->size, 0, &addr, &mapped, &reused) || mapped != h->size) {
        release(mh);
        gp_ipc_transition(&e->state, GP_IPC_EV_RELEASE);
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
        gp_ipc_transition(&e->state, GP_IPC_EV_RELEASE);
        set_error("cuIpcOpenMemHandle: mapping the peer allocation failed with %d", (int)r);
        return r;
    }
    gp_ipc_transition(&e->state, GP_IPC_EV_MAP);
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
        set_error("cuIpcOpenMemHandle: a graphpersist handle that does not decode: %s", gp_ipc_strerror(d));
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
            gp_ipc_transition(&e->state, GP_IPC_EV_RELEASE);
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
