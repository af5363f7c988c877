/* The interposer's process state (gp_state.h), its diagnostics and the environment it reads once. */
#define _GNU_SOURCE
#include "gp_state.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

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

static void read_env_once(void) {
    const char *b = getenv("GP_REGION_BASE"), *s = getenv("GP_REGION_SIZE"), *l = getenv("GP_LOG");
    g_log_on = l && *l && *l != '0';
    if (s && *s) g_want_size = strtoull(s, NULL, 0);
    if (b && *b) g_want_base = strtoull(b, NULL, 0);
    __atomic_store_n(&g_enabled, g_want_base != 0, __ATOMIC_RELEASE); /* last: the region is fully described */
}

void read_env(void) { pthread_once(&g_env_once, read_env_once); }

int enabled(void) {
    read_env();
    return __atomic_load_n(&g_enabled, __ATOMIC_ACQUIRE);
}
