/* The yrcache DRAM arena: key index, allocator, pins and a robust lock, all
 * inside one shared-memory mapping so every attached process sees one truth.
 * Offsets, never pointers, are stored in the arena (each process maps it at
 * its own address).  This header is also fed to cffi's cdef (the build strips
 * comment lines), so it holds only declarations cffi can parse; yrcache's
 * Python side calls it from one module, yrcache/tiers/dram.py. */

/* tiers: the numbering of yrcache.Tier */
#define YR_TIER_HBM   0
#define YR_TIER_DRAM  1
#define YR_TIER_SSD   2
/* flags of an object (yr_objinfo.flags): a reader waits for the holder of an
 * HBM object to move it to DRAM */
#define YR_FLAG_WANTED 1

/* yr_get: take a pin (the caller reads the payload after the
 * call); a quiet look is no read (no access count, no hit or miss) */
#define YR_PIN    1
#define YR_QUIET  2

/* counters (yr_count, yr_stats) */
#define YR_C_HITS       0
#define YR_C_MISSES     1
#define YR_C_PUTS       2
#define YR_C_DELETES    3
#define YR_C_SPILLS     4
#define YR_C_PROMOTIONS 5
#define YR_C_EVICTIONS  6
#define YR_C_RECOVERIES 7

#define YR_CONFIG_BYTES 4096

/* error codes (negative) */
#define YR_OK          0
#define YR_ENOTFOUND  -1
#define YR_ENOSPC     -2
#define YR_EBADARENA  -3
#define YR_ENOPINS    -4
#define YR_ENOPROCS   -5
#define YR_ELOCK      -6
#define YR_ESTATE     -7
#define YR_ETOOBIG    -8
#define YR_EBUFFER    -9
#define YR_ECHANGED  -10
/* YR_EDAMAGED: the arena's lists contradict its blocks (a cycle, a free list
 * holding a block in use); from then on every call returns it */
#define YR_EDAMAGED  -11

/* Where an object's bytes go and what the index records of it: alloc_bytes
 * of payload are allocated here (nbytes for a DRAM object, 0 for a stub of an
 * object held by another tier). */
typedef struct {
    uint64_t alloc_bytes;
    uint64_t nbytes;        /* the object's payload size, wherever it lives */
    int64_t  priority;
    double   expire_at;     /* unix time; 0: never */
    uint64_t access_count;  /* carried over by moves between tiers */
    uint64_t gen;           /* generation of the bytes in a lower tier */
    uint32_t tier;          /* YR_TIER_* */
    uint32_t holder;        /* HBM: the process slot that holds the tensor */
} yr_desc;

typedef struct {
    uint64_t payload_off;   /* offset of the payload from the arena base */
    uint64_t nbytes;        /* payload length */
    uint64_t block_off;     /* offset of the object's block */
    uint64_t meta_off;      /* offset of the codec header */
    uint32_t meta_len;
    uint32_t pin;           /* pin record, 0 if the call did not pin */
    int64_t  priority;
    double   expire_at;     /* 0: never */
    uint64_t access_count;
    uint64_t seq;
    uint64_t gen;
    uint32_t tier;          /* YR_TIER_*: DRAM holds the payload here; else a stub */
    uint32_t holder;
    uint32_t flags;
    uint32_t pad;
} yr_objinfo;

/* what a commit replaced or a delete removed (existed = 0: nothing) */
typedef struct {
    uint32_t existed;
    uint32_t tier;
    uint64_t gen;
    uint64_t seq;
    uint64_t nbytes;
    uint32_t holder;
    uint32_t pad;
    uint64_t new_seq;       /* sequence number of the object just committed */
} yr_retired;

typedef struct {
    uint64_t seq;
    uint64_t nbytes;
    uint64_t block_size;
    int64_t  priority;
    uint64_t access_count;
    double   last_access;
    double   expire_at;
    uint64_t gen;
    uint32_t tier;
    uint32_t pins;
    uint32_t key_pos;       /* offset of the key in the caller's key buffer */
    uint32_t klen;
    uint32_t holder;
    uint32_t flags;
} yr_scanrec;

typedef struct {
    uint64_t capacity;      /* heap bytes */
    uint64_t used;          /* bytes in allocated blocks (headers included) */
    uint64_t objects;       /* live (visible) objects */
    uint64_t orphans;       /* replaced/deleted objects still pinned by a view */
    uint64_t reserved;      /* puts in flight */
    uint64_t pinned_bytes;  /* bytes of blocks with at least one pin */
    uint64_t free_bytes;
    uint64_t largest_free;
    uint64_t retired;       /* lower-tier stubs waiting for their bytes to be freed */
    uint64_t hits, misses, puts, deletes, spills, promotions, evictions, recoveries;
    uint64_t procs;         /* attached process slots in use */
} yr_stats;

