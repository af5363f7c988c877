/* Pure bookkeeping of the graphpersist interposer: no CUDA calls, so a CPU test can exercise it.
 * The bump cursor makes every placement a function of the allocation sequence alone; the event log
 * is what SAVE records and LOAD compares; image sizing finds how many bytes a module image spans. */
#ifndef GP_CORE_H
#define GP_CORE_H
#include <stddef.h>
#include <stdint.h>

enum gp_event_kind {
    GP_EV_ALLOC = 1,      /* cuMemAlloc_v2 / cuMemAllocPitch_v2 placed in the region */
    GP_EV_FREE = 2,       /* cuMemFree_v2 of a region allocation (VA reused only after freeze) */
    GP_EV_RESERVE = 3,    /* cuMemAddressReserve carved from the region */
    GP_EV_MAP_FIXED = 4,  /* gp_map_fixed: LOAD recreating a recorded allocation */
    GP_EV_REFUSED = 5,    /* an allocation the region cannot place (async pools, exhausted region) */
    GP_EV_OUTSIDE = 6,    /* device memory placed outside the region (see gp_outside_why): SAVE refuses */
    GP_EV_UNRESERVE = 7,  /* cuMemAddressFree of a carved reservation */
    GP_EV_IPC_OPEN = 8,   /* cuIpcOpenMemHandle: a peer's allocation mapped into the region */
    GP_EV_IPC_CLOSE = 9,  /* cuIpcCloseMemHandle: that mapping removed (last reference) */
    GP_EV_LIB_MAP = 10,   /* cuMemMap by a library into a reservation we carved; req = offset in the reservation */
    GP_EV_LIB_UNMAP = 11, /* cuMemUnmap of such a mapping; req = offset in the reservation */
    /* The host log (gp_host.c), never in the device log: detail = the caller's flags (alloc) or gp_host_outside_why */
    GP_EV_HOST_ALLOC = 12,  /* cuMemHostAlloc / cuMemAllocHost placed in the host range */
    GP_EV_HOST_FREE = 13,   /* cuMemFreeHost of a placed or tracked host allocation */
    GP_EV_HOST_OUTSIDE = 14 /* pinned host memory left to the driver (see gp_host_outside_why) */
};

/* Why pinned host memory was left to the driver (gp_event_t.detail of a GP_EV_HOST_OUTSIDE event). */
enum gp_host_outside_why {
    GP_HOUT_NOT_ENABLED = 1,    /* before the region was enabled */
    GP_HOUT_WRITECOMBINED = 2,  /* CU_MEMHOSTALLOC_WRITECOMBINED: cuMemHostRegister cannot make it */
    GP_HOUT_OFF = 3,            /* GP_HOST_BASE unset or 0: placement off */
    GP_HOUT_RESERVE = 4,        /* the host range could not be reserved at GP_HOST_BASE */
    GP_HOUT_EXHAUSTED = 5,      /* the host range is full */
    GP_HOUT_REGISTER = 6,       /* cuMemHostRegister failed (or the driver lacks it) */
    GP_HOUT_DEVPTR = 7          /* the device pointer differs from the host address on this device */
};

/* Why an allocation landed outside the region (gp_event_t.detail of a GP_EV_OUTSIDE event). */
enum gp_outside_why {
    GP_OUT_NOT_ENABLED = 1, /* cuMemAlloc/cuMemAllocPitch before the region was enabled */
    GP_OUT_MANAGED = 2,     /* cuMemAllocManaged */
    GP_OUT_HINT = 3,        /* cuMemAddressReserve with an address hint */
    GP_OUT_MAP = 4          /* cuMemMap into a range the region did not hand out */
};

typedef struct {
    uint64_t seq;
    uint64_t addr;
    uint64_t size;   /* bytes mapped (rounded to the granularity) */
    uint64_t req;    /* bytes the caller asked for */
    uint32_t kind;
    uint32_t detail; /* GP_EV_OUTSIDE: enum gp_outside_why; otherwise 0 */
} gp_event_t;

typedef struct {
    uint64_t base, size, cursor, gran;
} gp_bump_t;

/* Freed region ranges, sorted by address and coalesced; reused only once the layout is frozen. */
typedef struct {
    uint64_t addr, size;
} gp_range_t;

typedef struct {
    gp_range_t *r;
    size_t n, cap;
} gp_free_t;

typedef struct {
    gp_event_t *ev;
    size_t n, cap;
    uint64_t next_seq;
} gp_log_t;

typedef struct {
    uint64_t seq;
    uint64_t handle;   /* CUmodule or CUlibrary */
    uint64_t ptr;      /* start of the image bytes (stable: static data or our own copy) */
    uint64_t size;
    uint32_t kind;     /* 1 module-data, 2 module-data-ex, 3 fatbinary, 4 library-data */
    uint32_t owned;    /* 1 when ptr is our malloc'd copy */
    uint32_t format;   /* enum gp_image_format */
    uint32_t n_jit;    /* JIT options the loader passed (they shape PTX compilation) */
} gp_image_t;

