/* The real driver and the real dlsym; dlsym and cuGetProcAddress hand out our wrappers. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>

#include "gp_state.h"

static void *(*real_dlsym)(void *, const char *);
static void *g_libcuda;

void init_real_dlsym(void) {
    if (real_dlsym) return;
    real_dlsym = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!real_dlsym) real_dlsym = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
}

void *real_fn(const char *name) {
    init_real_dlsym();
    if (!g_libcuda) g_libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!g_libcuda || !real_dlsym) return NULL;
    return real_dlsym(g_libcuda, name);
}

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
