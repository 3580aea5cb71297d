/* Internals of the yrcache DRAM arena, shared by the files of the C core
 * (not part of the cffi interface: that is arena.h).
 *
 * Layout of the mapping (all offsets from its base):
 *   [hdr_t][buckets: u64 x nbuckets][procs: proc_t x nprocs][pins: pin_t x npins][heap]
 * The heap is a sequence of blocks, each starting with a 128-byte blk_t; a
 * block's size is a multiple of 64 so payloads are 64-byte aligned.
 *
 * Crash safety: the heap stays walkable at every instant (a split writes the
 * new remainder header before it shrinks the block; a merge only grows a free
 * block), so a survivor that inherits the robust mutex with EOWNERDEAD can
 * rebuild every derived structure (free lists, hash chains, pin counts,
 * retire list, accounting) from the blocks alone: see recovery.c.
 *
 * Files: arena.c (layout, init, checks, settings, named words), heap.c
 * (allocator), index.c (hash index, retirement), procs.c (process slots and
 * pins), objects.c (put/get/delete), iter.c (keys, scans, stats, expiry),
 * recovery.c (locking, recovery, invariants), os.c (mmap, futex, file locks). */
#ifndef YR_INTERNAL_H
#define YR_INTERNAL_H

#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <stdio.h>
#include <time.h>

#include "arena.h"

#define HIDDEN __attribute__((visibility("hidden")))

#define MAGIC       0x3145484341435259ULL /* "YRCACHE1" little endian */
#define LAYOUT      5
#define ALIGN       64
#define BLK_HDR     128
#define MIN_BLOCK   128
#define NCLASSES    58
#define SCAN_LIMIT  64
#define SMALL_BLOCK 4096
#define PIN_PAGE    4096u   /* pin records per page grown from the heap */
#define MAX_PIN_PAGES 1024
#define MAX_PROCS   (1u << 16)
#define MAX_STATIC_PINS (1u << 24)
#define C_NCOUNTERS 16
#define SL_MAX      20      /* levels of the sorted index (skip list, p = 1/4) */

/* RETIRED: a stub taken out of the index whose bytes live in a lower tier;
 * it waits on the retire list until a process frees those bytes (the disk
 * copy, the device tensor).  PINPAGE: a page of pin records. */
enum { ST_FREE = 0x0F, ST_RESERVED = 0x1E, ST_LIVE = 0x2D, ST_ORPHAN = 0x3C,
       ST_RETIRED = 0x4B, ST_PINPAGE = 0x5A };

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
    uint64_t where;       /* tier (bits 0-7), flags (8-15), holder's slot (32-63) */
    uint64_t gen;         /* generation of the bytes in a lower tier */
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
    uint64_t sl_head[SL_MAX];  /* the sorted index (sorted.c) */
    uint32_t sl_levels;
    uint32_t pad1;
    uint64_t sl_rng;
    uint64_t sl_finger[SL_MAX]; /* the search path to the last key inserted (sorted.c) */
    uint32_t sl_finger_ok;      /* none of its nodes has left the list since */
    uint32_t damaged;     /* a walk met links that contradict the blocks: every call fails (YR_EDAMAGED) */
    char     config[YR_CONFIG_BYTES];  /* the creator's settings (JSON), read by attachers */
    char     lockpad[0] __attribute__((aligned(64)));
    pthread_mutex_t lock;
} hdr_t;

_Static_assert(sizeof(blk_t) == BLK_HDR, "block header must be 128 bytes");

#define H(base)        ((hdr_t *)(base))
#define AT(base, off)  ((blk_t *)((char *)(base) + (off)))
#define BUCKETS(h)     ((uint64_t *)((char *)(h) + (h)->buckets_off))
#define PROCS(h)       ((proc_t *)((char *)(h) + (h)->procs_off))
#define PINS(h)        ((pin_t *)((char *)(h) + (h)->pins_off))
#define KEY(b)         ((char *)(b) + BLK_HDR)
#define TIER_OF(b)     ((uint32_t)((b)->where & 0xff))
#define FLAGS_OF(b)    ((uint32_t)(((b)->where >> 8) & 0xff))
#define HOLDER_OF(b)   ((uint32_t)((b)->where >> 32))
#define WHERE(tier, flags, holder) ((uint64_t)(tier) | (uint64_t)(flags) << 8 | (uint64_t)(holder) << 32)
/* Keys starting with NUL are the store's own (named words): no public key
 * can collide with them, and they stay out of counts, scans and key lists. */
#define INTERNAL(b)    ((b)->klen && KEY(b)[0] == 0)
/* a stub whose bytes live in another tier */
#define STUB(b)        (TIER_OF(b) != YR_TIER_DRAM && !INTERNAL(b))
/* the sorted index's links of a live block: after its key and codec header */
#define SL_LEVEL(b)    ((uint32_t)(b)->prev)
#define FWD(b)         ((uint64_t *)((char *)(b) + BLK_HDR + align_up((uint64_t)(b)->klen + (b)->mlen, 8)))

