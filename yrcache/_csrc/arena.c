/* yrcache DRAM arena: see arena.h and docs/architecture.md.
 *
 * Layout of the mapping (all offsets from its base):
 *   [hdr_t][buckets: u64 x nbuckets][procs: proc_t x nprocs][pins: pin_t x npins][heap]
 * The heap is a sequence of blocks, each starting with a 128-byte blk_t; a
 * block's size is a multiple of 64 so payloads are 64-byte aligned.  Free
 * blocks sit on segregated lists (one per power of two) and are coalesced
 * with their neighbours on free, so fragmentation never hides space that a
 * merge could recover.
 *
 * Crash safety: the heap stays walkable at every instant (a split writes the
 * new remainder header before it shrinks the block; a merge only grows a free
 * block), so a survivor that inherits the robust mutex with EOWNERDEAD can
 * rebuild every derived structure (free lists, hash chains, pin counts,
 * accounting) from the blocks alone: see recover_locked(). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "arena.h"

#define MAGIC       0x3145484341435259ULL /* "YRCACHE1" little endian */
#define LAYOUT      2
#define ALIGN       64
#define BLK_HDR     128
#define MIN_BLOCK   128
#define NCLASSES    58
#define NNOTIFY     16
#define NUSER       16
#define SCAN_LIMIT  64
#define SMALL_BLOCK 4096
#define PIN_PAGE    4096u   /* pin records per page grown from the heap */
#define MAX_PIN_PAGES 1024
#define MAX_PROCS   (1u << 16)
#define MAX_STATIC_PINS (1u << 24)

#define TIER_DRAM 1
#define TIER_SSD  2
#define TIER_HBM  3

/* RETIRED: a stub taken out of the index whose bytes live in a lower tier;
 * it waits on the retire list until a process frees those bytes (the disk
 * copy, the device tensor).  PINPAGE: a page of pin records. */
enum { ST_FREE = 0x0F, ST_RESERVED = 0x1E, ST_LIVE = 0x2D, ST_ORPHAN = 0x3C,
       ST_RETIRED = 0x4B, ST_PINPAGE = 0x5A };
enum { C_HITS, C_MISSES, C_PUTS, C_DELETES, C_SPILLS, C_PROMOTIONS, C_EVICTIONS,
       C_RECOVERIES, C_NCOUNTERS = 16 };

typedef struct {
    uint64_t size;        /* whole block, header included */
    uint64_t prev_size;   /* physically previous block, 0 for the first */
    uint32_t state;
    uint32_t owner;       /* process slot that reserved it */
    uint32_t pins;        /* pin records pointing here */
    uint32_t klen;
    uint64_t next;        /* free list link, or hash chain link when live */
    uint64_t prev;        /* free list back link */
    uint64_t hash;
    uint64_t seq;
    uint64_t nbytes;
    uint32_t mlen;
    uint32_t payload_rel; /* payload offset from the block start */
    int64_t  priority;
    double   expire_at;
    uint64_t access_count;
    double   last_access;
    uint64_t aux[2];      /* reserved for tier bookkeeping */
} blk_t;

typedef struct {
    uint32_t pid;
    uint32_t state;
    uint64_t starttime;
    uint32_t is_owner;
    uint32_t pins;
} proc_t;

typedef struct {
    uint64_t block_off;   /* 0: free record */
    uint32_t slot;
    uint32_t next_free;
} pin_t;

typedef struct {
    uint64_t magic, layout, size;
    uint64_t nbuckets, buckets_off;
    uint64_t procs_off, pins_off;
    uint64_t heap_off, heap_size;
    uint32_t nprocs, npins;
    uint64_t seq;
    uint64_t used, objects, orphans, reserved, pinned_bytes;
    uint64_t ttl_objects;     /* live objects with an expiry: yr_expire skips its scan at 0 */
    uint64_t counters[C_NCOUNTERS];
    uint64_t freehead[NCLASSES];
    uint64_t free_bitmap;
    uint32_t pin_free;    /* head of the free pin stack, 0 when empty */
    uint32_t npages;      /* pin pages grown from the heap */
    uint64_t pin_pages[MAX_PIN_PAGES];
    uint64_t retired_head;  /* list of ST_RETIRED blocks, linked by next */
    uint64_t retired_count;
    uint32_t notify[NNOTIFY];
    uint64_t user[NUSER];
    char     config[4096];  /* the creator's settings (JSON), read by attachers */
    char     lockpad[0] __attribute__((aligned(64)));
    pthread_mutex_t lock;
} hdr_t;

_Static_assert(sizeof(blk_t) == BLK_HDR, "block header must be 128 bytes");

#define H(base)        ((hdr_t *)(base))
#define AT(base, off)  ((blk_t *)((char *)(base) + (off)))
#define BUCKETS(h)     ((uint64_t *)((char *)(h) + (h)->buckets_off))
#define PROCS(h)       ((proc_t *)((char *)(h) + (h)->procs_off))
#define PINS(h)        ((pin_t *)((char *)(h) + (h)->pins_off))
#define TIER_OF(b)     ((uint32_t)(b)->aux[0])
#define KEY(b)         ((char *)(b) + BLK_HDR)
/* Keys starting with NUL are the store's own (configuration): no public key
 * can collide with them, and they stay out of counts, scans and key lists. */
#define INTERNAL(b)    ((b)->klen && KEY(b)[0] == 0)

static inline uint64_t align_up(uint64_t n, uint64_t a) { return (n + a - 1) & ~(a - 1); }

static double now_realtime(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* 64-bit FNV-1a followed by a murmur finaliser to spread the low bits. */
static uint64_t hash_key(const char *k, uint32_t n) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (uint32_t i = 0; i < n; i++) { h ^= (unsigned char)k[i]; h *= 0x100000001b3ULL; }
    h ^= h >> 33; h *= 0xff51afd7ed558ccdULL; h ^= h >> 33;
    return h;
}

static inline int size_class(uint64_t size) {
    uint64_t units = size / ALIGN;
    int c = 63 - __builtin_clzll(units);
    return c < NCLASSES ? c : NCLASSES - 1;
}

/* ---------------------------------------------------------------- locking */

static void recover_locked(hdr_t *h);

static int lock(hdr_t *h) {
    int r = pthread_mutex_lock(&h->lock);
    if (r == EOWNERDEAD) {
        /* The previous holder died inside a critical section: rebuild all
         * derived state from the (always walkable) heap, then carry on. */
        recover_locked(h);
        h->counters[C_RECOVERIES]++;
        pthread_mutex_consistent(&h->lock);
        return 0;
    }
    return r == 0 ? 0 : YR_ELOCK;
}

static inline void unlock(hdr_t *h) { pthread_mutex_unlock(&h->lock); }

/* ------------------------------------------------------------- free lists */

static void fl_insert(hdr_t *h, uint64_t off) {
    blk_t *b = AT(h, off);
    int c = size_class(b->size);
    b->prev = 0;
    b->next = h->freehead[c];
    if (b->next) AT(h, b->next)->prev = off;
    h->freehead[c] = off;
    h->free_bitmap |= 1ULL << c;
}

