/* The control surface Python calls through ctypes (region.py): region info, enable, events, images, restore,
 * set_cursor (phase anchors), freeze. */
#define _GNU_SOURCE
#include <string.h>

#include "gp_state.h"

typedef struct {
    uint64_t base, size, cursor, gran;
    int64_t enabled, failed, n_events, n_images;
} gp_region_info_t;

GP_EXPORT int gp_region_info(gp_region_info_t *out) {
    read_env();
    pthread_mutex_lock(&g_lock);
    out->base = g_bump.base;
    out->size = g_bump.base ? g_bump.size : g_want_size;
    out->cursor = g_bump.cursor;
    out->gran = g_bump.gran;
    out->enabled = g_enabled;
    out->failed = g_failed;
    out->n_events = (int64_t)g_log.n;
    out->n_images = (int64_t)g_images.n;
    pthread_mutex_unlock(&g_lock);
    return 0;
}

/* Enable the region from Python (when GP_REGION_BASE was not set); only before the first placement. */
GP_EXPORT int gp_enable(uint64_t base, uint64_t size) {
    read_env();
    pthread_mutex_lock(&g_lock);
    int rc = -1;
    if (!g_bump.base) {
        g_want_base = base;
        if (size) g_want_size = size;
        __atomic_store_n(&g_enabled, base != 0, __ATOMIC_RELEASE);
        rc = 0;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* Force the reservation now (a context must be current). */
GP_EXPORT int gp_reserve_now(void) {
    read_env();
    pthread_mutex_lock(&g_lock);
    int rc = enabled() ? ensure_region() : -1;
    pthread_mutex_unlock(&g_lock);
    return rc;
}

GP_EXPORT size_t gp_events(gp_event_t *buf, size_t cap) {
    pthread_mutex_lock(&g_lock);
    size_t total = gp_log_copy(&g_log, buf, cap);
    pthread_mutex_unlock(&g_lock);
    return total;
}

GP_EXPORT size_t gp_images(gp_image_t *buf, size_t cap) {
    pthread_mutex_lock(&g_lock);
    size_t n = g_images.n < cap ? g_images.n : cap;
    if (buf && n) memcpy(buf, g_images.im, n * sizeof *buf);
    size_t total = g_images.n;
    pthread_mutex_unlock(&g_lock);
    return total;
}

/* The free list (ranges reused after gp_freeze), for diagnostics and tests; returns how many there are. */
GP_EXPORT size_t gp_free_ranges(gp_range_t *buf, size_t cap) {
    pthread_mutex_lock(&g_lock);
    size_t n = g_free.n < cap ? g_free.n : cap;
    if (buf && n) memcpy(buf, g_free.r, n * sizeof *buf);
    size_t total = g_free.n;
    pthread_mutex_unlock(&g_lock);
    return total;
}

/* One recorded allocation at its recorded address: inside the region, aligned, on nothing live. Below the cursor
 * (a phase LOAD skipped, whose span the next phase's anchor stepped over) it must also miss every freed range,
 * which the free list could hand out again once the layout is frozen. */
static int map_fixed_locked(uint64_t addr, uint64_t size) {
    if (!size || !in_region(addr) || !in_region(addr + size - 1) || size % g_bump.gran || addr % g_bump.gran) {
        set_error("restoring 0x%llx+%llu: outside the region or unaligned", (unsigned long long)addr,
                  (unsigned long long)size);
        return -1;
    }
    long ev = gp_log_live_overlapping(&g_log, addr, addr + size);
    if (ev >= 0) {
        set_error("restoring 0x%llx+%llu overlaps live memory at 0x%llx+%llu", (unsigned long long)addr,
                  (unsigned long long)size, (unsigned long long)g_log.ev[ev].addr,
                  (unsigned long long)g_log.ev[ev].size);
        return -1;
    }
    if (addr - g_bump.base < g_bump.cursor && gp_free_overlaps(&g_free, addr, size)) {
        set_error("restoring 0x%llx+%llu below the cursor overlaps memory this process freed",
                  (unsigned long long)addr, (unsigned long long)size);
        return -1;
    }
    for (size_t i = 0; i < g_nlive; i++)
        if (addr < g_live[i].addr + g_live[i].size && g_live[i].addr < addr + size) {
            set_error("restoring 0x%llx overlaps the live allocation at 0x%llx", (unsigned long long)addr,
                      (unsigned long long)g_live[i].addr);
            return -1;
        }
    CUresult r = log_reserve() ? CUDA_ERROR_OUT_OF_MEMORY : map_at(addr, size);
    if (r != CUDA_SUCCESS) {
        set_error("restoring 0x%llx+%llu: mapping failed with %d", (unsigned long long)addr,
                  (unsigned long long)size, (int)r);
        return -1;
    }
    gp_log_append(&g_log, GP_EV_MAP_FIXED, addr, size, size);
    return 0;
}

/* Undoes the first `done` ranges of a failed restore: they are the newest live entries and the newest events. */
static void unrestore_locked(size_t done, size_t n_events) {
    for (; done > 0; done--) {
        live_t *l = &g_live[--g_nlive];
        unmap_release(l->addr, l->size, l->h);
    }
    g_log.next_seq -= g_log.n - n_events;
    g_log.n = n_events;
}

/* LOAD's memory restore as one step under the lock: no allocation may have happened since Python checked the
 * log (`expect_events`), then every range is mapped and the cursor moves to SAVE's final offset. A restore that
 * fails midway unmaps and releases what it mapped and drops its events: the process is as before the call and can
 * go on to capture normally. */
GP_EXPORT int gp_restore(const uint64_t *addrs, const uint64_t *sizes, size_t n, uint64_t expect_events,
                         uint64_t final_offset) {
    pthread_mutex_lock(&g_lock);
    int rc = -1;
    if (ensure_region() != 0) goto out;
    if (g_log.n != expect_events) {
        set_error("%llu allocation event(s) happened while LOAD was restoring memory (another thread allocated)",
                  (unsigned long long)(g_log.n - expect_events));
        goto out;
    }
    size_t done = 0;
    while (done < n && map_fixed_locked(addrs[done], sizes[done]) == 0) done++;
    if (done == n && gp_bump_set_cursor(&g_bump, final_offset)) {
        set_error("cannot move the cursor to SAVE's final offset 0x%llx (now 0x%llx)",
                  (unsigned long long)final_offset, (unsigned long long)g_bump.cursor);
    } else if (done == n) {
        rc = 0;
    }
    if (rc != 0) unrestore_locked(done, expect_events);
out:
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* Moves the cursor forward to region offset `offset` (a phase's anchor, or the headroom after a variable phase), as
 * one locked step: refuses if an allocation happened since Python read `expect_events` events, if the cursor is
 * already past the offset (a phase overran: moving back would hand out live memory again), or if live memory lies
 * at or above the new cursor (the next allocations would overlap it). */
GP_EXPORT int gp_set_cursor(uint64_t offset, uint64_t expect_events) {
    pthread_mutex_lock(&g_lock);
    int rc = -1;
    if (ensure_region() != 0) goto out;
    if (g_log.n != expect_events) {
        set_error("%llu allocation event(s) happened while the cursor was being moved (another thread allocated)",
                  (unsigned long long)(g_log.n - expect_events));
        goto out;
    }
    if (offset < g_bump.cursor) {
        set_error("cannot move the cursor back from offset 0x%llx to 0x%llx: the memory below 0x%llx is in use "
                  "(the previous phase overran this anchor)", (unsigned long long)g_bump.cursor,
                  (unsigned long long)offset, (unsigned long long)g_bump.cursor);
        goto out;
    }
    if (offset > g_bump.size || offset % g_bump.gran) {
        set_error("cursor offset 0x%llx is past the region's end 0x%llx or not a multiple of the granularity %llu",
                  (unsigned long long)offset, (unsigned long long)g_bump.size, (unsigned long long)g_bump.gran);
        goto out;
    }
    long ev = gp_log_live_overlapping(&g_log, g_bump.base + offset, g_bump.base + g_bump.size);
    if (ev >= 0) {
        set_error("cannot move the cursor to offset 0x%llx: live memory at 0x%llx+%llu lies at or above it, and "
                  "the next allocations would overlap it", (unsigned long long)offset,
                  (unsigned long long)g_log.ev[ev].addr, (unsigned long long)g_log.ev[ev].size);
        goto out;
    }
    if (gp_bump_set_cursor(&g_bump, offset)) {
        set_error("cannot move the cursor to offset 0x%llx (now 0x%llx)", (unsigned long long)offset,
                  (unsigned long long)g_bump.cursor);
        goto out;
    }
    rc = 0;
out:
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* The layout is recorded (SAVE) or restored (LOAD): from now on freed ranges are handed out again. */
GP_EXPORT void gp_freeze(void) {
    pthread_mutex_lock(&g_lock);
    g_reuse = 1;
    pthread_mutex_unlock(&g_lock);
}

GP_EXPORT const char *gp_last_error(void) { return g_error; }
