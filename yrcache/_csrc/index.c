/* The key index (chained hashing through the `next` field of live blocks)
 * and retirement: how a block leaves the index, and the retire channel
 * through which lower-tier bytes of a retired stub reach a process that can
 * free them.  Every function but the exported two runs under the arena lock. */
#include "internal.h"

static inline int key_eq(blk_t *b, uint64_t hash, const char *k, uint32_t n) {
    return b->hash == hash && b->klen == n && memcmp(KEY(b), k, n) == 0;
}

/* The bucket slot that points at the matching block (so the caller can
 * unlink it), or NULL (also for a chain that loops or leaves the heap: set_damaged). */
uint64_t *find_slot(hdr_t *h, uint64_t hash, const char *k, uint32_t n) {
    uint64_t *slot = &BUCKETS(h)[hash & (h->nbuckets - 1)];
    for (uint64_t steps = max_blocks(h); *slot; steps--) {
        /* (link_ok's check, written out: through the pointer, every get was ~8% slower) */
        if (!steps || !block_at_ok(h, *slot)) { set_damaged(h); return NULL; }   /* a loop, a wild link */
        blk_t *b = AT(h, *slot);
        if (key_eq(b, hash, k, n)) return slot;
        slot = &b->next;
    }
    return NULL;
}

/* Make a block visible: one store of its offset into its bucket. */
void link_live(hdr_t *h, uint64_t off) {
    blk_t *b = AT(h, off);
    uint64_t *bucket = &BUCKETS(h)[b->hash & (h->nbuckets - 1)];
    b->next = *bucket;
    b->state = ST_LIVE;
    *bucket = off;
    if (!INTERNAL(b)) {
        h->objects++;
        sl_insert(h, off);
    }
    if (b->expire_at != 0.0) h->ttl_objects++;
}

void push_retired(hdr_t *h, uint64_t off) {
    blk_t *b = AT(h, off);
    b->state = ST_RETIRED;
    b->next = h->retired_head;
    h->retired_head = off;
    h->retired_count++;
}

/* A block leaves the index for good.  A DRAM object's block is free; a stub's
 * bytes live in a lower tier, so the stub goes on the retire list, whence a
 * process that holds that tier frees the bytes (yr_drain_retired).  So no
 * retirement, not even an expiry found inside a lookup, loses track of them. */
void dispose_locked(hdr_t *h, uint64_t off) {
    if (STUB(AT(h, off))) push_retired(h, off);
    else free_block(h, off);
}

/* Take a live block out of the index; dispose of it unless a view pins it. */
void retire_locked(hdr_t *h, uint64_t *slot) {
    uint64_t off = *slot;
    blk_t *b = AT(h, off);
    *slot = b->next;
    b->next = 0;
    if (!INTERNAL(b)) {
        h->objects--;
        sl_remove(h, off);
    }
    if (b->expire_at != 0.0) h->ttl_objects--;
    if (b->pins) {
        b->state = ST_ORPHAN;
        h->orphans++;
    } else {
        dispose_locked(h, off);
    }
}

int64_t yr_drain_retired(void *base, uint32_t slot, uint32_t tiers, yr_scanrec *recs,
                         uint32_t maxrecs, char *keybuf, uint64_t keybuflen) {
    hdr_t *h = H(base);
    LOCK(h);
    uint32_t n = 0;
    uint64_t pos = 0;
    uint64_t steps = max_blocks(h);
    for (uint64_t *s = &h->retired_head; *s && n < maxrecs;) {
        if (!steps--) { set_damaged(h); unlock(h); return YR_EDAMAGED; }     /* a cycle */
        blk_t *b = AT(h, *s);
        uint32_t tier = TIER_OF(b);
        int mine = (tier < 32 && (tiers >> tier) & 1) && (tier != YR_TIER_HBM || HOLDER_OF(b) == slot);
        if (!mine) { s = &b->next; continue; }
        if (pos + b->klen > keybuflen) break;
        yr_scanrec *r = &recs[n++];
        memset(r, 0, sizeof(*r));
        r->seq = b->seq;
        r->nbytes = b->nbytes;
        r->block_size = b->size;
        r->priority = b->priority;
        r->tier = tier;
        r->holder = HOLDER_OF(b);
        r->gen = b->gen;
        r->key_pos = (uint32_t)pos;
        r->klen = b->klen;
        memcpy(keybuf + pos, KEY(b), b->klen);
        pos += b->klen;
        s = &b->next;                  /* stays listed until yr_release_retired */
    }
    unlock(h);
    return n;
}

int64_t yr_release_retired(void *base, const uint64_t *gens, uint32_t n) {
    hdr_t *h = H(base);
    LOCK(h);
    int64_t freed = 0;
    uint64_t steps = max_blocks(h);
    for (uint64_t *s = &h->retired_head; *s;) {
        if (!steps--) { set_damaged(h); unlock(h); return YR_EDAMAGED; }     /* a cycle */
        blk_t *b = AT(h, *s);
        int hit = 0;
        for (uint32_t i = 0; i < n && !hit; i++) hit = b->gen == gens[i];
        if (!hit) { s = &b->next; continue; }
        uint64_t off = *s;
        *s = b->next;
        h->retired_count--;
        free_block(h, off);
        freed++;
    }
    unlock(h);
    return freed;
}

uint64_t yr_retired_pending(void *base) {
    return __atomic_load_n(&H(base)->retired_count, __ATOMIC_RELAXED);
}
