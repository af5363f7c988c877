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
 * GP_EV_OUTSIDE, and SAVE refuses; stream-ordered pools and a second device are refused outright.
 *
 * The sources, one concern each, share the process state declared here (defined in gp_state.c):
 *   gp_state.c       globals, diagnostics, environment
 *   gp_lookup.c      the real driver and dlsym, the hook table, the dlsym and cuGetProcAddress hooks
 *   gp_mem.c         region placement and the memory hooks (alloc/free/reserve/map/managed/async)
 *   gp_ipc_hooks.c   VMM-IPC hooks (cuIpcGetMemHandle/Open/Close)
 *   gp_host.c        pinned host memory at fixed host addresses (cuMemHostAlloc/AllocHost/FreeHost)
 *   gp_image_hooks.c module and library loads
 *   gp_control.c     the gp_* control surface Python calls (region info, enable, events, images, restore,
 *                    set_cursor, freeze)
 *   gp_graph.c       LOAD's graph builder (gp_func_param_layout, gp_add_kernel_nodes, gp_add_edges)
 * gp_cuda.h declares the driver API it uses (no CUDA toolkit needed to build), gp_glibc.h pins old glibc symbol
 * versions (the prebuilt library runs on glibc >= 2.28), gp_core.c and gp_ipc.c hold the CUDA-free bookkeeping.
 * Internal, not exported: everything here has hidden visibility (-fvisibility=hidden); GP_EXPORT marks the ABI. */
#ifndef GP_STATE_H
#define GP_STATE_H
#include <pthread.h>
#include <stdint.h>

#include "gp_core.h"
#include "gp_cuda.h"
#include "gp_glibc.h"
#include "gp_ipc.h"

#define GP_EXPORT __attribute__((visibility("default")))
#define GP_SIZE_FACTOR 4ull
#define GP_HOST_DEFAULT_SIZE (64ull << 30)

/* One allocation of ours (cuMemCreate + map), live until freed. */
typedef struct {
    uint64_t addr;
    CUmemGenericAllocationHandle h;
    uint64_t size;
    int fd;             /* exported POSIX fd (cuIpcGetMemHandle), -1 until the first export; closed at free */
    uint64_t export_id; /* names this export in handles, so a reused pid/fd never matches */
} live_t;

/* ---- process state (gp_state.c); the lock guards everything below except the env fields ---- */
extern pthread_mutex_t g_lock;
extern gp_bump_t g_bump;
extern gp_log_t g_log;
extern gp_images_t g_images;
extern int g_enabled;                    /* published by read_env() after the whole environment is parsed */
extern uint64_t g_want_base, g_want_size; /* size 0: GP_SIZE_FACTOR x device memory */
extern int g_log_on;
extern int g_reuse;  /* layout frozen (after SAVE/LOAD): freed ranges may be handed out again */
extern gp_free_t g_free;
extern int g_failed; /* region reservation failed: refuse all further allocations */
extern char g_error[512];
extern CUdevice g_dev;
extern gp_ipc_table_t g_imports; /* peer allocations this process mapped (cuIpcOpenMemHandle) */
extern live_t *g_live;
extern size_t g_nlive, g_caplive;

void gp_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void set_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Parses the environment exactly once, whichever thread gets here first; others wait for it. */
void read_env(void);
/* strtoull(s, NULL, 0) without the C library's (a newer glibc redirects it to a newer symbol version). */
uint64_t gp_parse_u64(const char *s, const char **end);
int enabled(void);

/* Per-thread default-stream variants (cuda.h declares them only under CUDA_API_PER_THREAD_DEFAULT_STREAM). */
CUresult CUDAAPI cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream s);
CUresult CUDAAPI cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool p, CUstream s);

/* ---- the real driver (gp_lookup.c) ----
 * Every entry point the interposer calls, resolved once (pthread_once) from $GP_LIBCUDA (default libcuda.so.1, the
 * override lets the CPU tests put a fake driver underneath). A missing one stays NULL and its hook answers
 * CUDA_ERROR_NOT_INITIALIZED. */