static void fl_remove(hdr_t *h, uint64_t off) {
    blk_t *b = AT(h, off);
    int c = size_class(b->size);
    if (b->prev) AT(h, b->prev)->next = b->next; else h->freehead[c] = b->next;
    if (b->next) AT(h, b->next)->prev = b->prev;
    if (!h->freehead[c]) h->free_bitmap &= ~(1ULL << c);
    b->next = b->prev = 0;
}

static inline uint64_t heap_end(hdr_t *h) { return h->heap_off + h->heap_size; }

static void set_next_prev_size(hdr_t *h, uint64_t off) {
    blk_t *b = AT(h, off);
    uint64_t nxt = off + b->size;
    if (nxt < heap_end(h)) AT(h, nxt)->prev_size = b->size;
}

/* Find a free block of at least `need` bytes, take it off its list, split
 * off the tail if it is big enough to stand alone.  Returns 0 when none. */
/* Small blocks (stubs of spilled objects, small values) are carved from the
 * tail of the highest-addressed free block that fits (of a bounded number
 * probed, largest classes first); large ones from the head of a fitting
 * block.  Small and large objects so gather at opposite ends of free space,
 * and the stub a spill leaves behind does not split the hole its object
 * leaves, which the next object of that size needs whole. */
static uint64_t alloc_small_from_tail(hdr_t *h, uint64_t need) {
    uint64_t best = 0;
    int probes = 0;
    for (int c = NCLASSES - 1; c >= 0 && probes < SCAN_LIMIT; c--) {
        if (!(h->free_bitmap & (1ULL << c))) continue;
        for (uint64_t off = h->freehead[c]; off && probes < SCAN_LIMIT; off = AT(h, off)->next, probes++)
            if (AT(h, off)->size >= need && off > best) best = off;
    }
    if (!best) return 0;
    blk_t *f = AT(h, best);
    if (f->size < need + MIN_BLOCK) {   /* too small to split: take it whole */
        fl_remove(h, best);
        h->used += f->size;
        return best;
    }
    uint64_t keep = f->size - need, noff = best + keep;
    blk_t *n = AT(h, noff);
    /* The new block's header first: until f shrinks, a walk skips over it. */
    memset(n, 0, BLK_HDR);
    n->size = need;
    n->prev_size = keep;
    n->state = ST_FREE;     /* the caller marks it RESERVED once it is filled in */
    uint64_t after = noff + need;
    if (after < heap_end(h)) AT(h, after)->prev_size = need;
    fl_remove(h, best);
    __atomic_store_n(&f->size, keep, __ATOMIC_RELEASE);
    fl_insert(h, best);
    h->used += need;
    return noff;
}

static uint64_t alloc_block(hdr_t *h, uint64_t need) {
    if (need <= SMALL_BLOCK) {
        uint64_t off = alloc_small_from_tail(h, need);
        if (off) return off;
    }
    int c = size_class(need);
    uint64_t found = 0;
    /* First fit in the exact class, a bounded number of probes... */
    int probes = 0;
    for (uint64_t off = h->freehead[c]; off && probes < SCAN_LIMIT; off = AT(h, off)->next, probes++)
        if (AT(h, off)->size >= need) { found = off; break; }
    /* ...then any block of a larger class fits by construction... */
    if (!found) {
        uint64_t mask = (c + 1 < 64) ? (h->free_bitmap & ~((2ULL << c) - 1)) : 0;
        if (mask) found = h->freehead[__builtin_ctzll(mask)];
    }
    /* ...and only then an exhaustive scan, so a fit is never missed. */
    if (!found)
        for (uint64_t off = h->freehead[c]; off; off = AT(h, off)->next)
            if (AT(h, off)->size >= need) { found = off; break; }
    if (!found) return 0;
    fl_remove(h, found);
    blk_t *b = AT(h, found);
    uint64_t rest = b->size - need;
    if (rest >= MIN_BLOCK) {
        /* Write the remainder before shrinking b: the heap stays walkable. */
        uint64_t roff = found + need;
        blk_t *r = AT(h, roff);
        memset(r, 0, BLK_HDR);
        r->size = rest;
        r->prev_size = need;
        r->state = ST_FREE;
        set_next_prev_size(h, roff);
        __atomic_store_n(&b->size, need, __ATOMIC_RELEASE);
        fl_insert(h, roff);
    }
    h->used += b->size;
    return found;
}

/* Return a block to the heap, merging with free neighbours. */
static void free_block(hdr_t *h, uint64_t off) {
    blk_t *b = AT(h, off);
    h->used -= b->size;
    b->state = ST_FREE;
    b->pins = 0;
    b->klen = 0;
    uint64_t nxt = off + b->size;
    if (nxt < heap_end(h) && AT(h, nxt)->state == ST_FREE) {
        fl_remove(h, nxt);
        b->size += AT(h, nxt)->size;
    }
    if (b->prev_size) {
        uint64_t poff = off - b->prev_size;
        blk_t *p = AT(h, poff);
        if (p->state == ST_FREE) {
            fl_remove(h, poff);
            p->size += b->size;
            off = poff;
            b = p;
        }
    }
    set_next_prev_size(h, off);
    fl_insert(h, off);
}

/* ------------------------------------------------------------------ index */

static inline int key_eq(blk_t *b, uint64_t hash, const char *k, uint32_t n) {
    return b->hash == hash && b->klen == n && memcmp(KEY(b), k, n) == 0;
}

/* Returns the bucket slot that points at the matching block (so the caller
 * can unlink it), or NULL. */
static uint64_t *find_slot(hdr_t *h, uint64_t hash, const char *k, uint32_t n) {
    uint64_t *slot = &BUCKETS(h)[hash & (h->nbuckets - 1)];
    while (*slot) {
        blk_t *b = AT(h, *slot);
        if (key_eq(b, hash, k, n)) return slot;
        slot = &b->next;
    }
    return NULL;
}

static void unpin_locked(hdr_t *h, uint32_t pin);

/* A block leaves the index for good.  A DRAM object's block is free; a stub's
 * bytes live in a lower tier, so the stub goes on the retire list, whence a
 * process that holds that tier frees the bytes (yr_drain_retired).  So no
 * retirement, not even an expiry found inside a lookup, loses track of them. */
static void dispose_locked(hdr_t *h, uint64_t off) {
    blk_t *b = AT(h, off);
    if (TIER_OF(b) != TIER_DRAM && !INTERNAL(b)) {
        b->state = ST_RETIRED;
        b->next = h->retired_head;
        h->retired_head = off;
        h->retired_count++;
    } else {
        free_block(h, off);
    }
}

/* Take a live block out of the index; dispose of it unless a view pins it. */
static void retire_locked(hdr_t *h, uint64_t *slot) {
    uint64_t off = *slot;
    blk_t *b = AT(h, off);
    *slot = b->next;
    b->next = 0;
    if (!INTERNAL(b)) h->objects--;
    if (b->expire_at != 0.0) h->ttl_objects--;
    if (b->pins) {
        b->state = ST_ORPHAN;
        h->orphans++;
    } else {
        dispose_locked(h, off);
    }
}

static inline int expired(blk_t *b, double now) {
    return b->expire_at != 0.0 && now >= b->expire_at;
}

/* ----------------------------------------------------------------- pins */

/* Pin records 1..npins-1 sit in the table laid out at init; more are grown
 * in pages from the heap when it runs out, so a fork that re-pins every live
 * view of its parent (or a reader holding many views) does not fail while
 * the heap has room. */
