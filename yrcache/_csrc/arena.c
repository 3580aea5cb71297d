/* The arena's layout: init, the attacher's header check, the settings area
 * and named words.  See internal.h for the map of the C core and
 * docs/architecture.md for the design. */
#include "internal.h"

uint64_t yr_arena_min_size(void) { return 1 << 20; }

/* The region offsets follow from the counts: computed here at init, and
 * again by yr_arena_check, which so refuses a header whose offsets a writer
 * could have forged to point outside the mapping. */
void layout_regions(hdr_t *h) {
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
    uint64_t nb = 1024;   /* a bucket per KiB: a chain stays under one block on average */
    while (nb < size / 1024 && nb < (1ULL << 30)) nb <<= 1;
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
    h->sl_rng = 0x9E3779B97F4A7C15ULL ^ size;
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
    if (h->layout != LAYOUT || h->size != size || h->damaged) return YR_EBADARENA;
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
        if (off < h->heap_off || off + BLK_HDR + (uint64_t)PIN_PAGE * sizeof(pin_t) > heap_end(h))
            return YR_EBADARENA;
    }
    return YR_OK;
}

char *yr_config_area(void *base) { return H(base)->config; }

/* ----------------------------------------------------------- named words */

/* A named word is an internal object (key "\0w" + name) whose payload is a
 * yr_word.  It is never retired, so its offset stays valid for the life of
 * the arena: a process looks it up once and then reads, waits on and wakes
 * it with no lock and no lookup. */
int64_t yr_word_at(void *base, const char *name, uint32_t nlen) {
    hdr_t *h = H(base);
    char key[2 + 256];
    if (nlen > 256) return YR_ETOOBIG;
    key[0] = 0;
    key[1] = 'w';
    memcpy(key + 2, name, nlen);
    uint32_t klen = nlen + 2;
    LOCK(h);
    int64_t r;
    uint64_t *s = find_slot(h, hash_key(key, klen), key, klen);
    if (h->damaged) {
        r = YR_EDAMAGED;
    } else if (s) {
        r = (int64_t)(*s + AT(h, *s)->payload_rel);
    } else {
        yr_desc d = {.alloc_bytes = sizeof(yr_word), .nbytes = sizeof(yr_word), .tier = YR_TIER_DRAM};
        int64_t off = reserve_locked(h, 0, key, klen, NULL, 0, &d);
        if (off > 0) {
            blk_t *b = AT(h, off);
            memset((char *)b + b->payload_rel, 0, sizeof(yr_word));
            commit_locked(h, 0, (uint64_t)off, UINT64_MAX, NULL);
            r = off + b->payload_rel;
        } else {
            r = off;
        }
    }
    unlock(h);
    return r;
}

int yr_word_cas(yr_word *w, uint64_t expected, uint64_t desired) {
    return __atomic_compare_exchange_n(&w->value, &expected, desired, 0, __ATOMIC_SEQ_CST,
                                       __ATOMIC_SEQ_CST);
}