static inline uint64_t align_up(uint64_t n, uint64_t a) { return (n + a - 1) & ~(a - 1); }
static inline uint64_t heap_end(hdr_t *h) { return h->heap_off + h->heap_size; }
/* An offset read from a record another process wrote (a pin): a block could start there. */
static inline int block_at_ok(hdr_t *h, uint64_t off) {
    return off >= h->heap_off && off < heap_end(h) && heap_end(h) - off >= MIN_BLOCK && !(off & (ALIGN - 1));
}
/* The size of the block at `off` keeps a walk over the heap going and inside it. */
static inline int size_ok(hdr_t *h, uint64_t off) {
    return AT(h, off)->size >= MIN_BLOCK && AT(h, off)->size <= heap_end(h) - off;
}

static inline double now_realtime(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* 64-bit FNV-1a followed by a murmur finaliser to spread the low bits. */
static inline uint64_t hash_key(const char *k, uint32_t n) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (uint32_t i = 0; i < n; i++) { h ^= (unsigned char)k[i]; h *= 0x100000001b3ULL; }
    h ^= h >> 33; h *= 0xff51afd7ed558ccdULL; h ^= h >> 33;
    return h;
}

/* No list of blocks (a free list, a hash chain, the sorted index) can be
 * longer than the heap has room for blocks: a walk that takes more steps is
 * going round a cycle of a damaged arena, and gives up (set_damaged). */
static inline uint64_t max_blocks(hdr_t *h) { return h->heap_size / MIN_BLOCK; }

/* Links that contradict the blocks (a segment written behind yrcache's back,
 * e.g. an old copy of its header put back): nothing in the arena can be
 * trusted any more, so every later call fails with YR_EDAMAGED (lock()). */
static inline void set_damaged(hdr_t *h) { h->damaged = 1; }

/* One more link of a list walk (a hash chain): `off` could start a block and the walk has
 * steps left (`*steps` from max_blocks); else the arena is damaged and the walk stops. */
static inline int link_ok(hdr_t *h, uint64_t off, uint64_t *steps) {
    if ((*steps)-- && block_at_ok(h, off)) return 1;
    set_damaged(h);
    return 0;
}

/* Byte order of a block's key against k (the sorted index's order). */
static inline int cmp_key(blk_t *b, const char *k, uint32_t n) {
    uint32_t m = b->klen < n ? b->klen : n;
    int c = memcmp(KEY(b), k, m);
    return c ? c : (b->klen > n) - (b->klen < n);
}

static inline int expired(blk_t *b, double now) {
    return b->expire_at != 0.0 && now >= b->expire_at;
}

/* pins: records 1..npins-1 in the table laid out at init, more in pages
 * grown from the heap */
static inline uint32_t total_pins(hdr_t *h) { return h->npins + h->npages * PIN_PAGE; }

static inline pin_t *PIN(hdr_t *h, uint32_t p) {
    if (p < h->npins) return &PINS(h)[p];
    uint32_t q = p - h->npins;
    return (pin_t *)((char *)h + h->pin_pages[q / PIN_PAGE] + BLK_HDR) + q % PIN_PAGE;
}

/* recovery.c: lock() returns YR_ELOCK or YR_EDAMAGED, which LOCK passes on */
#define LOCK(h) do { int lock_rc_ = lock(h); if (lock_rc_) return lock_rc_; } while (0)
HIDDEN int  lock(hdr_t *h);
HIDDEN void unlock(hdr_t *h);
HIDDEN void recover_locked(hdr_t *h);
/* arena.c */
HIDDEN void layout_regions(hdr_t *h);
/* heap.c */
HIDDEN void fl_insert(hdr_t *h, uint64_t off);
HIDDEN uint64_t alloc_block(hdr_t *h, uint64_t need);
HIDDEN void free_block(hdr_t *h, uint64_t off);
/* index.c */
HIDDEN uint64_t *find_slot(hdr_t *h, uint64_t hash, const char *k, uint32_t n);
HIDDEN void link_live(hdr_t *h, uint64_t off);
HIDDEN void retire_locked(hdr_t *h, uint64_t *slot);
HIDDEN void dispose_locked(hdr_t *h, uint64_t off);
HIDDEN void push_retired(hdr_t *h, uint64_t off);
/* sorted.c */
HIDDEN uint32_t sl_random_level(hdr_t *h);
HIDDEN void sl_insert(hdr_t *h, uint64_t off);
HIDDEN void sl_remove(hdr_t *h, uint64_t off);
HIDDEN uint64_t sl_seek(hdr_t *h, const char *key, uint32_t n, int after);
HIDDEN void sl_reset(hdr_t *h);
HIDDEN int64_t sl_check(hdr_t *h, char *msg, uint32_t msglen);
/* procs.c */
HIDDEN int  pin_locked(hdr_t *h, uint32_t slot, uint64_t off);
HIDDEN void unpin_locked(hdr_t *h, uint32_t pin);
/* objects.c */
HIDDEN int64_t reserve_locked(hdr_t *h, uint32_t slot, const char *key, uint32_t klen,
                              const char *meta, uint32_t mlen, const yr_desc *d);
HIDDEN int  commit_locked(hdr_t *h, uint32_t slot, uint64_t off, uint64_t expected_seq, yr_retired *out);
/* os.c */
HIDDEN int  ofd_lock(int fd, uint64_t byte, short type);
HIDDEN int  ofd_held(int fd, uint64_t byte);

#endif