static inline uint32_t total_pins(hdr_t *h) { return h->npins + h->npages * PIN_PAGE; }

static inline pin_t *PIN(hdr_t *h, uint32_t p) {
    if (p < h->npins) return &PINS(h)[p];
    uint32_t q = p - h->npins;
    return (pin_t *)((char *)h + h->pin_pages[q / PIN_PAGE] + BLK_HDR) + q % PIN_PAGE;
}

static int grow_pins_locked(hdr_t *h) {
    if (h->npages >= MAX_PIN_PAGES) return 0;
    uint64_t off = alloc_block(h, BLK_HDR + (uint64_t)PIN_PAGE * sizeof(pin_t));
    if (!off) return 0;
    blk_t *b = AT(h, off);
    uint64_t size = b->size, prev_size = b->prev_size;
    memset(b, 0, BLK_HDR);
    b->size = size;
    b->prev_size = prev_size;
    pin_t *pg = (pin_t *)((char *)b + BLK_HDR);
    memset(pg, 0, (uint64_t)PIN_PAGE * sizeof(pin_t));
    /* Marked first, registered last: recovery frees a page that a death
     * left marked but unregistered, and rebuilds the free stack anyway. */
    b->state = ST_PINPAGE;
    uint32_t first = total_pins(h);
    h->pin_pages[h->npages] = off;
    h->npages++;
    for (uint32_t i = PIN_PAGE; i-- > 0;) {
        pg[i].next_free = h->pin_free;
        h->pin_free = first + i;
    }
    return 1;
}

static int pin_locked(hdr_t *h, uint32_t slot, uint64_t off) {
    if (!h->pin_free && !grow_pins_locked(h)) return YR_ENOPINS;
    uint32_t p = h->pin_free;
    pin_t *pr = PIN(h, p);
    h->pin_free = pr->next_free;
    pr->slot = slot;
    pr->next_free = 0;
    __atomic_store_n(&pr->block_off, off, __ATOMIC_RELEASE);
    blk_t *b = AT(h, off);
    if (b->pins++ == 0) h->pinned_bytes += b->size;
    PROCS(h)[slot].pins++;
    return (int)p;
}

static void unpin_locked(hdr_t *h, uint32_t p) {
    pin_t *pr = PIN(h, p);
    uint64_t off = pr->block_off;
    if (!off) return;
    blk_t *b = AT(h, off);
    if (PROCS(h)[pr->slot].pins) PROCS(h)[pr->slot].pins--;
    pr->block_off = 0;
    pr->next_free = h->pin_free;
    h->pin_free = p;
    if (b->pins && --b->pins == 0) {
        h->pinned_bytes -= b->size;
        if (b->state == ST_ORPHAN) {
            h->orphans--;
            dispose_locked(h, off);
        }
    }
}

/* ----------------------------------------------------------------- init */

uint64_t yr_arena_min_size(void) { return 1 << 20; }

/* The region offsets follow from the counts: computed here at init, and
 * again by yr_arena_check, which so refuses a header whose offsets a writer
 * could have forged to point outside the mapping. */
static void layout_regions(hdr_t *h) {
    h->buckets_off = align_up(sizeof(hdr_t), ALIGN);
    h->procs_off = align_up(h->buckets_off + h->nbuckets * 8, ALIGN);
    h->pins_off = align_up(h->procs_off + (uint64_t)h->nprocs * sizeof(proc_t), ALIGN);
    h->heap_off = align_up(h->pins_off + (uint64_t)h->npins * sizeof(pin_t), 4096);
}

int yr_arena_init(void *base, uint64_t size, uint32_t nprocs, uint32_t npins) {
    hdr_t *h = H(base);
    if (size < yr_arena_min_size() || nprocs < 2 || npins < 2 || nprocs > MAX_PROCS ||
        npins > MAX_STATIC_PINS) return YR_EBADARENA;
    memset(h, 0, sizeof(hdr_t));
    uint64_t nb = 1024;
    while (nb < size / 8192 && nb < (1ULL << 30)) nb <<= 1;
    h->nbuckets = nb;
    h->nprocs = nprocs;
    h->npins = npins;
    layout_regions(h);
    if (h->heap_off + 4 * MIN_BLOCK > size) return YR_EBADARENA;
    h->heap_size = (size - h->heap_off) & ~(uint64_t)(ALIGN - 1);
    h->size = size;
    memset(BUCKETS(h), 0, nb * 8);
    memset(PROCS(h), 0, (uint64_t)nprocs * sizeof(proc_t));
    pin_t *pins = PINS(h);
    memset(pins, 0, (uint64_t)npins * sizeof(pin_t));
    for (uint32_t i = 1; i < npins; i++) pins[i].next_free = (i + 1 < npins) ? i + 1 : 0;
    h->pin_free = 1;
    blk_t *b = AT(h, h->heap_off);
    memset(b, 0, BLK_HDR);
    b->size = h->heap_size;
    b->state = ST_FREE;
    fl_insert(h, h->heap_off);

    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    int r = pthread_mutex_init(&h->lock, &a);
    pthread_mutexattr_destroy(&a);
    if (r) return YR_ELOCK;
    h->layout = LAYOUT;
    __atomic_store_n(&h->magic, MAGIC, __ATOMIC_RELEASE); /* last: marks it ready */
    return YR_OK;
}

/* Everything an attacher derives addresses from must be consistent with the
 * mapping it has: a damaged or forged header gives an error, not a wild read.
 * (Block offsets inside the heap are trusted: the segment is ours alone,
 * which the caller checked before mapping it.) */
int yr_arena_check(void *base, uint64_t size) {
    hdr_t *h = H(base);
    if (size < sizeof(hdr_t)) return YR_EBADARENA;
    if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != MAGIC) return YR_EBADARENA;
    if (h->layout != LAYOUT || h->size != size) return YR_EBADARENA;
    uint64_t nb = h->nbuckets;
    if (nb < 1024 || nb > (1ULL << 30) || (nb & (nb - 1))) return YR_EBADARENA;
    if (h->nprocs < 2 || h->nprocs > MAX_PROCS || h->npins < 2 || h->npins > MAX_STATIC_PINS ||
        h->npages > MAX_PIN_PAGES) return YR_EBADARENA;
    hdr_t want;
    want.nbuckets = nb;
    want.nprocs = h->nprocs;
    want.npins = h->npins;
    layout_regions(&want);
    if (h->buckets_off != want.buckets_off || h->procs_off != want.procs_off ||
        h->pins_off != want.pins_off || h->heap_off != want.heap_off) return YR_EBADARENA;
    if (h->heap_off + 4 * MIN_BLOCK > size || h->heap_size != ((size - h->heap_off) & ~(uint64_t)(ALIGN - 1)))
        return YR_EBADARENA;
    for (uint32_t i = 0; i < h->npages; i++) {
        uint64_t off = h->pin_pages[i];
        if (off < h->heap_off || off + BLK_HDR + (uint64_t)PIN_PAGE * sizeof(pin_t) > h->heap_off + h->heap_size)
            return YR_EBADARENA;
    }
    return YR_OK;
}

uint64_t yr_arena_size(void *base) { return H(base)->size; }

/* ------------------------------------------------------------ processes */