#define GP_DRIVER_FUNCS(X)                                                                                         \
    X(cuCtxGetDevice) X(cuCtxSynchronize) X(cuDeviceTotalMem_v2) X(cuMemGetAllocationGranularity)                \
    X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemCreate) X(cuMemRelease) X(cuMemMap) X(cuMemUnmap)            \
    X(cuMemSetAccess) X(cuMemExportToShareableHandle) X(cuMemImportFromShareableHandle) X(cuMemAlloc_v2)          \
    X(cuMemAllocPitch_v2) X(cuMemFree_v2) X(cuMemAllocManaged) X(cuMemAllocAsync) X(cuMemAllocAsync_ptsz)          \
    X(cuMemAllocFromPoolAsync) X(cuMemAllocFromPoolAsync_ptsz) X(cuIpcGetMemHandle) X(cuIpcOpenMemHandle_v2)      \
    X(cuIpcCloseMemHandle) X(cuModuleLoad) X(cuModuleLoadData) X(cuModuleLoadDataEx) X(cuModuleLoadFatBinary)      \
    X(cuLibraryLoadData) X(cuLibraryLoadFromFile) X(cuGetProcAddress_v2) X(cuGraphAddKernelNode_v2)               \
    X(cuGraphKernelNodeSetAttribute) X(cuGraphKernelNodeGetAttribute) X(cuGraphAddDependencies_v2)                \
    X(cuFuncGetParamInfo)                                                                                          \
    X(cuPointerGetAttribute) X(cuPointerGetAttributes) X(cuMemHostAlloc) X(cuMemAllocHost_v2) X(cuMemFreeHost)      \
    X(cuMemHostRegister_v2) X(cuMemHostUnregister) X(cuMemHostGetDevicePointer_v2)

#define GP_DRIVER_FIELD(name) __typeof__(&name) name;
typedef struct {
    GP_DRIVER_FUNCS(GP_DRIVER_FIELD)
} gp_driver_t;

/* The resolved table (resolving it on first use, thread-safe). */
const gp_driver_t *gp_driver(void);
/* The real dlsym (resolved once, checked: NULL with one clear error when this glibc offers none we know). */
void *gp_real_dlsym(void *handle, const char *name);

/* Declares `d` (the driver table) and returns CUDA_ERROR_NOT_INITIALIZED from the hook when `name` is missing. */
#define NEED(name)                          \
    const gp_driver_t *d = gp_driver();     \
    if (!d->name) return CUDA_ERROR_NOT_INITIALIZED;

/* ---- fault injection (gp_state.c), for the rollback tests: GP_FAULT=<site>:<nth> or gp_fault_inject() ----
 * gp_fault(site) is true exactly once, at the nth time `site` is reached after arming; the caller then fails as if
 * the driver call or host allocation at that site had failed. Sites: reserve create map access unmap release sync
 * export import fd live_grow log_grow. */
int gp_fault(const char *site);
#define GP_FAULT_ERROR CUDA_ERROR_UNKNOWN
/* `call` unless the fault at `site` fires (then GP_FAULT_ERROR, and `call` is not made). */
#define FAULTY(site, call) (gp_fault(site) ? GP_FAULT_ERROR : (call))

/* Room for one more event in g_log, so that an append after a driver call cannot fail (fault site log_grow). */
int log_reserve(void);

/* ---- region placement (gp_mem.c); callers hold g_lock ---- */
int ensure_region(void);
/* Gives a range next_range() handed out back, restoring the cursor saved before it (or the free list). */
void give_back(uint64_t addr, uint64_t mapped, int reused, uint64_t saved_cursor);
CUresult map_with_access(uint64_t addr, uint64_t size, CUmemGenericAllocationHandle h);
CUresult map_at(uint64_t addr, uint64_t size);
int in_region(uint64_t a);
int next_range(uint64_t bytes, uint64_t align, uint64_t *addr, uint64_t *mapped, int *reused);
live_t *live_containing(uint64_t p);
/* The mapping of (addr, size, h) undone after a failure: unmap, release (both real driver calls, no faults). */
void unmap_release(uint64_t addr, uint64_t size, CUmemGenericAllocationHandle h);

#endif
