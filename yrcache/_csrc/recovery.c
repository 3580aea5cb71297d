/* Locking, crash recovery and the invariant check.
 *
 * One pthread mutex in the header, PTHREAD_PROCESS_SHARED and ROBUST: when
 * its holder dies inside a critical section, the next locker gets EOWNERDEAD
 * and rebuilds every derived structure from the heap, which is walkable at
 * every instant (see internal.h). */
#include "internal.h"

#include <errno.h>
#include <stdio.h>

int lock(hdr_t *h) {
    int r = pthread_mutex_lock(&h->lock);
    if (r == EOWNERDEAD) {
        /* The previous holder died inside a critical section: rebuild all
         * derived state from the (always walkable) heap, then carry on. */
        recover_locked(h);
        h->counters[YR_C_RECOVERIES]++;
        pthread_mutex_consistent(&h->lock);
    } else if (r) {
        return YR_ELOCK;
    }
    if (h->damaged) {       /* nothing in it can be trusted: see set_damaged */
        unlock(h);
        return YR_EDAMAGED;
    }
    return 0;
}

void unlock(hdr_t *h) { pthread_mutex_unlock(&h->lock); }

void recover_locked(hdr_t *h) {
    uint64_t end = heap_end(h);
    /* 1. Pin counts from the pin table (the only source of truth). */
    for (uint64_t off = h->heap_off; off < end; off += AT(h, off)->size) {
        if (!size_ok(h, off)) {     /* a walk that would not end */
            set_damaged(h);
            return;
        }
        AT(h, off)->pins = 0;
    }
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
    sl_reset(h);
    h->objects = h->orphans = h->reserved = h->pinned_bytes = h->used = h->ttl_objects = 0;
    for (uint64_t off = h->heap_off; off < end; off += AT(h, off)->size) {
        blk_t *b = AT(h, off);
        if (b->state != ST_LIVE) continue;
        uint64_t *s = find_slot(h, b->hash, KEY(b), b->klen);
        if (s) {
            uint64_t ooff = *s;
            blk_t *o = AT(h, ooff);
            if (o->seq > b->seq) { b->state = ST_ORPHAN; continue; }
            *s = o->next;
            o->state = ST_ORPHAN;
            if (!INTERNAL(o)) {
                h->objects--;
                sl_remove(h, ooff);
            }
            if (o->expire_at != 0.0) h->ttl_objects--;
        }
        link_live(h, off);
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
            b->state = STUB(b) ? ST_RETIRED : ST_FREE;
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
    int r = lock(h);
    if (r) {
        snprintf(msg, msglen, r == YR_EDAMAGED ? "the arena is damaged: its links contradict its blocks"
                                                : "the arena lock is unrecoverable");
        return r;
    }
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
            for (uint64_t off = h->freehead[c]; off && listed <= nfree; off = AT(h, off)->next) listed++;
        if (listed != nfree) { snprintf(msg, msglen, "free lists hold %llu blocks, heap %llu", (unsigned long long)listed, (unsigned long long)nfree); bad = 1; }
        else if (used != h->used) { snprintf(msg, msglen, "used %llu != counted %llu", (unsigned long long)h->used, (unsigned long long)used); bad = 1; }
        else if (objects != h->objects) { snprintf(msg, msglen, "objects %llu != counted %llu", (unsigned long long)h->objects, (unsigned long long)objects); bad = 1; }
        else if (orphans != h->orphans) { snprintf(msg, msglen, "orphans %llu != counted %llu", (unsigned long long)h->orphans, (unsigned long long)orphans); bad = 1; }
        else if (sl_check(h, msg, msglen) < 0) { bad = 1; }
        else if ((uint64_t)sl_check(h, msg, msglen) != objects) { snprintf(msg, msglen, "sorted index lists %lld keys, the index %llu", (long long)sl_check(h, msg, msglen), (unsigned long long)objects); bad = 1; }
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
