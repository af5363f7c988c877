/* Pure bookkeeping for the interposer (see gp_core.h). */
#include "gp_core.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

size_t gp_knode_size(void) { return sizeof(gp_knode_t); }
size_t gp_kattr_size(void) { return sizeof(gp_kattr_t); }

int gp_knode_layout_check(const gp_knode_t *k, const uint32_t *offsets, const uint32_t *layout, uint64_t blob_size,
                          char *why, size_t cap) {
    if (k->n_params != layout[0]) {
        snprintf(why, cap, "%u parameters, the function %u", k->n_params, layout[0]);
        return -1;
    }
    for (uint32_t j = 0; j < k->n_params; j++) {
        uint64_t off = layout[1 + 2 * j], size = layout[2 + 2 * j];
        if (offsets[k->layout_off + j] != off) {
            snprintf(why, cap, "parameter %u at offset %u, the function's at %llu", j, offsets[k->layout_off + j],
                     (unsigned long long)off);
            return -1;
        }
        if (k->params_off > blob_size || off + size > blob_size - k->params_off) {
            snprintf(why, cap, "parameter %u (%llu bytes at offset %llu) ends past the %llu-byte blob", j,
                     (unsigned long long)size, (unsigned long long)off, (unsigned long long)blob_size);
            return -1;
        }
    }
    return 0;
}

uint64_t gp_round_up(uint64_t v, uint64_t gran) {
    if (gran == 0) return v;
    if (v > UINT64_MAX - (gran - 1)) return 0;
    return (v + gran - 1) / gran * gran;
}

int gp_bump_place(gp_bump_t *b, uint64_t req, uint64_t *addr, uint64_t *mapped) {
    if (b->base == 0 || b->gran == 0) return -1;
    uint64_t sz = gp_round_up(req ? req : 1, b->gran);
    if (sz == 0 || b->cursor + sz > b->size || b->cursor + sz < b->cursor) return -1;
    *addr = b->base + b->cursor;
    *mapped = sz;
    b->cursor += sz;
    return 0;
}

int gp_bump_set_cursor(gp_bump_t *b, uint64_t offset) {
    if (offset < b->cursor || offset > b->size) return -1;
    uint64_t c = gp_round_up(offset, b->gran);
    if (c > b->size || (c == 0 && offset != 0)) return -1;
    b->cursor = c;
    return 0;
}

static int grow(void **arr, size_t *cap, size_t n, size_t elem) {
    if (n < *cap) return 0;
    size_t nc = *cap ? *cap * 2 : 256;
    void *p = realloc(*arr, nc * elem);
    if (!p) return -1;
    *arr = p;
    *cap = nc;
    return 0;
}

uint64_t gp_log_append(gp_log_t *log, uint32_t kind, uint64_t addr, uint64_t size, uint64_t req) {
    if (grow((void **)&log->ev, &log->cap, log->n, sizeof(gp_event_t))) return UINT64_MAX;
    gp_event_t *e = &log->ev[log->n++];
    memset(e, 0, sizeof *e);
    e->seq = log->next_seq++;
    e->addr = addr;
    e->size = size;
    e->req = req;
    e->kind = kind;
    return e->seq;
}

int gp_log_reserve(gp_log_t *log) { return grow((void **)&log->ev, &log->cap, log->n, sizeof(gp_event_t)); }

size_t gp_log_copy(const gp_log_t *log, gp_event_t *buf, size_t cap) {
    size_t n = log->n < cap ? log->n : cap;
    if (buf && n) memcpy(buf, log->ev, n * sizeof *buf);
    return log->n;
}

long gp_log_find_live(const gp_log_t *log, uint64_t addr) {
    /* Newest first: the latest event for this address decides whether it is live. */
    for (size_t i = log->n; i-- > 0;) {
        const gp_event_t *e = &log->ev[i];
        if (e->addr != addr) continue;
        if (e->kind == GP_EV_FREE || e->kind == GP_EV_IPC_CLOSE || e->kind == GP_EV_LIB_UNMAP) return -1;
        if (e->kind == GP_EV_ALLOC || e->kind == GP_EV_MAP_FIXED || e->kind == GP_EV_IPC_OPEN ||
            e->kind == GP_EV_LIB_MAP)
            return (long)i;
    }
    return -1;
}