enum gp_image_format { GP_IMG_UNKNOWN = 0, GP_IMG_FATBIN = 1, GP_IMG_ELF = 2, GP_IMG_PTX = 3 };

typedef struct {
    gp_image_t *im;
    size_t n, cap;
    uint64_t next_seq;
} gp_images_t;

/* One kernel node of a saved graph, packed by Python (graphs.py KNODE) and replayed by gp_add_kernel_nodes.
 * Offsets index the parameter blob, the uint32 parameter-offset table and the attribute table. */
typedef struct {
    uint32_t node_index, func_index;
    uint32_t grid[3], block[3];
    uint32_t smem, n_params;
    uint64_t params_off;
    uint32_t layout_off, n_attrs, attrs_off, pad;
} gp_knode_t;

typedef struct {
    uint32_t id, pad;
    unsigned char value[64]; /* raw CUlaunchAttributeValue */
} gp_kattr_t;

size_t gp_knode_size(void);
size_t gp_kattr_size(void);
/* Whether kernel row `k` may point the driver at its parameters: the driver reads as many bytes as the *live*
 * function's parameter j is long from kernelParams[j], whatever the archive says, so the row's parameter count and
 * offsets (offsets[layout_off ..]) must equal the function's layout (`layout`: n, then offset and size of each
 * parameter, from cuFuncGetParamInfo) and every parameter must end inside the `blob_size`-byte blob. 0 when sound;
 * else -1 and the first difference in `why`. The caller has checked that the offset run lies inside `offsets`. */
int gp_knode_layout_check(const gp_knode_t *k, const uint32_t *offsets, const uint32_t *layout, uint64_t blob_size,
                          char *why, size_t cap);

/* v rounded up to a multiple of gran; 0 when that does not fit in 64 bits. */
uint64_t gp_round_up(uint64_t v, uint64_t gran);
/* Place `req` bytes at the cursor: 0 on success, -1 if the region is exhausted or not set. */
int gp_bump_place(gp_bump_t *b, uint64_t req, uint64_t *addr, uint64_t *mapped);
/* Move the cursor to base+offset; refuses to move backwards or past the end (returns -1). */
int gp_bump_set_cursor(gp_bump_t *b, uint64_t offset);
uint64_t gp_log_append(gp_log_t *log, uint32_t kind, uint64_t addr, uint64_t size, uint64_t req);
/* Room for one more event: after 0, the next gp_log_append cannot fail. -1 on OOM. */
int gp_log_reserve(gp_log_t *log);
/* Copies the first min(n, cap) events into `buf` (may be NULL); returns how many the log holds. The caller locks. */
size_t gp_log_copy(const gp_log_t *log, gp_event_t *buf, size_t cap);
/* Index of the live memory event starting exactly at `addr` (allocated, fixed-mapped, IPC-opened or mapped by a
 * library into a reservation, and not freed/closed/unmapped since), or -1. A reservation alone is not memory. */
long gp_log_find_live(const gp_log_t *log, uint64_t addr);
/* Index of an event whose range [addr, addr+size) overlaps [lo, hi) and is still live (allocated, fixed-mapped,
 * reserved or IPC-mapped, and not freed, given back or closed since), or -1. */
long gp_log_live_overlapping(const gp_log_t *log, uint64_t lo, uint64_t hi);
/* 1 when [addr, addr+size) overlaps a range on the free list, else 0. */
int gp_free_overlaps(const gp_free_t *f, uint64_t addr, uint64_t size);
/* Index of the live GP_EV_RESERVE whose range holds `addr` (not given back since), or -1. */
long gp_log_find_reservation(const gp_log_t *log, uint64_t addr);
/* Returns a freed range to the list (merging neighbours); -1 when it overlaps a range already there or on OOM. */
int gp_free_add(gp_free_t *f, uint64_t addr, uint64_t size);
/* First-fit: takes `size` bytes aligned to `align` (a power of two) from the list; -1 when nothing fits. */
int gp_free_take(gp_free_t *f, uint64_t size, uint64_t align, uint64_t *addr);
uint64_t gp_images_append(gp_images_t *ims, uint32_t kind, uint64_t handle, uint64_t ptr, uint64_t size,
                          uint32_t owned, uint32_t format, uint32_t n_jit);
/* Image sizing: fatbin wrapper (0x466243b1), fatbin (0xBA55ED50), ELF64 cubin or NUL-terminated PTX.
 * Returns the byte size and writes the start of the image bytes to *start (the wrapper points elsewhere). */
uint64_t gp_image_size(const void *image, const void **start);
/* Which kind of image gp_image_size sized (enum gp_image_format). */
uint32_t gp_image_format(const void *image);
#endif
