/* Calls into the operating system: mappings, futexes, file locks. */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/resource.h>
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

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
#define POPULATE_THREADS 8
#define POPULATE_CHUNK (256ull << 20)   /* the least a thread of its own is worth */

typedef struct { char *addr; uint64_t size; int rc; } populate_part;

static void *populate_run(void *arg) {
    populate_part *p = arg;
    p->rc = madvise(p->addr, p->size, MADV_POPULATE_WRITE) == 0 ? 0 : -errno;
    return NULL;
}

/* Fault every page in for writing: 0, or -errno (EFAULT or ENOMEM: the
 * filesystem has no room for them, where a plain touch would get SIGBUS;
 * EINVAL: a kernel older than 5.14).  The kernel zeroes each new page on the
 * CPU that faults it, so a large range is split over a thread per CPU (up to
 * 8): 1 GiB took 1.07-1.16 s in one thread here, 0.71-0.77 s in two. */
int yr_populate_write(void *addr, uint64_t size) {
    long cpus = sysconf(_SC_NPROCESSORS_ONLN), pg = sysconf(_SC_PAGESIZE);
    uint64_t n = cpus < 1 ? 1 : cpus > POPULATE_THREADS ? POPULATE_THREADS : (uint64_t)cpus;
    if (n > size / POPULATE_CHUNK) n = size / POPULATE_CHUNK ? size / POPULATE_CHUNK : 1;
    uint64_t chunk = (size / n + (uint64_t)pg - 1) & ~((uint64_t)pg - 1);
    populate_part parts[POPULATE_THREADS];
    pthread_t threads[POPULATE_THREADS];
    int started[POPULATE_THREADS] = {0};
    for (uint64_t i = 0; i < n; i++) {
        uint64_t at = i * chunk < size ? i * chunk : size;
        parts[i] = (populate_part){(char *)addr + at, size - at < chunk ? size - at : chunk, 0};
        if (i > 0 && parts[i].size) started[i] = pthread_create(&threads[i], NULL, populate_run, &parts[i]) == 0;
    }
    populate_run(&parts[0]);
    int rc = parts[0].rc;
    for (uint64_t i = 1; i < n; i++) {
        if (started[i]) pthread_join(threads[i], NULL);
        else if (parts[i].size) populate_run(&parts[i]);    /* no thread to be had: here, then */
        if (!rc) rc = parts[i].rc;
    }
    return rc;
}

/* Copies of at least this many bytes may bypass the caches (non-temporal
 * stores): they are far larger than a core's share of L3, so caching them
 * only evicts everything else -- the reader's interpreter state included, which
 * then costs ~100 us of misses on the next call -- and on some machines memcpy
 * runs them at half speed (an AMD EPYC: 64 MiB at 14 GB/s streamed, 6-7 GB/s
 * through memcpy).  yr_memcpy measures which way is faster here. */
#define NT_COPY_MIN (8u << 20)

#if defined(__x86_64__)
#include <immintrin.h>

__attribute__((target("avx2")))
static void stream_avx2(char *d, const char *s, uint64_t blocks) {
    for (; blocks; blocks--, s += 64, d += 64) {
        _mm_prefetch(s + 512, _MM_HINT_NTA);
        __m256i a = _mm256_loadu_si256((const __m256i *)s);
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + 32));
        _mm256_stream_si256((__m256i *)d, a);
        _mm256_stream_si256((__m256i *)(d + 32), b);
    }
}

static void stream_sse2(char *d, const char *s, uint64_t blocks) {
    for (; blocks; blocks--, s += 64, d += 64) {
        _mm_prefetch(s + 512, _MM_HINT_NTA);
        for (int i = 0; i < 64; i += 16)
            _mm_stream_si128((__m128i *)(d + i), _mm_loadu_si128((const __m128i *)(s + i)));
    }
}

static void stream_copy(char *d, const char *s, uint64_t n) {
    uint64_t head = (64 - ((uintptr_t)d & 63)) & 63;   /* align the destination */
    memcpy(d, s, head);
    d += head; s += head; n -= head;
    if (__builtin_cpu_supports("avx2")) stream_avx2(d, s, n / 64);
    else stream_sse2(d, s, n / 64);
    _mm_sfence();
    memcpy(d + (n & ~(uint64_t)63), s + (n & ~(uint64_t)63), n & 63);
}
#else
static void stream_copy(char *d, const char *s, uint64_t n) { memcpy(d, s, n); }
#endif

int yr_advise_huge(void *addr, uint64_t size) {
    return madvise(addr, size, MADV_HUGEPAGE) == 0 ? 0 : -errno;
}