long gp_log_find_reservation(const gp_log_t *log, uint64_t addr) {
    for (size_t i = log->n; i-- > 0;) {
        const gp_event_t *e = &log->ev[i];
        if ((e->kind != GP_EV_RESERVE && e->kind != GP_EV_UNRESERVE) || addr < e->addr || addr - e->addr >= e->size)
            continue;
        return e->kind == GP_EV_RESERVE ? (long)i : -1;
    }
    return -1;
}

static int ends_life(uint32_t kind) {
    return kind == GP_EV_FREE || kind == GP_EV_UNRESERVE || kind == GP_EV_IPC_CLOSE;
}

long gp_log_live_overlapping(const gp_log_t *log, uint64_t lo, uint64_t hi) {
    for (size_t i = 0; i < log->n; i++) {
        const gp_event_t *e = &log->ev[i];
        if (e->kind != GP_EV_ALLOC && e->kind != GP_EV_MAP_FIXED && e->kind != GP_EV_RESERVE &&
            e->kind != GP_EV_IPC_OPEN)
            continue;
        if (!(e->addr < hi && lo < e->addr + e->size)) continue;
        int live = 1; /* overlapping candidates are few: look for a later event that ends this one */
        for (size_t j = i + 1; j < log->n && live; j++)
            if (log->ev[j].addr == e->addr && ends_life(log->ev[j].kind)) live = 0;
        if (live) return (long)i;
    }
    return -1;
}

int gp_free_overlaps(const gp_free_t *f, uint64_t addr, uint64_t size) {
    for (size_t i = 0; i < f->n; i++)
        if (f->r[i].addr < addr + size && addr < f->r[i].addr + f->r[i].size) return 1;
    return 0;
}

int gp_free_add(gp_free_t *f, uint64_t addr, uint64_t size) {
    if (size == 0 || addr + size < addr) return -1;
    size_t i = 0;
    while (i < f->n && f->r[i].addr < addr) i++; /* insertion point: r[i-1] < addr <= r[i] */
    if (i > 0 && f->r[i - 1].addr + f->r[i - 1].size > addr) return -1;
    if (i < f->n && addr + size > f->r[i].addr) return -1;
    int join_prev = i > 0 && f->r[i - 1].addr + f->r[i - 1].size == addr;
    int join_next = i < f->n && addr + size == f->r[i].addr;
    if (join_prev && join_next) {
        f->r[i - 1].size += size + f->r[i].size;
        memmove(&f->r[i], &f->r[i + 1], (f->n - i - 1) * sizeof *f->r);
        f->n--;
    } else if (join_prev) {
        f->r[i - 1].size += size;
    } else if (join_next) {
        f->r[i].addr = addr;
        f->r[i].size += size;
    } else {
        if (grow((void **)&f->r, &f->cap, f->n, sizeof *f->r)) return -1;
        memmove(&f->r[i + 1], &f->r[i], (f->n - i) * sizeof *f->r);
        f->r[i].addr = addr;
        f->r[i].size = size;
        f->n++;
    }
    return 0;
}

int gp_free_take(gp_free_t *f, uint64_t size, uint64_t align, uint64_t *addr) {
    if (size == 0 || align == 0 || (align & (align - 1))) return -1;
    for (size_t i = 0; i < f->n; i++) {
        gp_range_t r = f->r[i];
        uint64_t a = gp_round_up(r.addr, align);
        if (a == 0 || a < r.addr || a - r.addr > r.size || r.size - (a - r.addr) < size) continue;
        uint64_t head = a - r.addr, tail = r.size - head - size;
        if (head && tail) { /* split in two: keep the head here, insert the tail after it */
            if (grow((void **)&f->r, &f->cap, f->n, sizeof *f->r)) return -1;
            memmove(&f->r[i + 2], &f->r[i + 1], (f->n - i - 1) * sizeof *f->r);
            f->r[i].size = head;
            f->r[i + 1].addr = a + size;
            f->r[i + 1].size = tail;
            f->n++;
        } else if (head) {
            f->r[i].size = head;
        } else if (tail) {
            f->r[i].addr = a + size;
            f->r[i].size = tail;
        } else {
            memmove(&f->r[i], &f->r[i + 1], (f->n - i - 1) * sizeof *f->r);
            f->n--;
        }
        *addr = a;
        return 0;
    }
    return -1;
}

