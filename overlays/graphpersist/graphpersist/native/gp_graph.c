/* Fast paths: LOAD adds a graph's kernel nodes and edges, SAVE reads a node's launch attributes, without a Python
 * round trip per node or attribute. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "gp_state.h"

#define GP_MAX_ATTR 64

/* The live parameter layout of `func`, what the driver reads from kernelParams at launch: out[0] = n, then the
 * offset and size of each parameter (cuFuncGetParamInfo, which answers CUDA_ERROR_INVALID_VALUE past the last; any
 * other error refuses, as at SAVE). `cap` words of `out`. Returns n, or -1 (error set). LOAD asks once per function. */
GP_EXPORT long gp_func_param_layout(void *func, uint32_t *out, size_t cap) {
    __typeof__(gp_driver()->cuFuncGetParamInfo) info = gp_driver()->cuFuncGetParamInfo;
    if (!info) {
        set_error("cuFuncGetParamInfo missing in the driver (it needs CUDA 12.4 or newer)");
        return -1;
    }
    for (size_t j = 0;; j++) {
        size_t off = 0, size = 0;
        CUresult r = info((CUfunction)func, j, &off, &size);
        if (r == CUDA_ERROR_INVALID_VALUE) {
            out[0] = (uint32_t)j;
            return (long)j;
        }
        if (r != CUDA_SUCCESS) {
            set_error("cuFuncGetParamInfo(parameter %zu) failed with %d", j, (int)r);
            return -1;
        }
        if (2 + 2 * j >= cap || off > UINT32_MAX || size > UINT32_MAX) {
            set_error("parameter %zu (%zu bytes at offset %zu) is past what LOAD rebuilds (%zu parameters)", j, size,
                      off, cap / 2);
            return -1;
        }
        out[1 + 2 * j] = (uint32_t)off;
        out[2 + 2 * j] = (uint32_t)size;
    }
}

/* Every kernel row held to its function's live layout and the blob before any node is added (gp_knode_layout_check):
 * 0, or -2 with the row's index in *bad, or -1 for a row that names no known function. */
static int check_rows(size_t n, const gp_knode_t *nodes, uint64_t blob_size, const uint32_t *offsets,
                      const uint32_t *const *layouts, size_t n_funcs, size_t *bad) {
    for (size_t i = 0; i < n; i++) {
        const gp_knode_t *k = &nodes[i];
        if (k->n_params > 4096 || k->func_index >= n_funcs || !layouts[k->func_index]) {
            set_error("node %u: %u parameters, function %u of %zu", k->node_index, k->n_params, k->func_index,
                      n_funcs);
            return -1;
        }
        char why[160];
        if (gp_knode_layout_check(k, offsets, layouts[k->func_index], blob_size, why, sizeof why) != 0) {
            set_error("%s", why);
            *bad = i;
            return -2;
        }
    }
    return 0;
}

/* The launch attributes a fresh node of each function reads back, learned as its first node is added: per
 * (function, attribute) `known` is 0 unknown, 1 default read (in `defs`), 2 unreadable (always set). */
typedef struct {
    unsigned char *known;
    unsigned char (*defs)[64];
} gp_attr_defaults_t;

/* Adds kernel row `k` to `graph` without dependencies, its parameters pointing into `blob`; 0 or -1 (error set). */
static int add_kernel_node(const gp_driver_t *d, void *graph, const gp_knode_t *k, const unsigned char *blob,
                           const uint32_t *offsets, void *const *funcs, CUgraphNode *node) {
    void *ptrs[4096];
    for (uint32_t j = 0; j < k->n_params; j++) ptrs[j] = (void *)(blob + k->params_off + offsets[k->layout_off + j]);
    CUDA_KERNEL_NODE_PARAMS p;
    memset(&p, 0, sizeof p);
    p.func = (CUfunction)funcs[k->func_index];
    p.gridDimX = k->grid[0];
    p.gridDimY = k->grid[1];
    p.gridDimZ = k->grid[2];
    p.blockDimX = k->block[0];
    p.blockDimY = k->block[1];
    p.blockDimZ = k->block[2];
    p.sharedMemBytes = k->smem;
    p.kernelParams = k->n_params ? ptrs : NULL;
    CUresult r = d->cuGraphAddKernelNode_v2(node, (CUgraph)graph, NULL, 0, &p);
    if (r != CUDA_SUCCESS) {
        set_error("node %u: cuGraphAddKernelNode failed with %d", k->node_index, (int)r);
        return -1;
    }
    return 0;
}

