/* The interposer ships prebuilt in a manylinux_2_28 wheel, so it must not need glibc symbol versions newer than
 * 2.28. glibc 2.34 moved dlopen & co. and the pthread functions into libc under new versions; a build on a newer
 * glibc would bind to those. These directives bind to the versions the architecture started with instead (they
 * still exist as compatibility symbols; build.sh keeps libdl and libpthread as DT_NEEDED for older glibc, where
 * they live there). tests/cpu/test_native.py checks the result with objdump -T. */
#ifndef GP_GLIBC_H
#define GP_GLIBC_H
#if defined(__x86_64__)
#define GP_GLIBC_BASE "GLIBC_2.2.5"
#elif defined(__aarch64__)
#define GP_GLIBC_BASE "GLIBC_2.17"
#endif
#ifdef GP_GLIBC_BASE
__asm__(".symver dlopen,dlopen@" GP_GLIBC_BASE);
__asm__(".symver dlvsym,dlvsym@" GP_GLIBC_BASE);
__asm__(".symver dladdr,dladdr@" GP_GLIBC_BASE);
__asm__(".symver dlerror,dlerror@" GP_GLIBC_BASE);
__asm__(".symver pthread_once,pthread_once@" GP_GLIBC_BASE);
__asm__(".symver pthread_create,pthread_create@" GP_GLIBC_BASE);
__asm__(".symver pthread_join,pthread_join@" GP_GLIBC_BASE);
__asm__(".symver pthread_sigmask,pthread_sigmask@" GP_GLIBC_BASE);
#endif
#endif