/* Map the pages of a range this process has not touched, for reading or
 * writing: one read per 64 KiB.  The arena's pages exist (the creator
 * allocated them all), and a read fault on a shared file mapping maps the
 * 16 cached pages around it at once (the kernel's fault-around, 64 KiB since
 * 3.15); shmem maps them writable, as it needs no write notification.  So 2,048
 * faults map 128 MiB, against 32,768 page lookups for MADV_POPULATE_READ
 * (128 MiB: 11.5-12.5 vs 14.5-18.5 ms here; MADV_POPULATE_WRITE 40 ms, and
 * 85 ms of faults taken one 4 KiB page at a time).
 *
 * Fault-around maps only pages that hold data: in a store created without
 * prefault, a page nobody has touched yet is allocated but not initialised,
 * and each one takes a fault of its own.  A few probes tell: if a page next to
 * one just read still faults, the range is mapped page by page
 * (MADV_POPULATE_READ, or a read of every page on a kernel older than 5.14). */
#define FAULT_AROUND (64u << 10)
#define PROBES 4

static long thread_minflt(void) {
    struct rusage r;
    return getrusage(RUSAGE_THREAD, &r) == 0 ? r.ru_minflt : -1;
}

int yr_populate(void *addr, uint64_t n, int write) {
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
    (void)write;
    if (!n) return 0;
    volatile const char *p = addr;
    uintptr_t first = (uintptr_t)addr, end = first + n;
    long pg = sysconf(_SC_PAGESIZE);
    char sink = 0;
    for (uintptr_t at = first & ~(uintptr_t)(FAULT_AROUND - 1); at < end; at += FAULT_AROUND)
        sink ^= p[(at < first ? first : at) - first];
    sink ^= p[n - 1];
    if (n < 2 * FAULT_AROUND) return sink & 0;
    long f0 = thread_minflt();
    for (int i = 0; i < PROBES; i++) {       /* the page after a window's first, in windows spread out */
        uintptr_t at = (first + (n / PROBES) * (uint64_t)i + FAULT_AROUND - 1) & ~(uintptr_t)(FAULT_AROUND - 1);
        if (at + (uintptr_t)pg < end) sink ^= p[at + (uintptr_t)pg - first];
    }
    if (f0 < 0 || thread_minflt() == f0) return sink & 0;
    uintptr_t start = first & ~(uintptr_t)(pg - 1);
    uint64_t len = (end - start + (uint64_t)pg - 1) & ~(uint64_t)(pg - 1);
    if (madvise((void *)start, len, MADV_POPULATE_READ) == 0) return sink & 0;
    if (errno != EINVAL) return -errno;
    for (uint64_t off = 0; off < len; off += (uint64_t)pg) sink ^= ((volatile const char *)start)[off];
    return sink & 0;
}

/* Which of the two ways a large copy takes is measured, not assumed, per size class
 * (below and from 128 MiB): on an AMD EPYC machine streaming ran 64 MiB at twice
 * memcpy's speed and 1 GiB at about the same; on an Intel Xeon (a 480 MiB L3) it ran
 * 16-64 MiB at 1.1x memcpy's speed (copies alternating between the two, the way puts
 * alternate between blocks) and 256 MiB-1 GiB at 0.65-0.7x.  A process's first
 * COPY_TRIALS copies of a class alternate between the two ways, timed; later copies
 * of that class take the faster (best rate each).  Races between threads only blur
 * the trials. */
#define COPY_TRIALS 4
#define COPY_BIG (128ull << 20)
static int copy_choice[2];         /* per class: 0 still trying, 1 streamed, 2 memcpy */
static int copy_trials[2];
static double copy_rate[2][2];     /* per class, the best bytes per ns seen: streamed, memcpy */

void yr_memcpy(void *dst, const void *src, uint64_t n) {
    if (n < NT_COPY_MIN) {
        memcpy(dst, src, n);
        return;
    }
    int cls = n >= COPY_BIG, choice = __atomic_load_n(&copy_choice[cls], __ATOMIC_RELAXED);
    if (choice) {
        if (choice == 1) stream_copy(dst, src, n);
        else memcpy(dst, src, n);
        return;
    }
    int trial = __atomic_fetch_add(&copy_trials[cls], 1, __ATOMIC_RELAXED), way = trial & 1;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    if (way == 0) stream_copy(dst, src, n);
    else memcpy(dst, src, n);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double ns = (double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec);
    double rate = (double)n / (ns > 1 ? ns : 1);
    if (rate > copy_rate[cls][way]) copy_rate[cls][way] = rate;
    if (trial + 1 >= COPY_TRIALS)
        __atomic_store_n(&copy_choice[cls], copy_rate[cls][0] >= copy_rate[cls][1] ? 1 : 2, __ATOMIC_RELAXED);
}