/* Sets the saved launch attributes of row `k` on `node` that differ from its function's defaults; 0 or -1. */
static int set_node_attrs(const gp_driver_t *d, CUgraphNode node, const gp_knode_t *k, const gp_kattr_t *attrs,
                          gp_attr_defaults_t *seen) {
    __typeof__(d->cuGraphKernelNodeGetAttribute) get = d->cuGraphKernelNodeGetAttribute;
    __typeof__(d->cuGraphKernelNodeSetAttribute) set = d->cuGraphKernelNodeSetAttribute;
    for (uint32_t j = 0; j < k->n_attrs; j++) {
        const gp_kattr_t *a = &attrs[k->attrs_off + j];
        if (a->id >= GP_MAX_ATTR) {
            set_error("node %u: launch attribute id %u is newer than this interposer knows (< %d): SAVE and "
                      "LOAD need the same graphpersist build", k->node_index, a->id, GP_MAX_ATTR);
            return -1;
        }
        size_t key = (size_t)k->func_index * GP_MAX_ATTR + a->id;
        if (!seen->known[key]) {
            CUkernelNodeAttrValue v;
            memset(&v, 0, sizeof v);
            seen->known[key] = get(node, (CUkernelNodeAttrID)a->id, &v) == CUDA_SUCCESS ? 1 : 2;
            memcpy(seen->defs[key], &v, sizeof v < 64 ? sizeof v : 64);
        }
        if (seen->known[key] == 1 && memcmp(seen->defs[key], a->value, 64) == 0) continue;
        CUkernelNodeAttrValue v;
        memcpy(&v, a->value, sizeof v < 64 ? sizeof v : 64);
        CUresult r = set(node, (CUkernelNodeAttrID)a->id, &v);
        if (r != CUDA_SUCCESS) {
            set_error("node %u: setting launch attribute %u failed with %d", k->node_index, a->id, (int)r);
            return -1;
        }
    }
    return 0;
}

/* Adds n kernel nodes (no dependencies) to `graph`; out[node_index] receives each node. A saved launch attribute
 * is set unless it equals what a fresh node of the same function reads back (learned per function, so a
 * kernel's own defaults, e.g. compiled-in cluster dimensions, are never taken for another's).
 * Before the first node is added every row is checked against its function's live layout (`layouts[f]`, from
 * gp_func_param_layout) and the `blob_size`-byte blob (gp_knode_layout_check): the driver reads each parameter for
 * as many bytes as the function's own parameter is long, so an archive's row must not point it past the blob or at
 * another layout. A row that fails returns -2 with its index in *bad (the caller names graph, node and kernel); any
 * other failure -1. */
GP_EXPORT int gp_add_kernel_nodes(void *graph, size_t n, const gp_knode_t *nodes, const unsigned char *blob,
                                  uint64_t blob_size, const uint32_t *offsets, const gp_kattr_t *attrs,
                                  void *const *funcs, const uint32_t *const *layouts, size_t n_funcs, void **out,
                                  size_t *bad) {
    const gp_driver_t *d = gp_driver();
    if (!d->cuGraphAddKernelNode_v2 || !d->cuGraphKernelNodeSetAttribute || !d->cuGraphKernelNodeGetAttribute) {
        set_error("graph entry points missing in the driver");
        return -1;
    }
    int checked = check_rows(n, nodes, blob_size, offsets, layouts, n_funcs, bad);
    if (checked != 0) return checked;
    gp_attr_defaults_t seen = {calloc(n_funcs * GP_MAX_ATTR + 1, 1), calloc(n_funcs * GP_MAX_ATTR + 1, 64)};
    int rc = -1;
    if (!seen.known || !seen.defs) {
        set_error("out of host memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        CUgraphNode node;
        if (add_kernel_node(d, graph, &nodes[i], blob, offsets, funcs, &node) != 0) goto out;
        out[nodes[i].node_index] = node;
        if (set_node_attrs(d, node, &nodes[i], attrs, &seen) != 0) goto out;
    }
    rc = 0;
out:
    free(seen.known);
    free(seen.defs);
    return rc;
}

/* Adds plain edges (no edge data) between already created nodes. */
GP_EXPORT int gp_add_edges(void *graph, void *const *nodes, size_t n, const uint32_t *from, const uint32_t *to) {
    __typeof__(gp_driver()->cuGraphAddDependencies_v2) dep = gp_driver()->cuGraphAddDependencies_v2;
    if (!dep) return -1;
    CUgraphNode *f = malloc(n * sizeof *f), *t = malloc(n * sizeof *t);
    if (!f || !t) {
        free(f);
        free(t);
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        f[i] = (CUgraphNode)nodes[from[i]];
        t[i] = (CUgraphNode)nodes[to[i]];
    }
    CUresult r = dep((CUgraph)graph, f, t, NULL, n);
    free(f);
    free(t);
    if (r != CUDA_SUCCESS) set_error("cuGraphAddDependencies failed with %d", (int)r);
    return r == CUDA_SUCCESS ? 0 : -1;
}

/* SAVE fast path: every launch attribute of one kernel node in one call. values receives 64 bytes per attribute
 * (zeros where the read failed), errs the driver's answer per attribute. One call per node instead of one Python
 * round trip per attribute: a TP=2 engine's SAVE spent most of its serialization there. */
GP_EXPORT int gp_kernel_node_attrs(void *node, const uint32_t *ids, size_t n, unsigned char *values, int32_t *errs) {
    __typeof__(gp_driver()->cuGraphKernelNodeGetAttribute) get = gp_driver()->cuGraphKernelNodeGetAttribute;
    if (!get) {
        set_error("graph entry points missing in the driver");
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        CUkernelNodeAttrValue v;
        memset(&v, 0, sizeof v);
        errs[i] = (int32_t)get((CUgraphNode)node, (CUkernelNodeAttrID)ids[i], &v);
        memset(values + i * 64, 0, 64);
        if (errs[i] == CUDA_SUCCESS) memcpy(values + i * 64, &v, sizeof v < 64 ? sizeof v : 64);
    }
    return 0;
}