/* A process slot is alive exactly as long as its process holds a write lock
 * on byte `slot` of the segment, taken through an open file description of
 * its own (F_OFD_SETLK).  The kernel drops the lock when the process dies,
 * in whatever PID namespace it ran: liveness never depends on the caller's
 * view of /proc (pids of another container look dead, a reused pid alive). */
static int ofd_lock(int fd, uint64_t byte, short type) {
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
static int ofd_held(int fd, uint64_t byte) {
    struct flock fl;
    memset(&fl, 0, sizeof(fl));
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = (off_t)byte;
    fl.l_len = 1;
    if (fcntl(fd, F_OFD_GETLK, &fl) != 0) return -errno;
    return fl.l_type != F_UNLCK;
}

int yr_proc_attach(void *base, int fd, uint32_t pid, uint64_t starttime, uint32_t is_owner) {
    hdr_t *h = H(base);
    if (lock(h)) return YR_ELOCK;
    int found = YR_ENOPROCS;
    proc_t *p = PROCS(h);
    for (uint32_t i = 1; i < h->nprocs; i++) {  /* slot 0 means "nobody" */
        /* Lock first, under the arena mutex: a sweeper never sees the slot
         * taken but unlocked. */
        if (p[i].state == 0 && ofd_lock(fd, i, F_WRLCK) == 0) {
            p[i].pid = pid;
            p[i].starttime = starttime;
            p[i].is_owner = is_owner;
            p[i].pins = 0;
            p[i].state = 1;
            found = (int)i;
            break;
        }
    }
    unlock(h);
    return found;
}

/* Drop everything a slot holds: pins, blocks it reserved for a put, and the
 * HBM stubs of its device tensors (device memory dies with its process). */
static void release_slot_locked(hdr_t *h, uint32_t slot) {
    uint32_t np = total_pins(h);
    for (uint32_t i = 1; i < np; i++) {
        pin_t *pr = PIN(h, i);
        if (pr->block_off && pr->slot == slot) unpin_locked(h, i);
    }
    uint64_t off = h->heap_off;
    while (off < heap_end(h)) {
        blk_t *b = AT(h, off);
        if (b->state == ST_RESERVED && b->owner == slot && TIER_OF(b) == TIER_SSD) {
            /* A stub reserved before its disk copy was written: the copy
             * (if any) goes through the retire list. */
            h->reserved--;
            b->state = ST_RETIRED;
            b->next = h->retired_head;
            h->retired_head = off;
            h->retired_count++;
        } else if (b->state == ST_RESERVED && b->owner == slot) {
            /* free_block may merge into the previous free block: continue
             * after whichever block now covers `off`. */
            uint64_t start = off;
            if (b->prev_size && AT(h, off - b->prev_size)->state == ST_FREE) start = off - b->prev_size;
            h->reserved--;
            free_block(h, off);
            off = start;
        }
        off += AT(h, off)->size;
    }
    for (uint64_t i = 0; i < h->nbuckets; i++) {
        uint64_t *s = &BUCKETS(h)[i];
        while (*s) {
            blk_t *b = AT(h, *s);
            if (TIER_OF(b) == TIER_HBM && (uint32_t)(b->aux[0] >> 32) == slot) {
                b->aux[0] = TIER_DRAM;   /* nothing left to free elsewhere */
                retire_locked(h, s);
            } else {
                s = &b->next;
            }
        }
    }
    for (uint64_t *s = &h->retired_head; *s;) {
        blk_t *b = AT(h, *s);
        if (TIER_OF(b) == TIER_HBM && (uint32_t)(b->aux[0] >> 32) == slot) {
            uint64_t o = *s;
            *s = b->next;
            h->retired_count--;
            free_block(h, o);
        } else {
            s = &b->next;
        }
    }
    memset(&PROCS(h)[slot], 0, sizeof(proc_t));
}

int yr_proc_detach(void *base, int fd, uint32_t slot) {
    hdr_t *h = H(base);
    if (slot == 0 || slot >= h->nprocs) return YR_ESTATE;
    if (lock(h)) return YR_ELOCK;
    release_slot_locked(h, slot);
    ofd_lock(fd, slot, F_UNLCK);   /* after the slot is free: nobody reclaims it twice */
    unlock(h);
    return YR_OK;
}

int yr_proc_list(void *base, int fd, uint32_t self_slot, yr_procinfo *out, uint32_t max) {
    hdr_t *h = H(base);
    if (lock(h)) return YR_ELOCK;
    uint32_t n = 0;
    proc_t *p = PROCS(h);
    for (uint32_t i = 0; i < h->nprocs && n < max; i++) {
        out[n].pid = p[i].pid;
        out[n].state = p[i].state;
        out[n].starttime = p[i].starttime;
        out[n].is_owner = p[i].is_owner;
        out[n].pins = p[i].pins;
        out[n].alive = p[i].state && (i == self_slot || ofd_held(fd, i) != 0);
        n++;
    }
    unlock(h);
    return (int)n;
}

/* Reclaim the slots of dead processes: those whose lock byte nobody holds.
 * Returns how many were reclaimed. */
int yr_proc_sweep(void *base, int fd, uint32_t self_slot) {
    hdr_t *h = H(base);
    if (lock(h)) return YR_ELOCK;
    int n = 0;
    for (uint32_t i = 1; i < h->nprocs; i++) {
        if (PROCS(h)[i].state && i != self_slot && ofd_held(fd, i) == 0) {
            release_slot_locked(h, i);
            n++;
        }
    }
    unlock(h);
    return n;
}

int yr_proc_set_owner(void *base, uint32_t slot, uint32_t is_owner) {
    hdr_t *h = H(base);
    if (slot == 0 || slot >= h->nprocs) return YR_ESTATE;
    if (lock(h)) return YR_ELOCK;
    PROCS(h)[slot].is_owner = is_owner;
    unlock(h);
    return YR_OK;
}

int yr_pin_transfer(void *base, uint32_t pin, uint32_t from_slot, uint32_t to_slot) {
    hdr_t *h = H(base);
    if (to_slot == 0 || to_slot >= h->nprocs) return YR_ESTATE;
    if (lock(h)) return YR_ELOCK;
    int r = YR_ESTATE;
    if (pin != 0 && pin < total_pins(h)) {
        pin_t *pr = PIN(h, pin);
        if (pr->block_off && pr->slot == from_slot) {
            pr->slot = to_slot;
            if (PROCS(h)[from_slot].pins) PROCS(h)[from_slot].pins--;
            PROCS(h)[to_slot].pins++;
            r = YR_OK;
        }
    }
    unlock(h);
    return r;
}

/* ------------------------------------------------------------------ puts */

static uint64_t block_need(uint32_t klen, uint32_t mlen, uint64_t nbytes, uint32_t *prel) {
    uint64_t rel = align_up(BLK_HDR + (uint64_t)klen + mlen, ALIGN);
    *prel = (uint32_t)rel;
    uint64_t need = align_up(rel + nbytes, ALIGN);
    return need < MIN_BLOCK ? MIN_BLOCK : need;
}


static int64_t reserve_locked(hdr_t *h, uint32_t slot, const char *key, uint32_t klen,
                              const char *meta, uint32_t mlen, uint64_t alloc_bytes,
                              uint64_t nbytes, int64_t priority, double expire_at,
                              uint32_t tier, uint32_t owner, uint64_t gen) {
    uint32_t rel;
    if (alloc_bytes > h->heap_size) return YR_ETOOBIG;
    uint64_t need = block_need(klen, mlen, alloc_bytes, &rel);
    if (need > h->heap_size) return YR_ETOOBIG;
    uint64_t off = alloc_block(h, need);
    if (!off) return YR_ENOSPC;
    blk_t *b = AT(h, off);
    b->owner = slot;
    b->pins = 0;
    b->klen = klen;
    b->next = b->prev = 0;
    b->hash = hash_key(key, klen);
    b->seq = 0;
    b->nbytes = nbytes;
    b->mlen = mlen;
    b->payload_rel = rel;
    b->priority = priority;
    b->expire_at = expire_at;
    b->access_count = 0;
    b->last_access = now_realtime();
    b->aux[0] = ((uint64_t)owner << 32) | tier;
    b->aux[1] = gen;
    memcpy(KEY(b), key, klen);
    memcpy(KEY(b) + klen, meta, mlen);
    b->state = ST_RESERVED;
    h->reserved++;
    return (int64_t)off;
}

int64_t yr_reserve(void *base, uint32_t slot, const char *key, uint32_t klen,
                   const char *meta, uint32_t mlen, uint64_t nbytes,
                   int64_t priority, double expire_at, uint64_t *payload_off) {
    hdr_t *h = H(base);
    if (lock(h)) return YR_ELOCK;
    int64_t off = reserve_locked(h, slot, key, klen, meta, mlen, nbytes, nbytes, priority,
                                 expire_at, TIER_DRAM, 0, 0);
    unlock(h);
    if (off > 0) *payload_off = (uint64_t)off + AT(h, off)->payload_rel;
    return off;
}

int64_t yr_reserve_ex(void *base, uint32_t slot, const char *key, uint32_t klen,
                      const char *meta, uint32_t mlen, uint64_t alloc_bytes, uint64_t nbytes,
                      int64_t priority, double expire_at, uint32_t tier, uint32_t owner,
                      uint64_t gen, uint64_t access_count, uint64_t *payload_off) {
    hdr_t *h = H(base);
    if (lock(h)) return YR_ELOCK;
    int64_t off = reserve_locked(h, slot, key, klen, meta, mlen, alloc_bytes, nbytes, priority,
                                 expire_at, tier, owner, gen);
    if (off > 0) AT(h, off)->access_count = access_count;
    unlock(h);
    if (off > 0) *payload_off = (uint64_t)off + AT(h, off)->payload_rel;
    return off;
}

/* What a caller must know of an object it replaced or deleted: where its
 * bytes lived, so it can free a disk copy or a device tensor. */
static void describe_retired(blk_t *o, yr_retired *out) {
    out->existed = 1;
    out->tier = (uint32_t)o->aux[0];
    out->owner = (uint32_t)(o->aux[0] >> 32);
    out->gen = o->aux[1];
    out->seq = o->seq;
    out->nbytes = o->nbytes;
}

static int commit_locked(hdr_t *h, uint32_t slot, uint64_t off, uint64_t expected_seq,
                         yr_retired *out) {
    blk_t *b = AT(h, off);
    if (b->state != ST_RESERVED || b->owner != slot) return YR_ESTATE;
    uint64_t *old = find_slot(h, b->hash, KEY(b), b->klen);
    if (expected_seq != UINT64_MAX) {
        uint64_t cur = old ? AT(h, *old)->seq : 0;
        if (cur != expected_seq) return YR_ENOTFOUND;   /* someone got there first */
    }
    if (out) memset(out, 0, sizeof(*out));
    if (old) {
        if (out) describe_retired(AT(h, *old), out);
        retire_locked(h, old);
    }
    uint64_t *bucket = &BUCKETS(h)[b->hash & (h->nbuckets - 1)];
    b->seq = ++h->seq;
    if (out) out->new_seq = b->seq;
    b->next = *bucket;
    b->state = ST_LIVE;
    *bucket = off;   /* the object becomes visible here, atomically */
    h->reserved--;
    if (b->expire_at != 0.0) h->ttl_objects++;
    if (!INTERNAL(b)) {
        h->objects++;
        /* a conditional commit is a move between tiers, not a caller's put */
        if (expected_seq == UINT64_MAX) h->counters[C_PUTS]++;
    }
    return YR_OK;
}

int yr_commit_ex(void *base, uint32_t slot, uint64_t off, uint64_t expected_seq, yr_retired *out) {
    hdr_t *h = H(base);
    if (lock(h)) return YR_ELOCK;
    int r = commit_locked(h, slot, off, expected_seq, out);
    unlock(h);
    return r;
}

int yr_abort(void *base, uint32_t slot, uint64_t off) {
    hdr_t *h = H(base);
    if (lock(h)) return YR_ELOCK;
    int r = YR_ESTATE;
    blk_t *b = AT(h, off);
    if (b->state == ST_RESERVED && b->owner == slot) {
        h->reserved--;
        free_block(h, off);
        r = YR_OK;
    }
    unlock(h);
    return r;
}

int yr_put_small(void *base, uint32_t slot, const char *key, uint32_t klen,
                 const char *meta, uint32_t mlen, const char *data, uint64_t nbytes,
                 int64_t priority, double expire_at) {
    yr_retired ignored;
    return yr_put_small_ex(base, slot, key, klen, meta, mlen, data, nbytes, priority, expire_at,
                           &ignored);
}

int yr_put_small_ex(void *base, uint32_t slot, const char *key, uint32_t klen,
                    const char *meta, uint32_t mlen, const char *data, uint64_t nbytes,
                    int64_t priority, double expire_at, yr_retired *out) {
    hdr_t *h = H(base);
    if (lock(h)) return YR_ELOCK;
    int64_t off = reserve_locked(h, slot, key, klen, meta, mlen, nbytes, nbytes, priority,
                                 expire_at, TIER_DRAM, 0, 0);
    if (off > 0) {
        blk_t *b = AT(h, off);
        memcpy((char *)b + b->payload_rel, data, nbytes);
        commit_locked(h, slot, (uint64_t)off, UINT64_MAX, out);
        off = 0;
    }
    unlock(h);
    return (int)off;
}

/* ------------------------------------------------------------------ gets */

static int get_locked(hdr_t *h, uint32_t slot, const char *key, uint32_t klen, int pin,
                      double now, yr_objinfo *out) {
    uint64_t hash = hash_key(key, klen);
    uint64_t *s = find_slot(h, hash, key, klen);
    int internal = klen && key[0] == 0;
    if (!s) { if (!internal && !(pin & 2)) h->counters[C_MISSES]++; return YR_ENOTFOUND; }
    blk_t *b = AT(h, *s);
    if (expired(b, now)) {
        retire_locked(h, s);
        h->counters[C_MISSES]++;
        return YR_ENOTFOUND;
    }
    uint64_t off = *s;
    out->pin = 0;
    int quiet = pin & 2;    /* a look that is not a read: no access count, no hit */
    pin &= 1;
    if (pin) {
        int p = pin_locked(h, slot, off);
        if (p < 0) return p;
        out->pin = (uint32_t)p;
    }
    if (!quiet) {
        b->access_count++;
        b->last_access = now;
        if (!internal) h->counters[C_HITS]++;
    }
    out->block_off = off;
    out->payload_off = off + b->payload_rel;
    out->nbytes = b->nbytes;
    out->meta_off = off + BLK_HDR + b->klen;
    out->meta_len = b->mlen;
    out->priority = b->priority;
    out->expire_at = b->expire_at;
    out->access_count = b->access_count;
    out->seq = b->seq;
    out->tier = (uint32_t)b->aux[0];
    out->owner = (uint32_t)(b->aux[0] >> 32);
    out->gen = b->aux[1];
    return YR_OK;
}

int yr_get(void *base, uint32_t slot, const char *key, uint32_t klen, int pin, yr_objinfo *out) {
    hdr_t *h = H(base);
    double now = now_realtime();
    if (lock(h)) return YR_ELOCK;
    int r = get_locked(h, slot, key, klen, pin, now, out);
    unlock(h);
    return r;
}

int yr_mget(void *base, uint32_t slot, const char *keys, const uint32_t *klens,
            uint32_t n, int pin, yr_objinfo *out, int32_t *found) {
    hdr_t *h = H(base);
    double now = now_realtime();
    if (lock(h)) return YR_ELOCK;
    int hits = 0, err = 0;
    for (uint32_t i = 0; i < n; i++) {
        int r = get_locked(h, slot, keys, klens[i], pin, now, &out[i]);
        if (r == YR_ENOPINS) {  /* undo the pins taken so far */
            for (uint32_t j = 0; j < i; j++) if (found[j]) unpin_locked(h, out[j].pin);
            err = r;
            break;
        }
        found[i] = r == YR_OK;
        hits += found[i];
        keys += klens[i];
    }
    unlock(h);
    return err ? err : hits;
}

int yr_set_gen(void *base, const char *key, uint32_t klen, uint64_t seq, uint64_t gen) {
    hdr_t *h = H(base);
    uint64_t hash = hash_key(key, klen);
    if (lock(h)) return YR_ELOCK;
    uint64_t *s = find_slot(h, hash, key, klen);
    int r = YR_ENOTFOUND;
    if (s && AT(h, *s)->seq == seq) {
        AT(h, *s)->aux[1] = gen;
        r = YR_OK;
    }
    unlock(h);
    return r;
}

int yr_mput_small(void *base, uint32_t slot, const char *keys, const uint32_t *klens,
                  const char *metas, const uint32_t *mlens, const char **data,
                  const uint64_t *nbytes, uint32_t n, int64_t priority, double expire_at,
                  yr_retired *out) {
    hdr_t *h = H(base);
    if (lock(h)) return YR_ELOCK;
    uint32_t i = 0;
    for (; i < n; i++) {
        int64_t off = reserve_locked(h, slot, keys, klens[i], metas, mlens[i], nbytes[i], nbytes[i],
                                     priority, expire_at, TIER_DRAM, 0, 0);
        if (off <= 0) break;
        blk_t *b = AT(h, off);
        if (nbytes[i]) memcpy((char *)b + b->payload_rel, data[i], nbytes[i]);
        commit_locked(h, slot, (uint64_t)off, UINT64_MAX, &out[i]);
        keys += klens[i];
        metas += mlens[i];
    }
    unlock(h);
    return (int)i;
}

int yr_unpin(void *base, uint32_t pin) {
    hdr_t *h = H(base);
    if (lock(h)) return YR_ELOCK;
    if (pin == 0 || pin >= total_pins(h)) { unlock(h); return YR_ESTATE; }
    unpin_locked(h, pin);
    unlock(h);
    return YR_OK;
}

int yr_pin_block(void *base, uint32_t slot, uint64_t off) {
    hdr_t *h = H(base);
    if (lock(h)) return YR_ELOCK;
    int r = YR_ESTATE;
    uint32_t st = AT(h, off)->state;
    if (st == ST_LIVE || st == ST_ORPHAN) r = pin_locked(h, slot, off);
    unlock(h);
    return r;
}

int yr_delete(void *base, const char *key, uint32_t klen) {
    hdr_t *h = H(base);
    double now = now_realtime();
    uint64_t hash = hash_key(key, klen);
    if (lock(h)) return YR_ELOCK;
    uint64_t *s = find_slot(h, hash, key, klen);
    int r = YR_ENOTFOUND;
    if (s) {
        r = expired(AT(h, *s), now) ? YR_ENOTFOUND : YR_OK;
        retire_locked(h, s);
        if (r == YR_OK) h->counters[C_DELETES]++;
    }
    unlock(h);
    return r;
}

int yr_delete_ex(void *base, const char *key, uint32_t klen, uint64_t expected_seq,
                 yr_retired *out) {
    hdr_t *h = H(base);
    double now = now_realtime();
    uint64_t hash = hash_key(key, klen);
    memset(out, 0, sizeof(*out));
    if (lock(h)) return YR_ELOCK;
    uint64_t *s = find_slot(h, hash, key, klen);
    int r = YR_ENOTFOUND;
    if (s && (expected_seq == UINT64_MAX || AT(h, *s)->seq == expected_seq)) {
        blk_t *b = AT(h, *s);
        r = expired(b, now) ? YR_ENOTFOUND : YR_OK;
        describe_retired(b, out);
        retire_locked(h, s);
        if (r == YR_OK) h->counters[C_DELETES]++;
    }
    unlock(h);
    return r;
}

int yr_contains(void *base, const char *key, uint32_t klen) {
    hdr_t *h = H(base);
    double now = now_realtime();
    uint64_t hash = hash_key(key, klen);
    if (lock(h)) return YR_ELOCK;
    uint64_t *s = find_slot(h, hash, key, klen);
    int r = s && !expired(AT(h, *s), now);
    unlock(h);
    return r;
}

int64_t yr_keys(void *base, uint64_t *cursor, char *buf, uint64_t buflen,
                const char *prefix, uint32_t plen) {
    hdr_t *h = H(base);
    double now = now_realtime();
    if (lock(h)) return YR_ELOCK;
    int64_t n = 0;
    uint64_t pos = 0, i = *cursor;
    for (; i < h->nbuckets; i++) {
        /* A bucket is written whole or not at all, so a resumed scan never
         * repeats a key. */
        uint64_t need = 0, cnt = 0;
        for (uint64_t off = BUCKETS(h)[i]; off; off = AT(h, off)->next) {
            blk_t *b = AT(h, off);
            if (b->klen >= plen && memcmp(KEY(b), prefix, plen) == 0 && !expired(b, now) && !INTERNAL(b)) {
                need += 4 + b->klen;
                cnt++;
            }
        }
        if (!cnt) continue;
        if (pos + need > buflen) {
            if (n == 0) { unlock(h); return -(int64_t)need - 1000; }
            break;
        }
        for (uint64_t off = BUCKETS(h)[i]; off; off = AT(h, off)->next) {
            blk_t *b = AT(h, off);
            if (b->klen >= plen && memcmp(KEY(b), prefix, plen) == 0 && !expired(b, now) && !INTERNAL(b)) {
                memcpy(buf + pos, &b->klen, 4);
                memcpy(buf + pos + 4, KEY(b), b->klen);
                pos += 4 + b->klen;
                n++;
            }
        }
    }
    *cursor = i < h->nbuckets ? i : 0;
    unlock(h);
    return n;
}

int64_t yr_scan(void *base, uint64_t *cursor, yr_scanrec *recs, uint32_t maxrecs,
                char *keybuf, uint64_t keybuflen) {
    hdr_t *h = H(base);
    double now = now_realtime();
    if (lock(h)) return YR_ELOCK;
    uint32_t n = 0;
    uint64_t pos = 0, i = *cursor;
    for (; i < h->nbuckets; i++) {
        uint64_t cnt = 0, need = 0;
        for (uint64_t off = BUCKETS(h)[i]; off; off = AT(h, off)->next) {
            cnt++;
            need += AT(h, off)->klen;
        }
        if (!cnt) continue;
        if (n + cnt > maxrecs || pos + need > keybuflen) {
            if (n == 0) { unlock(h); return -(int64_t)(need + 1000); }
            break;
        }
        for (uint64_t off = BUCKETS(h)[i]; off; off = AT(h, off)->next) {
            blk_t *b = AT(h, off);
            if (expired(b, now) || INTERNAL(b)) continue;
            yr_scanrec *r = &recs[n++];
            r->seq = b->seq;
            r->nbytes = b->nbytes;
            r->block_size = b->size;
            r->priority = b->priority;
            r->access_count = b->access_count;
            r->last_access = b->last_access;
            r->expire_at = b->expire_at;
            r->tier = (uint32_t)b->aux[0];
            r->pins = b->pins;
            r->key_pos = (uint32_t)pos;
            r->klen = b->klen;
            r->gen = b->aux[1];
            r->owner = (uint32_t)(b->aux[0] >> 32);
            memcpy(keybuf + pos, KEY(b), b->klen);
            pos += b->klen;
        }
    }
    *cursor = i < h->nbuckets ? i : 0;
    unlock(h);
    return n;
}

/* Hand the retired stubs this process can free to the caller, and free
 * their blocks: SSD stubs (any process with the SSD tier: `tiers` bit 2) and
 * HBM stubs of this slot's device tensors (`tiers` bit 3).  Records as
 * yr_scan's; returns how many. */
int64_t yr_drain_retired(void *base, uint32_t slot, uint32_t tiers, yr_scanrec *recs,
                         uint32_t maxrecs, char *keybuf, uint64_t keybuflen) {
    hdr_t *h = H(base);
    if (lock(h)) return YR_ELOCK;
    uint32_t n = 0;
    uint64_t pos = 0;
    for (uint64_t *s = &h->retired_head; *s && n < maxrecs;) {
        blk_t *b = AT(h, *s);
        uint32_t tier = TIER_OF(b), owner = (uint32_t)(b->aux[0] >> 32);
        int mine = (tier < 32 && (tiers >> tier) & 1) && (tier != TIER_HBM || owner == slot);
        if (!mine) { s = &b->next; continue; }
        if (pos + b->klen > keybuflen) break;
        yr_scanrec *r = &recs[n++];
        memset(r, 0, sizeof(*r));
        r->seq = b->seq;
        r->nbytes = b->nbytes;
        r->block_size = b->size;
        r->priority = b->priority;
        r->tier = tier;
        r->owner = owner;
        r->gen = b->aux[1];
        r->key_pos = (uint32_t)pos;
        r->klen = b->klen;
        memcpy(keybuf + pos, KEY(b), b->klen);
        pos += b->klen;
        uint64_t off = *s;
        *s = b->next;
        h->retired_count--;
        free_block(h, off);
    }
    unlock(h);
    return n;
}

uint64_t yr_retired_pending(void *base) {
    return __atomic_load_n(&H(base)->retired_count, __ATOMIC_RELAXED);
}

/* ----------------------------------------------------------------- stats */

int yr_get_stats(void *base, yr_stats *out) {
    hdr_t *h = H(base);
    if (lock(h)) return YR_ELOCK;
    out->capacity = h->heap_size;
    out->used = h->used;
    out->objects = h->objects;
    out->orphans = h->orphans;
    out->reserved = h->reserved;
    out->pinned_bytes = h->pinned_bytes;
    out->free_bytes = h->heap_size - h->used;
    out->largest_free = 0;
    if (h->free_bitmap) {
        int c = 63 - __builtin_clzll(h->free_bitmap);
        for (uint64_t off = h->freehead[c]; off; off = AT(h, off)->next)
            if (AT(h, off)->size > out->largest_free) out->largest_free = AT(h, off)->size;
    }
    out->hits = h->counters[C_HITS];
    out->misses = h->counters[C_MISSES];
    out->puts = h->counters[C_PUTS];
    out->deletes = h->counters[C_DELETES];
    out->spills = h->counters[C_SPILLS];
    out->promotions = h->counters[C_PROMOTIONS];
    out->evictions = h->counters[C_EVICTIONS];
    out->recoveries = h->counters[C_RECOVERIES];
    out->procs = 0;
    for (uint32_t i = 1; i < h->nprocs; i++) out->procs += PROCS(h)[i].state != 0;
    unlock(h);
    return YR_OK;
}

void yr_count(void *base, int which, uint64_t n) {
    hdr_t *h = H(base);
    if (which < 0 || which >= C_NCOUNTERS) return;
    __atomic_fetch_add(&h->counters[which], n, __ATOMIC_RELAXED);
}

int yr_expire(void *base, double now) {
    hdr_t *h = H(base);
    if (lock(h)) return YR_ELOCK;
    int n = 0;
    if (!h->ttl_objects) { unlock(h); return 0; }   /* O(1) when nothing can expire */
    for (uint64_t i = 0; i < h->nbuckets; i++) {
        uint64_t *s = &BUCKETS(h)[i];
        while (*s) {
            if (expired(AT(h, *s), now)) { retire_locked(h, s); n++; }
            else s = &AT(h, *s)->next;
        }
    }
    unlock(h);
    return n;
}

/* -------------------------------------------------------------- recovery */

static void recover_locked(hdr_t *h) {
    uint64_t end = heap_end(h);
    /* 1. Pin counts from the pin table (the only source of truth). */
    for (uint64_t off = h->heap_off; off < end; off += AT(h, off)->size) AT(h, off)->pins = 0;
    for (uint32_t i = 0; i < h->nprocs; i++) PROCS(h)[i].pins = 0;
    h->pin_free = 0;
    for (uint32_t i = total_pins(h) - 1; i >= 1; i--) {
        pin_t *pr = PIN(h, i);
        if (pr->block_off) {
            blk_t *b = AT(h, pr->block_off);
            if (b->state == ST_LIVE || b->state == ST_ORPHAN) {
                b->pins++;
                PROCS(h)[pr->slot].pins++;
                continue;
            }
            pr->block_off = 0;
        }
        pr->next_free = h->pin_free;
        h->pin_free = i;
    }
    /* 2. The index from live blocks; of two live copies of a key (death
     *    between retiring the old object and publishing the new one), the
     *    newer sequence number wins. */
    memset(BUCKETS(h), 0, h->nbuckets * 8);
    h->objects = h->orphans = h->reserved = h->pinned_bytes = h->used = h->ttl_objects = 0;
    for (uint64_t off = h->heap_off; off < end; off += AT(h, off)->size) {
        blk_t *b = AT(h, off);
        if (b->state != ST_LIVE) continue;
        uint64_t *s = find_slot(h, b->hash, KEY(b), b->klen);
        if (s) {
            blk_t *o = AT(h, *s);
            if (o->seq > b->seq) { b->state = ST_ORPHAN; continue; }
            *s = o->next;
            o->state = ST_ORPHAN;
            if (!INTERNAL(o)) h->objects--;
            if (o->expire_at != 0.0) h->ttl_objects--;
        }
        uint64_t *bucket = &BUCKETS(h)[b->hash & (h->nbuckets - 1)];
        b->next = *bucket;
        *bucket = off;
        if (!INTERNAL(b)) h->objects++;
        if (b->expire_at != 0.0) h->ttl_objects++;
        if (b->seq > h->seq) h->seq = b->seq;
    }
    /* 3. Free lists, the retire list and accounting, merging free runs. */
    memset(h->freehead, 0, sizeof(h->freehead));
    h->free_bitmap = 0;
    h->retired_head = h->retired_count = 0;
    uint64_t prev = 0, prev_size = 0;
    for (uint64_t off = h->heap_off; off < end;) {
        blk_t *b = AT(h, off);
        if (b->state == ST_ORPHAN && b->pins == 0)
            b->state = TIER_OF(b) != TIER_DRAM && !INTERNAL(b) ? ST_RETIRED : ST_FREE;
        if (b->state == ST_PINPAGE) {
            int registered = 0;
            for (uint32_t i = 0; i < h->npages; i++) registered |= h->pin_pages[i] == off;
            if (!registered) b->state = ST_FREE;
        }
        if (b->state == ST_RETIRED) {
            b->next = h->retired_head;
            h->retired_head = off;
            h->retired_count++;
        }
        if (b->state == ST_FREE && prev && AT(h, prev)->state == ST_FREE) {
            AT(h, prev)->size += b->size;
            off = prev + AT(h, prev)->size;
            prev_size = AT(h, prev)->size;
            continue;
        }
        if (prev && AT(h, prev)->state == ST_FREE) fl_insert(h, prev);
        b->prev_size = prev_size;
        if (b->state != ST_FREE) {
            h->used += b->size;
            if (b->state == ST_ORPHAN) h->orphans++;
            if (b->state == ST_RESERVED) h->reserved++;
            if (b->pins) h->pinned_bytes += b->size;
        }
        prev = off;
        prev_size = b->size;
        off += b->size;
    }
    if (prev && AT(h, prev)->state == ST_FREE) fl_insert(h, prev);
}

int yr_check_invariants(void *base, char *msg, uint32_t msglen) {
    hdr_t *h = H(base);
    if (lock(h)) return YR_ELOCK;
    uint64_t end = heap_end(h), used = 0, objects = 0, orphans = 0, prev_size = 0, nfree = 0, retired = 0;
    int prev_free = 0, bad = 0;
    for (uint64_t off = h->heap_off; off < end && !bad; off += AT(h, off)->size) {
        blk_t *b = AT(h, off);
        if (b->size < MIN_BLOCK || (b->size & (ALIGN - 1)) || off + b->size > end) {
            snprintf(msg, msglen, "bad block size %llu at %llu", (unsigned long long)b->size,
                     (unsigned long long)off);
            bad = 1; break;
        }
        if (b->prev_size != prev_size) {
            snprintf(msg, msglen, "prev_size %llu != %llu at %llu", (unsigned long long)b->prev_size,
                     (unsigned long long)prev_size, (unsigned long long)off);
            bad = 1; break;
        }
        if (b->state == ST_FREE) {
            if (prev_free) { snprintf(msg, msglen, "adjacent free blocks at %llu", (unsigned long long)off); bad = 1; break; }
            nfree++;
        } else {
            used += b->size;
        }
        if (b->state == ST_LIVE) {
            uint64_t *s = find_slot(h, b->hash, KEY(b), b->klen);
            if (!s || *s != off) { snprintf(msg, msglen, "live block %llu not indexed", (unsigned long long)off); bad = 1; break; }
            if (!INTERNAL(b)) objects++;
        }
        if (b->state == ST_RETIRED) retired++;
        if (b->state == ST_ORPHAN) {
            orphans++;
            if (!b->pins) { snprintf(msg, msglen, "unpinned orphan at %llu", (unsigned long long)off); bad = 1; break; }
        }
        prev_free = b->state == ST_FREE;
        prev_size = b->size;
    }
    if (!bad) {
        uint64_t listed = 0;
        for (int c = 0; c < NCLASSES; c++)
            for (uint64_t off = h->freehead[c]; off; off = AT(h, off)->next) listed++;
        if (listed != nfree) { snprintf(msg, msglen, "free lists hold %llu blocks, heap %llu", (unsigned long long)listed, (unsigned long long)nfree); bad = 1; }
        else if (used != h->used) { snprintf(msg, msglen, "used %llu != counted %llu", (unsigned long long)h->used, (unsigned long long)used); bad = 1; }
        else if (objects != h->objects) { snprintf(msg, msglen, "objects %llu != counted %llu", (unsigned long long)h->objects, (unsigned long long)objects); bad = 1; }
        else if (orphans != h->orphans) { snprintf(msg, msglen, "orphans %llu != counted %llu", (unsigned long long)h->orphans, (unsigned long long)orphans); bad = 1; }
        else if (retired != h->retired_count) { snprintf(msg, msglen, "retired %llu != counted %llu", (unsigned long long)h->retired_count, (unsigned long long)retired); bad = 1; }
        else {
            uint64_t linked = 0;
            for (uint64_t off = h->retired_head; off && linked <= retired; off = AT(h, off)->next) {
                if (AT(h, off)->state != ST_RETIRED) { snprintf(msg, msglen, "retire list holds a block in state %u", AT(h, off)->state); bad = 1; break; }
                linked++;
            }
            if (!bad && linked != retired) { snprintf(msg, msglen, "retire list links %llu blocks, heap %llu", (unsigned long long)linked, (unsigned long long)retired); bad = 1; }
        }
    }
    unlock(h);
    return bad ? YR_ESTATE : YR_OK;
}

/* --------------------------------------------------------------- notify */

uint32_t *yr_notify_word(void *base, uint32_t index) {
    return index < NNOTIFY ? &H(base)->notify[index] : NULL;
}

char *yr_config_area(void *base, uint32_t *len) {
    *len = sizeof(H(base)->config);
    return H(base)->config;
}

uint64_t *yr_user_word(void *base, uint32_t index) {
    return index < NUSER ? &H(base)->user[index] : NULL;
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

/* ---------------------------------------------------------------- memory */

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

/* Test hook: take the lock and return without releasing it, so a test can
 * kill the process while it "holds" the lock.  With scramble set, also wipe
 * the derived structures (index heads, free lists, counts) as a death in the
 * middle of an update might, so recovery has to rebuild them all. */
int yr_debug_hold_lock(void *base, int scramble) {
    hdr_t *h = H(base);
    if (lock(h)) return YR_ELOCK;
    if (scramble) {
        memset(BUCKETS(h), 0, h->nbuckets * 8);
        memset(h->freehead, 0, sizeof(h->freehead));
        h->free_bitmap = 0;
        h->used = h->objects = h->pinned_bytes = 0;
    }
    return YR_OK;
}
