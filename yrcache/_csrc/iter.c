/* Iteration (keys, scans for the placement policy), statistics and expiry.
 * Iterations take the lock once per batch of buckets, so other processes
 * keep working; a bucket is copied out whole or not at all, so a resumed
 * iteration never repeats a key. */
#include "internal.h"

static inline int has_prefix(blk_t *b, const char *prefix, uint32_t plen) {
    return b->klen >= plen && memcmp(KEY(b), prefix, plen) == 0;
}

int64_t yr_keys(void *base, const char *prefix, uint32_t plen, const char *after, uint32_t alen,
                char *buf, uint64_t buflen, uint32_t maxkeys, uint64_t *more) {
    hdr_t *h = H(base);
    double now = now_realtime();
    LOCK(h);
    int64_t n = 0;
    uint64_t pos = 0;
    uint64_t off = alen ? sl_seek(h, after, alen, 1) : sl_seek(h, prefix, plen, 0);
    /* Each key must come after the one before (after `after` for the first):
     * a key out of order is a cycle, which would list keys forever. */
    const char *below = alen ? after : NULL;
    uint32_t blen = alen;
    *more = 0;
    for (; off && !h->damaged; off = FWD(AT(h, off))[0]) {
        blk_t *b = AT(h, off);
        if (below && cmp_key(b, below, blen) <= 0) {
            set_damaged(h);
            break;
        }
        below = KEY(b);
        blen = b->klen;
        if (!has_prefix(b, prefix, plen)) break;     /* sorted: no later key matches */
        if (expired(b, now)) continue;
        if (n == (int64_t)maxkeys || pos + 4 + b->klen > buflen) {
            if (n == 0) { *more = 4 + b->klen; unlock(h); return YR_EBUFFER; }
            *more = 1;
            break;
        }
        memcpy(buf + pos, &b->klen, 4);
        memcpy(buf + pos + 4, KEY(b), b->klen);
        pos += 4 + b->klen;
        n++;
    }
    if (h->damaged) n = YR_EDAMAGED;     /* (sl_seek's search too) */
    unlock(h);
    return n;
}

/* Buckets one lock hold of a scan or an expiry sweep walks at most (~20-50 us
 * of an index of empty buckets here): a caller loops until its cursor is 0. */
#define SCAN_BUCKETS 16384

static inline int scanned(blk_t *b, uint32_t tiers, double now) {
    return !expired(b, now) && !INTERNAL(b) && TIER_OF(b) < 32 && ((tiers >> TIER_OF(b)) & 1);
}

int64_t yr_scan(void *base, uint64_t *cursor, uint32_t tiers, yr_scanrec *recs, uint32_t maxrecs,
                char *keybuf, uint64_t keybuflen, uint64_t *need) {
    hdr_t *h = H(base);
    double now = now_realtime();
    LOCK(h);
    uint32_t n = 0;
    uint64_t pos = 0, i = *cursor, stop = i + SCAN_BUCKETS;
    for (; i < h->nbuckets && i < stop; i++) {
        uint64_t cnt = 0, want = 0, steps = max_blocks(h);
        for (uint64_t off = BUCKETS(h)[i]; off; off = AT(h, off)->next) {
            if (!link_ok(h, off, &steps)) {     /* a chain that loops or leaves the heap */
                unlock(h);
                return YR_EDAMAGED;
            }
            blk_t *b = AT(h, off);
            if (scanned(b, tiers, now)) {
                cnt++;
                want += b->klen;
            }
        }
        if (!cnt) continue;
        if (n + cnt > maxrecs || pos + want > keybuflen) {
            if (n == 0) {
                *need = cnt > maxrecs ? cnt : want;
                unlock(h);
                return YR_EBUFFER;
            }
            break;
        }
        for (uint64_t off = BUCKETS(h)[i]; off; off = AT(h, off)->next) {
            blk_t *b = AT(h, off);
            if (!scanned(b, tiers, now)) continue;
            yr_scanrec *r = &recs[n++];
            r->seq = b->seq;
            r->nbytes = b->nbytes;
            r->block_size = b->size;
            r->priority = b->priority;
            r->access_count = b->access_count;
            r->last_access = b->last_access;
            r->expire_at = b->expire_at;
            r->gen = b->gen;
            r->tier = TIER_OF(b);
            r->pins = b->pins;
            r->key_pos = (uint32_t)pos;
            r->klen = b->klen;
            r->holder = HOLDER_OF(b);
            r->flags = FLAGS_OF(b);
            memcpy(keybuf + pos, KEY(b), b->klen);
            pos += b->klen;
        }
    }
    *cursor = i < h->nbuckets ? i : 0;
    unlock(h);
    return n;
}

int yr_get_stats(void *base, yr_stats *out) {
    hdr_t *h = H(base);
    LOCK(h);
    out->capacity = h->heap_size;
    out->used = h->used;
    out->objects = h->objects;
    out->orphans = h->orphans;
    out->reserved = h->reserved;
    out->pinned_bytes = h->pinned_bytes;
    out->free_bytes = h->heap_size - h->used;
    out->retired = h->retired_count;
    out->largest_free = 0;
    if (h->free_bitmap) {
        int c = 63 - __builtin_clzll(h->free_bitmap);
        uint64_t steps = max_blocks(h);
        for (uint64_t off = h->freehead[c]; off && steps--; off = AT(h, off)->next)
            if (AT(h, off)->size > out->largest_free) out->largest_free = AT(h, off)->size;
    }
    out->hits = h->counters[YR_C_HITS];
    out->misses = h->counters[YR_C_MISSES];
    out->puts = h->counters[YR_C_PUTS];
    out->deletes = h->counters[YR_C_DELETES];
    out->spills = h->counters[YR_C_SPILLS];
    out->promotions = h->counters[YR_C_PROMOTIONS];
    out->evictions = h->counters[YR_C_EVICTIONS];
    out->recoveries = h->counters[YR_C_RECOVERIES];
    out->procs = 0;
    for (uint32_t i = 1; i < h->nprocs; i++) out->procs += PROCS(h)[i].state != 0;
    /* counts no heap can hold: a forged or written-over header (len() would overflow) */
    if (h->objects > max_blocks(h) || h->used > h->heap_size) set_damaged(h);
    int rc = h->damaged ? YR_EDAMAGED : YR_OK;
    unlock(h);
    return rc;
}

uint64_t yr_used(void *base) { return __atomic_load_n(&H(base)->used, __ATOMIC_RELAXED); }

void yr_count(void *base, int which, uint64_t n) {
    hdr_t *h = H(base);
    if (which < 0 || which >= C_NCOUNTERS) return;
    __atomic_fetch_add(&h->counters[which], n, __ATOMIC_RELAXED);
}

int yr_expire(void *base, double now) {
    hdr_t *h = H(base);
    int n = 0;
    for (uint64_t i = 0; i < h->nbuckets;) {   /* a lock hold per SCAN_BUCKETS buckets */
        LOCK(h);
        if (!h->ttl_objects) { unlock(h); return n; }   /* O(1) when nothing can expire */
        for (uint64_t stop = i + SCAN_BUCKETS; i < h->nbuckets && i < stop; i++) {
            uint64_t *s = &BUCKETS(h)[i], steps = max_blocks(h);
            while (*s && link_ok(h, *s, &steps)) {
                if (expired(AT(h, *s), now)) { retire_locked(h, s); n++; }
                else s = &AT(h, *s)->next;
            }
        }
        unlock(h);
    }
    return n;
}
