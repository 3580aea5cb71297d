/* Process slots and pins.  A slot is a process attached to the arena; a pin
 * keeps one block's bytes in place while a view of that process reads them.
 *
 * A slot is alive exactly as long as its process holds a write lock on byte
 * `slot` of the segment, taken through an open file description of its own
 * (F_OFD_SETLK, see os.c).  The kernel drops the lock when the process dies,
 * in whatever PID namespace it ran: liveness never depends on the caller's
 * view of /proc (pids of another container look dead, a reused pid alive).
 *
 * Pin records 1..npins-1 sit in the table laid out at init; more are grown
 * in pages from the heap when it runs out, so a fork that re-pins every live
 * view of its parent (or a reader holding many views) does not fail while
 * the heap has room. */
#include "internal.h"

#include <fcntl.h>

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

int pin_locked(hdr_t *h, uint32_t slot, uint64_t off) {
    if (!h->pin_free && !grow_pins_locked(h)) return YR_ENOPINS;
    uint32_t p = h->pin_free;
    if (p >= total_pins(h)) { set_damaged(h); return YR_EDAMAGED; }    /* a free stack written over */
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

void unpin_locked(hdr_t *h, uint32_t p) {
    pin_t *pr = PIN(h, p);
    uint64_t off = pr->block_off;
    if (!off) return;
    if (!block_at_ok(h, off) || pr->slot >= h->nprocs) {    /* written over: not a pin we made */
        set_damaged(h);
        pr->block_off = 0;
        return;
    }
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

int yr_proc_attach(void *base, int fd, uint32_t pid, uint64_t starttime, uint32_t is_owner) {
    hdr_t *h = H(base);
    LOCK(h);
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
    uint64_t off = h->heap_off, steps = max_blocks(h);
    while (off < heap_end(h)) {
        if (!size_ok(h, off)) {     /* a walk that would not end */
            set_damaged(h);
            return;
        }
        blk_t *b = AT(h, off);
        if (b->state == ST_RESERVED && b->owner == slot && TIER_OF(b) == YR_TIER_SSD) {
            /* A stub reserved before its disk copy was written: the copy
             * (if any) goes through the retire list. */
            h->reserved--;
            push_retired(h, off);
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
        for (uint64_t left = steps; *s;) {
            if (!link_ok(h, *s, &left)) return;
            blk_t *b = AT(h, *s);
            if (TIER_OF(b) == YR_TIER_HBM && HOLDER_OF(b) == slot) {
                b->where = YR_TIER_DRAM;   /* nothing left to free elsewhere */
                retire_locked(h, s);
            } else {
                s = &b->next;
            }
        }
    }
    for (uint64_t *s = &h->retired_head; *s && steps--;) {
        blk_t *b = AT(h, *s);
        if (TIER_OF(b) == YR_TIER_HBM && HOLDER_OF(b) == slot) {
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
    LOCK(h);
    release_slot_locked(h, slot);
    ofd_lock(fd, slot, F_UNLCK);   /* after the slot is free: nobody reclaims it twice */
    unlock(h);
    return YR_OK;
}

int yr_proc_list(void *base, int fd, uint32_t self_slot, yr_procinfo *out, uint32_t max) {
    hdr_t *h = H(base);
    LOCK(h);
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
    LOCK(h);
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
    LOCK(h);
    PROCS(h)[slot].is_owner = is_owner;
    unlock(h);
    return YR_OK;
}

int yr_pin_transfer(void *base, uint32_t pin, uint32_t from_slot, uint32_t to_slot) {
    hdr_t *h = H(base);
    if (to_slot == 0 || to_slot >= h->nprocs) return YR_ESTATE;
    LOCK(h);
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

int yr_unpin(void *base, uint32_t pin) {
    hdr_t *h = H(base);
    LOCK(h);
    if (pin == 0 || pin >= total_pins(h)) { unlock(h); return YR_ESTATE; }
    unpin_locked(h, pin);
    unlock(h);
    return YR_OK;
}

int yr_pin_block(void *base, uint32_t slot, uint64_t off) {
    hdr_t *h = H(base);
    LOCK(h);
    int r = YR_ESTATE;
    uint32_t st = AT(h, off)->state;
    if (st == ST_LIVE || st == ST_ORPHAN) r = pin_locked(h, slot, off);
    unlock(h);
    return r;
}