uint64_t gp_images_append(gp_images_t *ims, uint32_t kind, uint64_t handle, uint64_t ptr, uint64_t size,
                          uint32_t owned, uint32_t format, uint32_t n_jit) {
    if (grow((void **)&ims->im, &ims->cap, ims->n, sizeof(gp_image_t))) return UINT64_MAX;
    gp_image_t *m = &ims->im[ims->n++];
    m->seq = ims->next_seq++;
    m->handle = handle;
    m->ptr = ptr;
    m->size = size;
    m->kind = kind;
    m->owned = owned;
    m->format = format;
    m->n_jit = n_jit;
    return m->seq;
}

static uint64_t elf64_size(const unsigned char *p) {
    uint64_t shoff, phoff, end = 64;
    uint16_t shentsize, shnum, phentsize, phnum;
    memcpy(&phoff, p + 0x20, 8);
    memcpy(&shoff, p + 0x28, 8);
    memcpy(&phentsize, p + 0x36, 2);
    memcpy(&phnum, p + 0x38, 2);
    memcpy(&shentsize, p + 0x3A, 2);
    memcpy(&shnum, p + 0x3C, 2);
    if (shoff && shoff + (uint64_t)shentsize * shnum > end) end = shoff + (uint64_t)shentsize * shnum;
    if (phoff && phoff + (uint64_t)phentsize * phnum > end) end = phoff + (uint64_t)phentsize * phnum;
    for (uint16_t i = 0; shoff && shentsize >= 64 && i < shnum; i++) {
        const unsigned char *sh = p + shoff + (uint64_t)i * shentsize;
        uint32_t type;
        uint64_t off, sz;
        memcpy(&type, sh + 4, 4);
        memcpy(&off, sh + 0x18, 8);
        memcpy(&sz, sh + 0x20, 8);
        if (type != 8 /* SHT_NOBITS */ && off + sz > end) end = off + sz;
    }
    for (uint16_t i = 0; phoff && phentsize >= 56 && i < phnum; i++) {
        const unsigned char *ph = p + phoff + (uint64_t)i * phentsize;
        uint64_t off, filesz;
        memcpy(&off, ph + 0x08, 8);
        memcpy(&filesz, ph + 0x20, 8);
        if (off + filesz > end) end = off + filesz;
    }
    return end;
}

uint64_t gp_image_size(const void *image, const void **start) {
    const unsigned char *p = (const unsigned char *)image;
    uint32_t magic;
    *start = image;
    if (!p) return 0;
    memcpy(&magic, p, 4);
    if (magic == 0x466243b1u) { /* fatbin wrapper: {int magic; int version; const void *data; void *x;} */
        const void *data;
        memcpy(&data, p + 8, sizeof data);
        return gp_image_size(data, start);
    }
    if (magic == 0xBA55ED50u) { /* fatbin: {u32 magic; u16 version; u16 headerSize; u64 fatSize;} */
        uint16_t hdr;
        uint64_t fat;
        memcpy(&hdr, p + 6, 2);
        memcpy(&fat, p + 8, 8);
        return (uint64_t)hdr + fat;
    }
    if (p[0] == 0x7f && p[1] == 'E' && p[2] == 'L' && p[3] == 'F') {
        if (p[4] != 2) return 0; /* only ELF64 */
        return elf64_size(p);
    }
    return (uint64_t)strlen((const char *)p) + 1; /* PTX text */
}

uint32_t gp_image_format(const void *image) {
    const unsigned char *p = (const unsigned char *)image;
    uint32_t magic;
    if (!p) return GP_IMG_UNKNOWN;
    memcpy(&magic, p, 4);
    if (magic == 0x466243b1u) {
        const void *data;
        memcpy(&data, p + 8, sizeof data);
        return gp_image_format(data);
    }
    if (magic == 0xBA55ED50u) return GP_IMG_FATBIN;
    if (p[0] == 0x7f && p[1] == 'E' && p[2] == 'L' && p[3] == 'F') return GP_IMG_ELF;
    return GP_IMG_PTX;
}
