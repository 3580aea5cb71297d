/* The yrcache DRAM arena: key index, allocator, pins and a robust lock, all
 * inside one shared-memory mapping so every attached process sees one truth.
 * Offsets, never pointers, are stored in the arena (each process maps it at
 * its own address).  This header is also fed to cffi's cdef, so it holds only
 * declarations cffi can parse. */

typedef struct {
    uint64_t payload_off;   /* offset of the payload from the arena base */
    uint64_t nbytes;        /* payload length */
    uint64_t block_off;     /* offset of the object's block */
    uint64_t meta_off;      /* offset of the codec header */
    uint32_t meta_len;
    uint32_t pin;           /* pin record index, 0 if the call did not pin */
    int64_t  priority;
    double   expire_at;     /* 0: never */
    uint64_t access_count;
    uint64_t seq;
    uint32_t tier;          /* 1: payload here (DRAM); 0/2: a stub for HBM/SSD */
    uint32_t owner;         /* HBM stubs: the process slot holding the tensor */
    uint64_t gen;           /* SSD stubs: generation of the disk copy */
} yr_objinfo;

typedef struct {
    uint32_t existed;       /* 1 if a live object was replaced */
    uint32_t tier;
    uint64_t gen;
    uint64_t seq;
    uint64_t nbytes;
    uint32_t owner;
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
    uint32_t tier;
    uint32_t pins;
    uint32_t key_pos;       /* offset of the key in the caller's key buffer */
    uint32_t klen;
    uint64_t gen;
    uint32_t owner;
    uint32_t pad;
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

uint64_t yr_arena_min_size(void);
int  yr_arena_init(void *base, uint64_t size, uint32_t nprocs, uint32_t npins);
int  yr_arena_check(void *base, uint64_t size);
uint64_t yr_arena_size(void *base);

/* process slots: `fd` is the caller's own open file description of the
 * segment; a slot lives while its process holds a lock on byte `slot` */
int  yr_proc_attach(void *base, int fd, uint32_t pid, uint64_t starttime, uint32_t is_owner);
int  yr_proc_detach(void *base, int fd, uint32_t slot);
int  yr_proc_list(void *base, int fd, uint32_t self_slot, yr_procinfo *out, uint32_t max);
int  yr_proc_sweep(void *base, int fd, uint32_t self_slot);
int  yr_proc_set_owner(void *base, uint32_t slot, uint32_t is_owner);
/* hand a pin record from one process slot to another (fork: parent -> child) */
int  yr_pin_transfer(void *base, uint32_t pin, uint32_t from_slot, uint32_t to_slot);

/* put: reserve a block, fill it without the lock, commit it (replacing any old
 * object of the same key atomically), or abort it. */
int64_t yr_reserve(void *base, uint32_t slot, const char *key, uint32_t klen,
                   const char *meta, uint32_t mlen, uint64_t nbytes,
                   int64_t priority, double expire_at, uint64_t *payload_off);
/* tiered variants: a reservation may be a stub (no payload here) for an
 * object whose bytes live in another tier; a commit may be conditional on
 * the sequence number of the object it replaces (0: the key must be absent,
 * UINT64_MAX: unconditional) and reports what it replaced. */
int64_t yr_reserve_ex(void *base, uint32_t slot, const char *key, uint32_t klen,
                      const char *meta, uint32_t mlen, uint64_t alloc_bytes, uint64_t nbytes,
                      int64_t priority, double expire_at, uint32_t tier, uint32_t owner,
                      uint64_t gen, uint64_t access_count, uint64_t *payload_off);
int  yr_commit_ex(void *base, uint32_t slot, uint64_t block_off, uint64_t expected_seq,
                  yr_retired *out);
/* live objects for the placement policy: fills recs (keys packed into keybuf)
 * from bucket *cursor on; returns the count, advances *cursor (0 at end). */
int64_t yr_scan(void *base, uint64_t *cursor, yr_scanrec *recs, uint32_t maxrecs,
                char *keybuf, uint64_t keybuflen);
int  yr_abort(void *base, uint32_t slot, uint64_t block_off);
/* one call for small values: reserve + copy + commit under one lock hold */
int  yr_put_small(void *base, uint32_t slot, const char *key, uint32_t klen,
                  const char *meta, uint32_t mlen, const char *data, uint64_t nbytes,
                  int64_t priority, double expire_at);

/* pin: bit 0 takes a pin; bit 1 marks a look that is not a read (no access
 * count, no hit/miss) */
int  yr_get(void *base, uint32_t slot, const char *key, uint32_t klen, int pin,
            yr_objinfo *out);
/* batch lookup under one lock hold; keys packed back to back, lengths in klens */
int  yr_mget(void *base, uint32_t slot, const char *keys, const uint32_t *klens,
             uint32_t n, int pin, yr_objinfo *out, int32_t *found);
int  yr_unpin(void *base, uint32_t pin);
/* set a stub's generation word if the object is still `seq` (HBM: "wanted") */
int  yr_set_gen(void *base, const char *key, uint32_t klen, uint64_t seq, uint64_t gen);
/* batch of small puts under one lock hold; data[i] points at value i.
 * Returns how many were stored (stops at the first that does not fit). */
int  yr_mput_small(void *base, uint32_t slot, const char *keys, const uint32_t *klens,
                   const char *metas, const uint32_t *mlens, const char **data,
                   const uint64_t *nbytes, uint32_t n, int64_t priority, double expire_at,
                   yr_retired *out);
int  yr_pin_block(void *base, uint32_t slot, uint64_t block_off);
int  yr_delete(void *base, const char *key, uint32_t klen);
int  yr_delete_ex(void *base, const char *key, uint32_t klen, uint64_t expected_seq,
                  yr_retired *out);
int  yr_put_small_ex(void *base, uint32_t slot, const char *key, uint32_t klen,
                     const char *meta, uint32_t mlen, const char *data, uint64_t nbytes,
                     int64_t priority, double expire_at, yr_retired *out);
int  yr_contains(void *base, const char *key, uint32_t klen);

/* iterate keys: fills buf with [u32 len][bytes] records starting at bucket
 * *cursor; returns the number of keys written, advances *cursor (0 at end). */
int64_t yr_keys(void *base, uint64_t *cursor, char *buf, uint64_t buflen,
                const char *prefix, uint32_t plen);

/* the retire channel: stubs that left the index, whose bytes a process of
 * the right tier must free (see arena.c, dispose_locked) */
int64_t yr_drain_retired(void *base, uint32_t slot, uint32_t tiers, yr_scanrec *recs,
                         uint32_t maxrecs, char *keybuf, uint64_t keybuflen);
uint64_t yr_retired_pending(void *base);

int  yr_get_stats(void *base, yr_stats *out);
void yr_count(void *base, int which, uint64_t n);
int  yr_expire(void *base, double now);
int  yr_check_invariants(void *base, char *msg, uint32_t msglen);
int  yr_debug_hold_lock(void *base, int scramble);  /* tests only */

/* version word for publish/subscribe wake-ups (futex) */
uint32_t *yr_notify_word(void *base, uint32_t index);
int  yr_futex_wait(uint32_t *addr, uint32_t expected, double timeout);
int  yr_futex_wake(uint32_t *addr);
uint64_t *yr_user_word(void *base, uint32_t index);
char *yr_config_area(void *base, uint32_t *len);   /* 4 KiB for the store's settings */

/* mapping helpers: map a shm fd MAP_SHARED and pre-fault it */
void *yr_map(int fd, uint64_t size, int populate);
int  yr_unmap(void *addr, uint64_t size);
int  yr_populate_write(void *addr, uint64_t size);
void yr_memcpy(void *dst, const void *src, uint64_t n);
