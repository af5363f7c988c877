/* VMM-IPC: legacy IPC handles do not work on cuMem allocations, so region memory gets our own handles.
 * Ownership (gp_ipc.h): the exporter owns the allocation and one exported fd per allocation, which its fd server
 * thread hands out (SCM_RIGHTS; pidfd_getfd only with GP_IPC_TRANSPORT=pidfd) until it frees the allocation and
 * closes the fd; the importer fetches a duplicate of that fd, imports it, maps it into its own region at the next
 * deterministic place and is the only one who unmaps and releases it (cuIpcCloseMemHandle, last reference). The
 * physical memory lives until both sides let go, so an exporter exiting first does not invalidate a live mapping.
 * Like legacy IPC, a handle names the whole allocation and open returns its base. */
#define _GNU_SOURCE
#include <errno.h>
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
    NEED(cuIpcGetMemHandle);
    if (!enabled() || !in_region(dptr)) return d->cuIpcGetMemHandle(handle, dptr);
    __typeof__(d->cuMemExportToShareableHandle) exp = d->cuMemExportToShareableHandle;
    int transport = gp_ipc_transport(getenv("GP_IPC_TRANSPORT"));
    pthread_mutex_lock(&g_lock);
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    live_t *l = live_containing(dptr);
    if (transport < 0) {
        set_error("cuIpcGetMemHandle: GP_IPC_TRANSPORT='%s': %s", getenv("GP_IPC_TRANSPORT"),
                  gp_ipc_strerror(transport));
    } else if (!l) {
        set_error("cuIpcGetMemHandle(0x%llx): not inside a live region allocation", (unsigned long long)dptr);
    } else if (l->fd < 0 && (!exp || (r = FAULTY("export", exp(&l->fd, l->h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                                                   0))) != CUDA_SUCCESS)) {
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

/* Imports and maps one peer allocation (the lock is held). On failure nothing is left: the fd copy is closed, the
 * imported handle released, the range given back to the cursor or free list. */
static CUresult ipc_import(gp_ipc_import_t *e, const gp_ipc_handle_t *h) {
    const gp_driver_t *d = gp_driver();
    if (!d->cuMemImportFromShareableHandle || !d->cuMemRelease) return CUDA_ERROR_NOT_INITIALIZED;
    if (log_reserve()) return CUDA_ERROR_OUT_OF_MEMORY;
    int fd = -1, got = gp_fault("fd") ? -EBADF : gp_ipc_fetch(h, &fd);
    if (got != 0) {
        set_error("cuIpcOpenMemHandle: cannot fetch the allocation from exporter pid %u (%s transport): %s", h->pid,
                  h->flags == GP_IPC_F_PIDFD ? "pidfd" : "scm", gp_ipc_strerror(got));
        return CUDA_ERROR_INVALID_HANDLE;
    }
    CUmemGenericAllocationHandle mh;
    CUresult r = FAULTY("import", d->cuMemImportFromShareableHandle(&mh, (void *)(intptr_t)fd,
                                                                     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    close(fd); /* the imported handle holds the memory now */
    if (r != CUDA_SUCCESS) {
        set_error("cuIpcOpenMemHandle: importing the exporter's fd failed with %d", (int)r);
        return r;
    }
    gp_ipc_transition(&e->state, GP_IPC_EV_IMPORT);
    uint64_t addr, mapped, saved = g_bump.cursor;
    int reused;
    if (next_range(h->size, 0, &addr, &mapped, &reused)) {
        r = CUDA_ERROR_OUT_OF_MEMORY;
        set_error("cuIpcOpenMemHandle: no room for %llu bytes in the region", (unsigned long long)h->size);
    } else if (mapped != h->size) {
        give_back(addr, mapped, reused, saved);
        r = CUDA_ERROR_OUT_OF_MEMORY;
        set_error("cuIpcOpenMemHandle: the peer allocation's size %llu is not a multiple of the granularity",
                  (unsigned long long)h->size);
    } else if ((r = map_with_access(addr, mapped, mh)) != CUDA_SUCCESS) {
        give_back(addr, mapped, reused, saved);
        set_error("cuIpcOpenMemHandle: mapping the peer allocation failed with %d", (int)r);
    }
    if (r != CUDA_SUCCESS) {
        d->cuMemRelease(mh);
        gp_ipc_transition(&e->state, GP_IPC_EV_RELEASE);
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
    NEED(cuIpcOpenMemHandle_v2);
    gp_ipc_handle_t h;
    int dec = gp_ipc_decode(handle.reserved, &h);
    if (dec == GP_IPC_E_NOT_OURS) return d->cuIpcOpenMemHandle_v2(pdptr, handle, flags); /* a legacy handle */
    if (dec != 0) {
        set_error("cuIpcOpenMemHandle: a graphpersist handle that does not decode: %s", gp_ipc_strerror(dec));
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

/* The import handing out `ptr`, or NULL (the lock is held). */
static gp_ipc_import_t *import_at(uint64_t ptr) {
    for (size_t i = 0; i < g_imports.n; i++) {
        gp_ipc_import_t *e = &g_imports.e[i];
        if (e->state == GP_IPC_MAPPED && e->map_addr + e->offset == ptr) return e;
    }
    return NULL;
}

/* The last close unmaps, so it first waits for pending work like cuMemFree does (see there, also for stream
 * capture), outside the lock; any failure after that undoes the close: the mapping stays, with its reference. */
GP_EXPORT CUresult CUDAAPI cuIpcCloseMemHandle(CUdeviceptr dptr) {
    NEED(cuIpcCloseMemHandle);
    if (!d->cuCtxSynchronize || !d->cuMemUnmap || !d->cuMemRelease) return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = CUDA_SUCCESS;
    int synced = 0;
    pthread_mutex_lock(&g_lock);
    for (;;) {
        gp_ipc_import_t *e = import_at(dptr);
        if (!e) break;
        if (e->refs == 1 && !synced) {
            pthread_mutex_unlock(&g_lock);
            r = FAULTY("sync", d->cuCtxSynchronize());
            if (r != CUDA_SUCCESS) {
                set_error("cuIpcCloseMemHandle(0x%llx): synchronizing before the unmap failed with %d; the mapping "
                          "stays", (unsigned long long)dptr, (int)r);
                return r;
            }
            synced = 1;
            pthread_mutex_lock(&g_lock);
            continue; /* look again: another thread may have opened or closed it meanwhile */
        }
        if (e->refs == 1 && log_reserve()) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else if (gp_ipc_table_close(&g_imports, dptr, NULL) == 1) {
            r = FAULTY("unmap", d->cuMemUnmap(e->map_addr, e->size));
            if (r == CUDA_SUCCESS) {
                r = FAULTY("release", d->cuMemRelease((CUmemGenericAllocationHandle)e->cu_handle));
                if (r != CUDA_SUCCESS && map_with_access(e->map_addr, e->size, e->cu_handle) != CUDA_SUCCESS) {
                    set_error("cuIpcCloseMemHandle(0x%llx): release failed with %d and mapping it again failed too; "
                              "the range is withdrawn from the region", (unsigned long long)dptr, (int)r);
                    pthread_mutex_unlock(&g_lock); /* stays RELEASED, its range never handed out again */
                    return r;
                }
            }
            if (r == CUDA_SUCCESS) {
                gp_log_append(&g_log, GP_EV_IPC_CLOSE, e->map_addr, e->size, 0);
                gp_free_add(&g_free, e->map_addr, e->size);
            } else { /* undo the CLOSE: the mapping is there and referenced, as before the call */
                e->state = GP_IPC_MAPPED;
                e->refs = 1;
                set_error("cuIpcCloseMemHandle(0x%llx): unmapping or releasing failed with %d; the mapping stays",
                          (unsigned long long)dptr, (int)r);
            }
        }
        pthread_mutex_unlock(&g_lock);
        return r;
    }
    pthread_mutex_unlock(&g_lock);
    return d->cuIpcCloseMemHandle(dptr); /* not ours: a legacy mapping */
}
