/* The allocator: segregated free lists (one per power of two of the size in
 * 64-byte units, with a bitmap of non-empty lists), immediate coalescing with
 * both physical neighbours, small blocks carved from the top of free space.
 * Every function here runs under the arena lock. */
#include "internal.h"

static inline int size_class(uint64_t size) {
    uint64_t units = size / ALIGN;
    int c = 63 - __builtin_clzll(units);
    return c < NCLASSES ? c : NCLASSES - 1;
}

void fl_insert(hdr_t *h, uint64_t off) {
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

/* A block a free list offers is one the allocator may take: inside the heap
 * and FREE.  Anything else is a list that contradicts the blocks (a stale
 * header put back over a live segment): taking it would hand out, and unlink
 * through, a block in use.  O(1) per allocation. */
static int takeable(hdr_t *h, uint64_t off, uint64_t need) {
    if (block_at_ok(h, off) && size_ok(h, off) && AT(h, off)->state == ST_FREE && AT(h, off)->size >= need)
        return 1;
    set_damaged(h);
    return 0;
}

static void set_next_prev_size(hdr_t *h, uint64_t off) {
    blk_t *b = AT(h, off);
    uint64_t nxt = off + b->size;
    if (nxt < heap_end(h)) AT(h, nxt)->prev_size = b->size;
}

/* Find a free block of at least `need` bytes, take it off its list, split
 * off the tail if it is big enough to stand alone.  Returns 0 when none (or
 * when the lists are damaged: set_damaged). */
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
    if (!best || !takeable(h, best, need)) return 0;
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

uint64_t alloc_block(hdr_t *h, uint64_t need) {
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
        if (mask && !(found = h->freehead[__builtin_ctzll(mask)])) {
            set_damaged(h);     /* the bitmap names a list that is empty */
            return 0;
        }
    }
    /* ...and only then an exhaustive scan, so a fit is never missed. */
    if (!found) {
        uint64_t steps = max_blocks(h);
        for (uint64_t off = h->freehead[c]; off; off = AT(h, off)->next) {
            if (!steps--) { set_damaged(h); return 0; }     /* a cycle */
            if (AT(h, off)->size >= need) { found = off; break; }
        }
    }
    if (!found || !takeable(h, found, need)) return 0;
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
void free_block(hdr_t *h, uint64_t off) {
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
