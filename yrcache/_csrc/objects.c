/* Objects: reserve -> fill -> commit (or abort), lookups, deletes.
 *
 * A put reserves a block under the lock, fills it without the lock, and
 * commits it under the lock: the commit retires any old object of the key and
 * links the new block into its bucket with one store, so readers see the old
 * object or the new one, never a mix.  A commit may be conditional on the
 * sequence number of the object it replaces: that is how a move between
 * tiers loses to a concurrent overwrite instead of resurrecting old bytes. */
#include "internal.h"

static uint64_t block_need(uint32_t klen, uint32_t mlen, uint32_t level, uint64_t nbytes,
                           uint32_t *prel) {
    uint64_t rel = align_up(BLK_HDR + align_up((uint64_t)klen + mlen, 8) + 8ull * level, ALIGN);
    *prel = (uint32_t)rel;
    uint64_t need = align_up(rel + nbytes, ALIGN);
    return need < MIN_BLOCK ? MIN_BLOCK : need;
}

int yr_fits(void *base, uint32_t klen, uint32_t mlen, uint64_t nbytes) {
    uint64_t heap = H(base)->heap_size;     /* fixed at init: no lock needed */
    uint32_t rel;
    return nbytes <= heap && block_need(klen, mlen, 1, nbytes, &rel) <= heap;
}

int64_t reserve_locked(hdr_t *h, uint32_t slot, const char *key, uint32_t klen,
                       const char *meta, uint32_t mlen, const yr_desc *d) {
    uint32_t rel;
    if (d->alloc_bytes > h->heap_size) return YR_ETOOBIG;
    uint32_t level = klen && key[0] == 0 ? 0 : sl_random_level(h);   /* internal keys are not listed */
    uint64_t need = block_need(klen, mlen, level, d->alloc_bytes, &rel);
    if (need > h->heap_size) return YR_ETOOBIG;
    uint64_t off = alloc_block(h, need);
    if (!off) return h->damaged ? YR_EDAMAGED : YR_ENOSPC;
    blk_t *b = AT(h, off);
    b->owner = slot;
    b->pins = 0;
    b->klen = klen;
    b->next = 0;
    b->prev = level;
    b->hash = hash_key(key, klen);
    b->seq = 0;
    b->nbytes = d->nbytes;
    b->mlen = mlen;
    b->payload_rel = rel;
    b->priority = d->priority;
    b->expire_at = d->expire_at;
    b->access_count = d->access_count;
    b->last_access = now_realtime();
    b->where = WHERE(d->tier, 0, d->holder);
    b->gen = d->gen;
    memcpy(KEY(b), key, klen);
    if (mlen) memcpy(KEY(b) + klen, meta, mlen);
    b->state = ST_RESERVED;
    h->reserved++;
    return (int64_t)off;
}

int64_t yr_reserve(void *base, uint32_t slot, const char *key, uint32_t klen, const char *meta,
                   uint32_t mlen, const yr_desc *d, uint64_t *payload_off) {
    hdr_t *h = H(base);
    LOCK(h);
    int64_t off = reserve_locked(h, slot, key, klen, meta, mlen, d);
    if (off > 0) *payload_off = (uint64_t)off + AT(h, off)->payload_rel;
    unlock(h);
    return off;
}

/* What a caller must know of an object it replaced or deleted. */
static void describe_retired(blk_t *o, yr_retired *out) {
    out->existed = 1;
    out->tier = TIER_OF(o);
    out->holder = HOLDER_OF(o);
    out->gen = o->gen;
    out->seq = o->seq;
    out->nbytes = o->nbytes;
}

int commit_locked(hdr_t *h, uint32_t slot, uint64_t off, uint64_t expected_seq, yr_retired *out) {
    blk_t *b = AT(h, off);
    if (b->state != ST_RESERVED || b->owner != slot) return YR_ESTATE;
    uint64_t *old = find_slot(h, b->hash, KEY(b), b->klen);
    if (h->damaged) return YR_EDAMAGED;
    if (expected_seq != UINT64_MAX) {
        uint64_t cur = old ? AT(h, *old)->seq : 0;
        if (cur != expected_seq) return YR_ECHANGED;   /* someone got there first */
    }
    if (out) memset(out, 0, sizeof(*out));
    if (old) {
        if (out) describe_retired(AT(h, *old), out);
        retire_locked(h, old);
    }
    b->seq = ++h->seq;
    if (out) out->new_seq = b->seq;
    h->reserved--;
    link_live(h, off);   /* the object becomes visible here, atomically */
    if (h->damaged) return YR_EDAMAGED;      /* the sorted index is (sorted.c) */
    /* a conditional commit is a move between tiers, not a caller's put */
    if (!INTERNAL(b) && expected_seq == UINT64_MAX) h->counters[YR_C_PUTS]++;
    return YR_OK;
}