typedef struct {
    uint32_t pid;
    uint32_t state;         /* 0 free, 1 attached */
    uint64_t starttime;     /* /proc/<pid>/stat field 22 (for display) */
    uint32_t is_owner;
    uint32_t pins;
    uint32_t alive;         /* its process holds the slot's lock byte */
    uint32_t pad;
} yr_procinfo;

/* A named word: a 64-bit value and a 32-bit wake-up counter (a futex), in
 * the arena for the life of the store. */
typedef struct {
    uint32_t seq;           /* bumped by every wake */
    uint32_t pad;
    uint64_t value;
} yr_word;

/* layout */
uint64_t yr_arena_min_size(void);
int  yr_arena_init(void *base, uint64_t size, uint32_t nprocs, uint32_t npins);
int  yr_arena_check(void *base, uint64_t size);
char *yr_config_area(void *base);

/* process slots: `fd` is the caller's own open file description of the
 * segment; a slot lives while its process holds a lock on byte `slot` */
int  yr_proc_attach(void *base, int fd, uint32_t pid, uint64_t starttime, uint32_t is_owner);
int  yr_proc_detach(void *base, int fd, uint32_t slot);
int  yr_proc_list(void *base, int fd, uint32_t self_slot, yr_procinfo *out, uint32_t max);
int  yr_proc_sweep(void *base, int fd, uint32_t self_slot);
int  yr_proc_set_owner(void *base, uint32_t slot, uint32_t is_owner);

/* pins: a pin keeps a block's bytes in place while a view reads them */
int  yr_pin_block(void *base, uint32_t slot, uint64_t block_off);
int  yr_pin_transfer(void *base, uint32_t pin, uint32_t from_slot, uint32_t to_slot);
int  yr_unpin(void *base, uint32_t pin);

/* put: reserve a block (its payload at *payload_off), fill it without the
 * lock, then commit it (replacing any old object of its key atomically), or
 * abort it.  A commit may be conditional on the sequence number of the object
 * it replaces (0: the key must be absent; UINT64_MAX: unconditional);
 * YR_ECHANGED when it is not. */
int64_t yr_reserve(void *base, uint32_t slot, const char *key, uint32_t klen, const char *meta,
                   uint32_t mlen, const yr_desc *d, uint64_t *payload_off);
int  yr_commit(void *base, uint32_t slot, uint64_t block_off, uint64_t expected_seq, yr_retired *out);
int  yr_abort(void *base, uint32_t slot, uint64_t block_off);
/* 1 if an object of these key, codec header and payload sizes could ever be
 * stored (its smallest block fits the empty heap), else 0 */
int  yr_fits(void *base, uint32_t klen, uint32_t mlen, uint64_t nbytes);
/* a DRAM value in one call: reserve, copy (outside the lock, but for small
 * values, which are copied in the same lock hold), commit */
int  yr_put(void *base, uint32_t slot, const char *key, uint32_t klen, const char *meta,
            uint32_t mlen, const char *data, uint64_t nbytes, int64_t priority, double expire_at,
            int populate, yr_retired *out);
/* a batch of them (keys and metas packed back to back); returns how many were
 * stored (stops at the first that does not fit); *lower: how many of those
 * replaced an object held in a lower tier (whose bytes are to be freed) */
int  yr_mput_small(void *base, uint32_t slot, const char *keys, const uint32_t *klens,
                   const char *metas, const uint32_t *mlens, const char **data,
                   const uint64_t *nbytes, uint32_t n, int64_t priority, double expire_at,
                   yr_retired *out, uint32_t *lower);

/* lookups (flags: YR_PIN, YR_QUIET) */
int  yr_get(void *base, uint32_t slot, const char *key, uint32_t klen, int flags, yr_objinfo *out);
/* a read: like yr_get with YR_PIN, except that a DRAM object whose codec
 * header and payload fit in `cap` bytes is copied into buf (header first)
 * instead of pinned -- for a small value, cheaper than a pin and its release.
 * Returns 1 when it copied, 0 when it pinned; with dram_only (the hot path of
 * a get, _fast.c), YR_EBUFFER for an object in another tier, left alone and
 * not counted (read it again without dram_only). */
int  yr_read(void *base, uint32_t slot, const char *key, uint32_t klen, yr_objinfo *out, char *buf,
             uint32_t cap, int dram_only);
