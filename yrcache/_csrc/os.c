/* Calls into the operating system: mappings, futexes, file locks. */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

/* A process slot's liveness: a write lock on byte `slot` of the segment held
 * through the process's own open file description (see procs.c). */
int ofd_lock(int fd, uint64_t byte, short type) {
    struct flock fl;
    memset(&fl, 0, sizeof(fl));
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
    fl.l_start = (off_t)byte;
    fl.l_len = 1;
    return fcntl(fd, F_OFD_SETLK, &fl) == 0 ? 0 : -errno;
}

/* 1 if an open file description other than fd's locks `byte`, 0 if none
 * does, <0 on error (then the caller must assume alive). */
int ofd_held(int fd, uint64_t byte) {
    struct flock fl;
    memset(&fl, 0, sizeof(fl));
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = (off_t)byte;
    fl.l_len = 1;
    if (fcntl(fd, F_OFD_GETLK, &fl) != 0) return -errno;
    return fl.l_type != F_UNLCK;
}

int yr_futex_wait(uint32_t *addr, uint32_t expected, double timeout) {
    struct timespec ts, *tsp = NULL;
    if (timeout >= 0) {
        ts.tv_sec = (time_t)timeout;
        ts.tv_nsec = (long)((timeout - (double)ts.tv_sec) * 1e9);
        tsp = &ts;
    }
    /* Shared (not FUTEX_PRIVATE): waiters live in other processes. */
    long r = syscall(SYS_futex, addr, FUTEX_WAIT, expected, tsp, NULL, 0);
    if (r == 0) return 0;
    return errno == ETIMEDOUT ? 1 : (errno == EAGAIN || errno == EINTR ? 0 : -errno);
}

int yr_futex_wake(uint32_t *addr) {
    __atomic_fetch_add(addr, 1, __ATOMIC_SEQ_CST);
    return (int)syscall(SYS_futex, addr, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

void *yr_map(int fd, uint64_t size, int populate) {
    int flags = MAP_SHARED | (populate ? MAP_POPULATE : 0);
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, flags, fd, 0);
    return p == MAP_FAILED ? NULL : p;
}

int yr_unmap(void *addr, uint64_t size) { return munmap(addr, size); }

/* Fault every page in for writing: 0, or -errno (EFAULT or ENOMEM: the
 * filesystem has no room for them, where a plain touch would get SIGBUS;
 * EINVAL: a kernel older than 5.14). */
int yr_populate_write(void *addr, uint64_t size) {
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
    return madvise(addr, size, MADV_POPULATE_WRITE) == 0 ? 0 : -errno;
}

void yr_memcpy(void *dst, const void *src, uint64_t n) { memcpy(dst, src, n); }
