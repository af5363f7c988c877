/* Module and library loads: every image the process loads is recorded (kept readable) for SAVE. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gp_state.h"

/* Appends one loaded image to the table SAVE reads (`owned`: the bytes are our copy, freed with the table). */
static void keep_image(uint32_t kind, uint64_t handle, uint64_t ptr, uint64_t size, uint32_t owned, uint32_t format,
                       uint32_t n_jit, const char *from) {
    pthread_mutex_lock(&g_lock);
    gp_images_append(&g_images, kind, handle, ptr, size, owned, format, n_jit);
    pthread_mutex_unlock(&g_lock);
    gp_log("image kind %u handle 0x%llx size %llu owned %u from %s", kind, (unsigned long long)handle,
           (unsigned long long)size, owned, from);
}

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
    keep_image(kind, handle, ptr, size, owned, format, n_jit, "memory");
}

/* An image loaded from a file (torch Inductor's static launcher uses cuModuleLoad on its cubin files): the bytes
 * are read once, kept, and recorded like loaded data, so LOAD can load them with cuModuleLoadData/cuLibraryLoadData.
 * A file that cannot be read back is logged and left unrecorded: SAVE then refuses graphs using its kernels. */
static void record_file(uint32_t kind, uint64_t handle, const char *path, uint32_t n_jit) {
    FILE *f = path ? fopen(path, "rb") : NULL;
    long n = -1;
    char *buf = NULL;
    if (f && fseek(f, 0, SEEK_END) == 0 && (n = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0) {
        buf = malloc((size_t)n + 1);
        if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
            free(buf);
            buf = NULL;
        }
    }
    if (f) fclose(f);
    if (!buf) {
        gp_log("image file %s could not be read back: not recorded", path ? path : "(null)");
        return;
    }
    buf[n] = 0; /* PTX text is NUL-terminated data */
    uint32_t format = gp_image_format(buf);
    uint64_t size = (uint64_t)n + (format == 3 ? 1 : 0);
    keep_image(kind, handle, (uint64_t)buf, size, 1, format, n_jit, path);
}

GP_EXPORT CUresult CUDAAPI cuModuleLoad(CUmodule *module, const char *fname) {
    NEED(cuModuleLoad);
    CUresult r = d->cuModuleLoad(module, fname);
    if (r == CUDA_SUCCESS) record_file(1, (uint64_t)*module, fname, 0);
    return r;
}

GP_EXPORT CUresult CUDAAPI cuLibraryLoadFromFile(CUlibrary *library, const char *fileName, CUjit_option *jo, void **jv,
                                                 unsigned int nj, CUlibraryOption *lo, void **lv, unsigned int nl) {
    NEED(cuLibraryLoadFromFile);
    CUresult r = d->cuLibraryLoadFromFile(library, fileName, jo, jv, nj, lo, lv, nl);
    if (r == CUDA_SUCCESS) record_file(4, (uint64_t)*library, fileName, nj);
    return r;
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