/* a batch of reads under one lock hold (keys packed back to back, lengths in
 * klens): found[i] is 0 (missing), 1 (pinned, as yr_read) or 2 (a DRAM object whose header and payload fit in `small`
 * bytes, copied into buf while room remains: its header at out[i].meta_off,
 * its payload at out[i].payload_off, 64-byte aligned, both offsets into buf);
 * returns how many bytes of buf it used, or an error; with dram_only, YR_EBUFFER
 * (nothing counted or pinned) when one of the objects is in another tier */
int  yr_mread(void *base, uint32_t slot, const char *keys, const uint32_t *klens, uint32_t n,
              yr_objinfo *out, int32_t *found, char *buf, uint64_t cap, uint64_t small, int dram_only);
/* a quiet look that copies the codec header out (no pin needed) */
int  yr_peek(void *base, const char *key, uint32_t klen, yr_objinfo *out, char *meta,
             uint32_t metacap);
int  yr_contains(void *base, const char *key, uint32_t klen);
int  yr_delete(void *base, const char *key, uint32_t klen, uint64_t expected_seq, yr_retired *out);
/* set or clear flags of `key` if it is still the object `seq` */
int  yr_set_flags(void *base, const char *key, uint32_t klen, uint64_t seq, uint32_t set,
                  uint32_t clear);

/* the retire channel: stubs that left the index, whose bytes a process of
 * the right tier must free: SSD stubs (tiers bit YR_TIER_SSD) and HBM stubs
 * this slot holds (bit YR_TIER_HBM).  Records as yr_scan's; the stubs stay
 * listed until yr_release_retired, after their bytes are freed. */
int64_t yr_drain_retired(void *base, uint32_t slot, uint32_t tiers, yr_scanrec *recs,
                         uint32_t maxrecs, char *keybuf, uint64_t keybuflen);
/* free the stubs of the retired objects with these generations, once their
 * bytes are gone: a process that dies in between leaves them listed, and the
 * next drain frees their bytes again (freeing is idempotent); how many */
int64_t yr_release_retired(void *base, const uint64_t *gens, uint32_t n);
uint64_t yr_retired_pending(void *base);

/* keys starting with prefix, in byte order, from the sorted index: up to
 * maxkeys [u32 len][bytes] records after the key `after` (from the first
 * match when alen is 0); *more is 1 when the batch stopped at a limit.  Costs
 * a logarithmic search plus the matches.  YR_EBUFFER (*more: the room
 * needed) when a single key does not fit buflen. */
int64_t yr_keys(void *base, const char *prefix, uint32_t plen, const char *after, uint32_t alen,
                char *buf, uint64_t buflen, uint32_t maxkeys, uint64_t *more);
/* iteration of objects for the placement policy, a bucket batch per call:
 * records of objects whose tier is in the `tiers` bit mask, from bucket
 * *cursor on (advanced; 0 at the end), at most 16384 buckets per call (a batch
 * may hold no record while the cursor is not 0).  YR_EBUFFER with *need set when one
 * bucket alone needs more room than given. */
int64_t yr_scan(void *base, uint64_t *cursor, uint32_t tiers, yr_scanrec *recs, uint32_t maxrecs,
                char *keybuf, uint64_t keybuflen, uint64_t *need);

int  yr_get_stats(void *base, yr_stats *out);
/* bytes in allocated blocks, read without the lock (for watermark checks) */
uint64_t yr_used(void *base);
void yr_count(void *base, int which, uint64_t n);
int  yr_expire(void *base, double now);
int  yr_check_invariants(void *base, char *msg, uint32_t msglen);

/* named words: the offset of `name`'s word, created on first use */
int64_t yr_word_at(void *base, const char *name, uint32_t nlen);
int  yr_word_cas(yr_word *w, uint64_t expected, uint64_t desired);
int  yr_futex_wait(uint32_t *addr, uint32_t expected, double timeout);
int  yr_futex_wake(uint32_t *addr);

/* the mapping: map a shm fd MAP_SHARED (and populate it), copies */
void *yr_map(int fd, uint64_t size, int populate);
int  yr_unmap(void *addr, uint64_t size);
int  yr_populate_write(void *addr, uint64_t size);
/* map the (existing) pages of a range now, for reading or writing (one
 * madvise), rather than one fault per 4 KiB page as a copy touches them */
int  yr_populate(void *addr, uint64_t n, int write);
/* ask for transparent huge pages on the mapping (MADV_HUGEPAGE): the kernel
 * gives them where the tmpfs holding the segment is mounted with huge=advise
 * (or within_size, always); 0, or -errno */
int  yr_advise_huge(void *addr, uint64_t size);
/* copy n bytes; a large copy streamed past the caches or by memcpy, whichever this
 * process measured faster on its first large copies */
void yr_memcpy(void *dst, const void *src, uint64_t n);