int yr_commit(void *base, uint32_t slot, uint64_t off, uint64_t expected_seq, yr_retired *out) {
    hdr_t *h = H(base);
    LOCK(h);
    int r = commit_locked(h, slot, off, expected_seq, out);
    unlock(h);
    return r;
}

int yr_abort(void *base, uint32_t slot, uint64_t off) {
    hdr_t *h = H(base);
    LOCK(h);
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

static int put_small_locked(hdr_t *h, uint32_t slot, const char *key, uint32_t klen,
                            const char *meta, uint32_t mlen, const char *data, uint64_t nbytes,
                            int64_t priority, double expire_at, yr_retired *out) {
    yr_desc d = {.alloc_bytes = nbytes, .nbytes = nbytes, .priority = priority,
                 .expire_at = expire_at, .tier = YR_TIER_DRAM};
    int64_t off = reserve_locked(h, slot, key, klen, meta, mlen, &d);
    if (off <= 0) return (int)off;
    blk_t *b = AT(h, off);
    if (nbytes) memcpy((char *)b + b->payload_rel, data, nbytes);
    return commit_locked(h, slot, (uint64_t)off, UINT64_MAX, out);
}

#define SMALL_PUT (64u << 10)   /* copied under the lock: cheaper than taking it twice */

int yr_put(void *base, uint32_t slot, const char *key, uint32_t klen, const char *meta,
           uint32_t mlen, const char *data, uint64_t nbytes, int64_t priority, double expire_at,
           int populate, yr_retired *out) {
    hdr_t *h = H(base);
    LOCK(h);
    if (nbytes <= SMALL_PUT) {
        int r = put_small_locked(h, slot, key, klen, meta, mlen, data, nbytes, priority, expire_at, out);
        unlock(h);
        return r;
    }
    yr_desc d = {.alloc_bytes = nbytes, .nbytes = nbytes, .priority = priority,
                 .expire_at = expire_at, .tier = YR_TIER_DRAM};
    int64_t off = reserve_locked(h, slot, key, klen, meta, mlen, &d);
    unlock(h);
    if (off <= 0) return (int)off;
    /* The copy runs outside the lock: other processes keep working.  A death
     * here leaves a RESERVED block, never visible, that the sweep frees. */
    char *dst = (char *)AT(h, off) + AT(h, off)->payload_rel;
    if (populate) yr_populate(dst, nbytes, 1);   /* a mapping that has not touched these pages */
    yr_memcpy(dst, data, nbytes);
    LOCK(h);
    int r = commit_locked(h, slot, (uint64_t)off, UINT64_MAX, out);
    unlock(h);
    return r;
}

int yr_mput_small(void *base, uint32_t slot, const char *keys, const uint32_t *klens,
                  const char *metas, const uint32_t *mlens, const char **data,
                  const uint64_t *nbytes, uint32_t n, int64_t priority, double expire_at,
                  yr_retired *out, uint32_t *lower) {
    hdr_t *h = H(base);
    LOCK(h);
    uint32_t i = 0;
    *lower = 0;
    for (; i < n; i++) {
        if (put_small_locked(h, slot, keys, klens[i], metas, mlens[i], data[i], nbytes[i], priority,
                             expire_at, &out[i]) != YR_OK) break;
        *lower += out[i].existed && out[i].tier != YR_TIER_DRAM;
        keys += klens[i];
        metas += mlens[i];
    }
    unlock(h);
    return (int)i;
}

/* ------------------------------------------------------------------ gets */

static void describe(blk_t *b, uint64_t off, yr_objinfo *out) {
    out->block_off = off;
    out->payload_off = off + b->payload_rel;
    out->nbytes = b->nbytes;
    out->meta_off = off + BLK_HDR + b->klen;
    out->meta_len = b->mlen;
    out->priority = b->priority;
    out->expire_at = b->expire_at;
    out->access_count = b->access_count;
    out->seq = b->seq;
    out->gen = b->gen;
    out->tier = TIER_OF(b);
    out->holder = HOLDER_OF(b);
    out->flags = FLAGS_OF(b);
}

/* The live block of a key, retiring it if it expired: NULL when none. */
static uint64_t *lookup_locked(hdr_t *h, const char *key, uint32_t klen, double now, int count) {
    uint64_t *s = find_slot(h, hash_key(key, klen), key, klen);
    if (s && expired(AT(h, *s), now)) {
        retire_locked(h, s);
        s = NULL;
    }
    if (!s && count && !(klen && key[0] == 0)) h->counters[YR_C_MISSES]++;
    return s;
}

static int get_locked(hdr_t *h, uint32_t slot, const char *key, uint32_t klen, int flags,
                      double now, yr_objinfo *out) {
    int quiet = flags & YR_QUIET;    /* a look that is not a read: no access count, no hit */
    uint64_t *s = lookup_locked(h, key, klen, now, !quiet);
    if (!s) return h->damaged ? YR_EDAMAGED : YR_ENOTFOUND;
    uint64_t off = *s;
    blk_t *b = AT(h, off);
    out->pin = 0;
    if (flags & YR_PIN) {
        int p = pin_locked(h, slot, off);
        if (p < 0) return p;
        out->pin = (uint32_t)p;
    }
    if (!quiet) {
        b->access_count++;
        b->last_access = now;
        if (!INTERNAL(b)) h->counters[YR_C_HITS]++;
    }
    describe(b, off, out);
    return YR_OK;
}

int yr_get(void *base, uint32_t slot, const char *key, uint32_t klen, int flags, yr_objinfo *out) {
    hdr_t *h = H(base);
    double now = now_realtime();
    LOCK(h);
    int r = get_locked(h, slot, key, klen, flags, now, out);
    unlock(h);
    return r;
}

/* A read under the lock: copy a small DRAM object into buf (returns 1), else
 * pin it (returns 0) -- or, with dram_only, return YR_EBUFFER for an object
 * that is not in DRAM, counted as nothing. */
static int read_locked(hdr_t *h, uint32_t slot, const char *key, uint32_t klen, double now,
                       yr_objinfo *out, char *buf, uint32_t cap, int dram_only) {
    int r = get_locked(h, slot, key, klen, YR_QUIET, now, out);   /* counted below */
    if (r == YR_OK) {
        blk_t *b = AT(h, out->block_off);
        int dram = TIER_OF(b) == YR_TIER_DRAM;
        if (dram_only && !dram) return YR_EBUFFER;
        if (dram && b->mlen + b->nbytes <= cap) {
            memcpy(buf, KEY(b) + b->klen, b->mlen);
            memcpy(buf + b->mlen, (char *)b + b->payload_rel, b->nbytes);
            r = 1;
        } else {
            int p = pin_locked(h, slot, out->block_off);
            if (p < 0) return p;
            out->pin = (uint32_t)p;
        }
        b->access_count++;
        b->last_access = now;
        h->counters[YR_C_HITS]++;
        out->access_count = b->access_count;
    } else if (r == YR_ENOTFOUND && !(klen && key[0] == 0)) {
        h->counters[YR_C_MISSES]++;
    }
    return r;
}

int yr_read(void *base, uint32_t slot, const char *key, uint32_t klen, yr_objinfo *out, char *buf,
            uint32_t cap, int dram_only) {
    hdr_t *h = H(base);
    double now = now_realtime();
    LOCK(h);
    int r = read_locked(h, slot, key, klen, now, out, buf, cap, dram_only);
    unlock(h);
    return r;
}

int yr_mread(void *base, uint32_t slot, const char *keys, const uint32_t *klens, uint32_t n,
             yr_objinfo *out, int32_t *found, char *buf, uint64_t cap, uint64_t small, int dram_only) {
    hdr_t *h = H(base);
    double now = now_realtime();
    LOCK(h);
    if (dram_only) {            /* a quiet look first: nothing counted or pinned if one is elsewhere */
        const char *k = keys;
        for (uint32_t i = 0; i < n; k += klens[i], i++) {
            uint64_t *s = lookup_locked(h, k, klens[i], now, 0);
            if (s && TIER_OF(AT(h, *s)) != YR_TIER_DRAM) {
                unlock(h);
                return YR_EBUFFER;
            }
        }
    }
    int err = 0;
    uint64_t used = 0;
    for (uint32_t i = 0; i < n; i++) {
        int r = get_locked(h, slot, keys, klens[i], 0, now, &out[i]);
        keys += klens[i];
        found[i] = 0;
        if (r != YR_OK) continue;
        blk_t *b = AT(h, out[i].block_off);
        uint64_t at = (used + b->mlen + 63) & ~(uint64_t)63;      /* the payload 64-byte aligned */
        if (TIER_OF(b) == YR_TIER_DRAM && b->mlen + b->nbytes <= small && at + b->nbytes <= cap) {
            memcpy(buf + at - b->mlen, KEY(b) + b->klen, b->mlen);
            memcpy(buf + at, (char *)b + b->payload_rel, b->nbytes);
            out[i].meta_off = at - b->mlen;
            out[i].payload_off = at;
            used = at + b->nbytes;
            found[i] = 2;
        } else {
            int p = pin_locked(h, slot, out[i].block_off);
            if (p < 0) {            /* undo the pins taken so far */
                for (uint32_t j = 0; j < i; j++) if (found[j] == 1) unpin_locked(h, out[j].pin);
                err = p;
                break;
            }
            out[i].pin = (uint32_t)p;
            found[i] = 1;
        }
    }
    if (h->damaged && !err) {         /* a lookup met a cycle: nothing read can be trusted */
        for (uint32_t j = 0; j < n; j++) if (found[j] == 1) unpin_locked(h, out[j].pin);
        err = YR_EDAMAGED;
    }
    unlock(h);
    return err ? err : (int)used;
}

int yr_peek(void *base, const char *key, uint32_t klen, yr_objinfo *out, char *meta,
            uint32_t metacap) {
    hdr_t *h = H(base);
    double now = now_realtime();
    LOCK(h);
    uint64_t *s = lookup_locked(h, key, klen, now, 0);
    int r = h->damaged ? YR_EDAMAGED : YR_ENOTFOUND;
    if (s) {
        blk_t *b = AT(h, *s);
        describe(b, *s, out);
        out->pin = 0;
        r = b->mlen <= metacap ? YR_OK : YR_EBUFFER;
        if (r == YR_OK) memcpy(meta, KEY(b) + b->klen, b->mlen);
    }
    unlock(h);
    return r;
}

int yr_contains(void *base, const char *key, uint32_t klen) {
    hdr_t *h = H(base);
    double now = now_realtime();
    LOCK(h);
    uint64_t *s = find_slot(h, hash_key(key, klen), key, klen);
    int r = h->damaged ? YR_EDAMAGED : s && !expired(AT(h, *s), now);
    unlock(h);
    return r;
}

int yr_delete(void *base, const char *key, uint32_t klen, uint64_t expected_seq, yr_retired *out) {
    hdr_t *h = H(base);
    double now = now_realtime();
    memset(out, 0, sizeof(*out));
    LOCK(h);
    uint64_t *s = find_slot(h, hash_key(key, klen), key, klen);
    int r = h->damaged ? YR_EDAMAGED : YR_ENOTFOUND;
    if (s && (expected_seq == UINT64_MAX || AT(h, *s)->seq == expected_seq)) {
        blk_t *b = AT(h, *s);
        r = expired(b, now) ? YR_ENOTFOUND : YR_OK;
        describe_retired(b, out);
        retire_locked(h, s);
        if (r == YR_OK) h->counters[YR_C_DELETES]++;
    }
    unlock(h);
    return r;
}

int yr_set_flags(void *base, const char *key, uint32_t klen, uint64_t seq, uint32_t set,
                 uint32_t clear) {
    hdr_t *h = H(base);
    LOCK(h);
    uint64_t *s = find_slot(h, hash_key(key, klen), key, klen);
    int r = h->damaged ? YR_EDAMAGED : YR_ENOTFOUND;
    if (s && AT(h, *s)->seq == seq) {
        blk_t *b = AT(h, *s);
        uint32_t flags = (FLAGS_OF(b) | set) & ~clear;
        b->where = WHERE(TIER_OF(b), flags, HOLDER_OF(b));
        r = YR_OK;
    }
    unlock(h);
    return r;
}
