/* The real driver and the real dlsym; dlsym and cuGetProcAddress hand out our wrappers. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gp_state.h"

/* dlsym's symbol version in libc (glibc >= 2.34 moved it there under a new version) or libdl, newest first: what
 * this build's architecture started with, so RTLD_NEXT finds the real one whichever glibc runs us. */
static const char *const g_dlsym_versions[] = {
    "GLIBC_2.34",
#if defined(__x86_64__)
    "GLIBC_2.2.5",
#elif defined(__aarch64__)
    "GLIBC_2.17",
#elif defined(__powerpc64__)
    "GLIBC_2.3",
#elif defined(__s390x__)
    "GLIBC_2.2",
#elif defined(__riscv)
    "GLIBC_2.27",
#elif defined(__i386__)
    "GLIBC_2.0",
#endif
    NULL};

static void *(*g_real_dlsym)(void *, const char *);
static pthread_once_t g_dlsym_once = PTHREAD_ONCE_INIT;
static gp_driver_t g_drv;
static pthread_once_t g_drv_once = PTHREAD_ONCE_INIT;

static void resolve_dlsym(void) {
    for (const char *const *v = g_dlsym_versions; *v && !g_real_dlsym; v++)
        g_real_dlsym = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", *v);
    if (!g_real_dlsym) {
        char tried[128] = "";
        for (const char *const *v = g_dlsym_versions; *v; v++)
            snprintf(tried + strlen(tried), sizeof tried - strlen(tried), "%s%s", *v, v[1] ? ", " : "");
        set_error("the C library's own dlsym was not found (tried versions %s): this glibc or architecture is not "
                  "supported, so no symbol lookup through dlsym can work with the interposer loaded", tried);
    }
}

void *gp_real_dlsym(void *handle, const char *name) {
    pthread_once(&g_dlsym_once, resolve_dlsym);
    return g_real_dlsym ? g_real_dlsym(handle, name) : NULL;
}

static void resolve_driver(void) {
    const char *path = getenv("GP_LIBCUDA");
    if (!path || !*path) path = "libcuda.so.1";
    void *lib = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    if (!lib) {
        set_error("cannot load the CUDA driver %s: %s", path, dlerror());
        return;
    }
#define GP_RESOLVE(name) g_drv.name = (__typeof__(g_drv.name))gp_real_dlsym(lib, #name);
    GP_DRIVER_FUNCS(GP_RESOLVE)
#undef GP_RESOLVE
}

const gp_driver_t *gp_driver(void) {
    pthread_once(&g_drv_once, resolve_driver);
    return &g_drv;
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
    {"cuMemUnmap", "cuMemUnmap", (void *)cuMemUnmap, NULL},
    {"cuMemAllocManaged", "cuMemAllocManaged", (void *)cuMemAllocManaged, NULL},
    {"cuPointerGetAttribute", "cuPointerGetAttribute", (void *)cuPointerGetAttribute, NULL},
    {"cuPointerGetAttributes", "cuPointerGetAttributes", (void *)cuPointerGetAttributes, NULL},
    {"cuIpcGetMemHandle", "cuIpcGetMemHandle", (void *)cuIpcGetMemHandle, NULL},
    {"cuIpcOpenMemHandle", "cuIpcOpenMemHandle_v2", (void *)cuIpcOpenMemHandle_v2, NULL},
    {"cuIpcOpenMemHandle", "cuIpcOpenMemHandle", (void *)cuIpcOpenMemHandle_v2, NULL}, /* v1: same signature */
    {"cuIpcCloseMemHandle", "cuIpcCloseMemHandle", (void *)cuIpcCloseMemHandle, NULL},
    {"cuMemAllocAsync", "cuMemAllocAsync", (void *)cuMemAllocAsync, (void *)cuMemAllocAsync_ptsz},
    {"cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync", (void *)cuMemAllocFromPoolAsync,
     (void *)cuMemAllocFromPoolAsync_ptsz},
    {"cuMemHostAlloc", "cuMemHostAlloc", (void *)cuMemHostAlloc, NULL},
    {"cuMemAllocHost", "cuMemAllocHost_v2", (void *)cuMemAllocHost_v2, NULL},
    {"cuMemFreeHost", "cuMemFreeHost", (void *)cuMemFreeHost, NULL},
    {"cuModuleLoad", "cuModuleLoad", (void *)cuModuleLoad, NULL},
    {"cuModuleLoadData", "cuModuleLoadData", (void *)cuModuleLoadData, NULL},
    {"cuModuleLoadDataEx", "cuModuleLoadDataEx", (void *)cuModuleLoadDataEx, NULL},
    {"cuModuleLoadFatBinary", "cuModuleLoadFatBinary", (void *)cuModuleLoadFatBinary, NULL},
    {"cuLibraryLoadData", "cuLibraryLoadData", (void *)cuLibraryLoadData, NULL},
    {"cuLibraryLoadFromFile", "cuLibraryLoadFromFile", (void *)cuLibraryLoadFromFile, NULL},
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
    NEED(cuGetProcAddress_v2);
    read_env();
    CUresult r = d->cuGetProcAddress_v2(symbol, pfn, ver, flags, st);
    gp_log("cuGetProcAddress %s ver %d flags %llu -> %d", symbol, ver, (unsigned long long)flags, (int)r);
    if (r != CUDA_SUCCESS || !pfn || !*pfn || !symbol) return r;
    const hook_t *h = hook_by_base(symbol);
    if (!h) return r;
    if (strcmp(symbol, "cuMemAlloc") == 0 || strcmp(symbol, "cuMemFree") == 0 ||
        strcmp(symbol, "cuMemAllocPitch") == 0 || strcmp(symbol, "cuMemAllocHost") == 0) {
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
    return gp_real_dlsym(handle, name);
}
