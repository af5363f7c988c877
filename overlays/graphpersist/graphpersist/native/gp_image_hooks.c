/* Module and library loads: every image the process loads is recorded (kept readable) for SAVE. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

#include "gp_state.h"

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
    NEED(cuModuleLoadData);
    CUresult r = d->cuModuleLoadData(module, image);
    if (r == CUDA_SUCCESS) record_image(1, (uint64_t)*module, image, 0);
    return r;
}

GP_EXPORT CUresult CUDAAPI cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int n, CUjit_option *o,
                                              void **v) {
    NEED(cuModuleLoadDataEx);
    CUresult r = d->cuModuleLoadDataEx(module, image, n, o, v);
    if (r == CUDA_SUCCESS) record_image(2, (uint64_t)*module, image, n);
    return r;
}

GP_EXPORT CUresult CUDAAPI cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin) {
    NEED(cuModuleLoadFatBinary);
    CUresult r = d->cuModuleLoadFatBinary(module, fatCubin);
    if (r == CUDA_SUCCESS) record_image(3, (uint64_t)*module, fatCubin, 0);
    return r;
}

GP_EXPORT CUresult CUDAAPI cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jo, void **jv,
                                             unsigned int nj, CUlibraryOption *lo, void **lv, unsigned int nl) {
    NEED(cuLibraryLoadData);
    CUresult r = d->cuLibraryLoadData(library, code, jo, jv, nj, lo, lv, nl);
    if (r == CUDA_SUCCESS) record_image(4, (uint64_t)*library, code, nj);
    return r;
}
