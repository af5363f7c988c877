/* The interposer's process state (gp_state.h), its diagnostics and the environment it reads once. */
#define _GNU_SOURCE
#include "gp_state.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

pthread_mutex_t g_lock = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;
gp_bump_t g_bump;
gp_log_t g_log;
gp_images_t g_images;
int g_enabled;
uint64_t g_want_base, g_want_size;
int g_log_on;
int g_reuse;
gp_free_t g_free;
int g_failed;
char g_error[512];
CUdevice g_dev;
gp_ipc_table_t g_imports;
live_t *g_live;
size_t g_nlive, g_caplive;

static pthread_once_t g_env_once = PTHREAD_ONCE_INIT;

void gp_log(const char *fmt, ...) {
    if (!g_log_on) return;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "[gp] ");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

void set_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_error, sizeof g_error, fmt, ap);
    va_end(ap);
    fprintf(stderr, "[gp] ERROR: %s\n", g_error);
}

/* ---- fault injection ---- */

static const char *const g_fault_sites[] = {"reserve", "create", "map",  "access",    "unmap",   "release", "sync",
                                            "export",  "import", "fd",   "live_grow", "log_grow", NULL};
static char g_fault_site[16];
static long g_fault_left; /* hits of g_fault_site until it fires; 0: disarmed */

static int arm_fault(const char *site, long nth) {
    for (const char *const *k = g_fault_sites; *k; k++)
        if (strcmp(*k, site) == 0) {
            snprintf(g_fault_site, sizeof g_fault_site, "%s", site);
            g_fault_left = nth > 0 ? nth : 0;
            return 0;
        }
    return -1;
}

int gp_fault(const char *site) {
    if (!__atomic_load_n(&g_fault_left, __ATOMIC_RELAXED)) return 0;
    pthread_mutex_lock(&g_lock);
    int fire = g_fault_left && strcmp(site, g_fault_site) == 0 && --g_fault_left == 0;
    pthread_mutex_unlock(&g_lock);
    if (fire) fprintf(stderr, "[gp] fault injected at %s\n", site);
    return fire;
}

/* Arms `site` to fail at its nth hit from now (nth <= 0 disarms); -1 for a site the interposer does not have. */
GP_EXPORT int gp_fault_inject(const char *site, long nth) {
    read_env();
    pthread_mutex_lock(&g_lock);
    int rc = site ? arm_fault(site, nth) : -1;
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* Hits left before the armed fault fires: 0 once it fired (or when none is armed). */
GP_EXPORT long gp_fault_pending(void) {
    pthread_mutex_lock(&g_lock);
    long n = g_fault_left;
    pthread_mutex_unlock(&g_lock);
    return n;
}

int log_reserve(void) {
    if (gp_fault("log_grow") || gp_log_reserve(&g_log)) {
        set_error("out of host memory for the allocation log");
        return -1;
    }
    return 0;
}

/* ---- environment ---- */

static void read_env_once(void) {
    const char *b = getenv("GP_REGION_BASE"), *s = getenv("GP_REGION_SIZE"), *l = getenv("GP_LOG");
    const char *f = getenv("GP_FAULT");
    g_log_on = l && *l && *l != '0';
    if (f && *f) { /* <site>:<nth> */
        char site[sizeof g_fault_site];
        const char *colon = strchr(f, ':');
        size_t n = colon ? (size_t)(colon - f) : strlen(f);
        long nth = colon ? strtol(colon + 1, NULL, 10) : 1;
        if (n >= sizeof site || (memcpy(site, f, n), site[n] = 0, arm_fault(site, nth)))
            fprintf(stderr, "[gp] ERROR: GP_FAULT=%s names no fault site of this interposer (ignored)\n", f);
    }
    if (s && *s) g_want_size = strtoull(s, NULL, 0);
    if (b && *b) g_want_base = strtoull(b, NULL, 0);
    __atomic_store_n(&g_enabled, g_want_base != 0, __ATOMIC_RELEASE); /* last: the region is fully described */
}

void read_env(void) { pthread_once(&g_env_once, read_env_once); }

int enabled(void) {
    read_env();
    return __atomic_load_n(&g_enabled, __ATOMIC_ACQUIRE);
}
