/* The sorted index: every visible key in byte order, in a skip list, so that
 * listing keys by prefix costs in proportion to the matches (plus a
 * logarithmic search), never a walk of the whole hash index.
 *
 * A block's forward links sit in its own variable area, after the key and
 * the codec header; its level (1..SL_MAX, drawn at reserve with p = 1/4) is
 * kept in the `prev` field, which only free blocks use otherwise.  Internal
 * keys (named words) are not listed.  The list is derived state: recovery
 * rebuilds it from the live blocks.  Every function here runs under the
 * arena lock.
 *
 * The finger is the search path of the last insert or removal: for each
 * level, the last node below that key (after an insert, the new node itself
 * on its levels).  A search for a key above the finger's lowest node starts
 * from it wherever it is further along, so keys put in order (s/0000001,
 * s/0000002, ...), and an overwrite (the removal of the old block, then the
 * insert of the new one, of the same key) cost a few comparisons on cached
 * nodes instead of a walk from the head through nodes spread over the arena.
 * Every insert and removal sets it anew, so it never names a node that left. */
#include "internal.h"

static inline uint64_t *next_of(hdr_t *h, uint64_t off, uint32_t level) {
    return off ? &FWD(AT(h, off))[level] : &h->sl_head[level];
}

uint32_t sl_random_level(hdr_t *h) {
    uint64_t x = h->sl_rng;            /* xorshift64 */
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    h->sl_rng = x;
    uint32_t level = 1;
    while ((x & 3) == 0 && level < SL_MAX) { level++; x >>= 2; }
    return level;
}

/* pred[i]: the last node (0: the head) whose key is below `key` on level i.
 * -1 when the walk goes round a cycle (set_damaged): a search moves only
 * forwards, so it visits no more nodes than the heap can hold. */
static int search(hdr_t *h, const char *key, uint32_t n, uint64_t *pred) {
    uint64_t x = 0, steps = max_blocks(h);
    int finger = h->sl_finger_ok && h->sl_finger[0] && cmp_key(AT(h, h->sl_finger[0]), key, n) < 0;
    /* (sl_finger[0] is the finger's highest key: every node on it is below `key` too) */
    for (int i = (int)h->sl_levels - 1; i >= 0; i--) {
        uint64_t nx, f = finger ? h->sl_finger[i] : 0;
        /* the finger's node on this level is below `key` too: start from it if it is further */
        if (f && (!x || cmp_key(AT(h, f), KEY(AT(h, x)), AT(h, x)->klen) > 0)) x = f;
        while ((nx = *next_of(h, x, i)) && cmp_key(AT(h, nx), key, n) < 0) {
            if (!steps--) {
                set_damaged(h);
                return -1;
            }
            x = nx;
        }
        pred[i] = x;
    }
    return 0;
}

/* The finger after a search that found `pred` (levels 0..levels-1; above: the
 * head), `off` on its lowest `level` levels (an insert), or none (a removal). */
static void set_finger(hdr_t *h, const uint64_t *pred, uint32_t levels, uint64_t off, uint32_t level) {
    for (uint32_t i = 0; i < SL_MAX; i++)
        h->sl_finger[i] = i < level ? off : i < levels ? pred[i] : 0;
    h->sl_finger_ok = 1;
}

void sl_insert(hdr_t *h, uint64_t off) {
    blk_t *b = AT(h, off);
    uint32_t level = SL_LEVEL(b);
    uint64_t pred[SL_MAX];
    if (search(h, KEY(b), b->klen, pred)) return;
    for (uint32_t i = h->sl_levels; i < level; i++) pred[i] = 0;
    if (level > h->sl_levels) h->sl_levels = level;
    for (uint32_t i = 0; i < level; i++) {
        uint64_t *link = next_of(h, pred[i], i);
        FWD(b)[i] = *link;
        *link = off;
    }
    set_finger(h, pred, h->sl_levels, off, level);
}

void sl_remove(hdr_t *h, uint64_t off) {
    blk_t *b = AT(h, off);
    uint64_t pred[SL_MAX];
    if (search(h, KEY(b), b->klen, pred)) return;
    for (uint32_t i = 0; i < SL_LEVEL(b) && i < h->sl_levels; i++) {
        uint64_t *link = next_of(h, pred[i], i);
        if (*link == off) *link = FWD(b)[i];
    }
    set_finger(h, pred, h->sl_levels, 0, 0);     /* (a level left empty had the head as pred) */
    while (h->sl_levels && !h->sl_head[h->sl_levels - 1]) h->sl_levels--;
}

/* The first node whose key is >= key (> key when `after`), or 0 (also when
 * the index is damaged: the caller checks h->damaged). */
uint64_t sl_seek(hdr_t *h, const char *key, uint32_t n, int after) {
    uint64_t pred[SL_MAX];
    if (!h->sl_levels || search(h, key, n, pred)) return 0;
    uint64_t x = *next_of(h, pred[0], 0);
    if (after && x && cmp_key(AT(h, x), key, n) == 0) x = FWD(AT(h, x))[0];
    return x;
}

void sl_reset(hdr_t *h) {
    memset(h->sl_head, 0, sizeof(h->sl_head));
    h->sl_levels = 0;
    h->sl_finger_ok = 0;
}

/* Walk level 0: keys strictly increasing, every node live and listed once.
 * Returns the number of nodes, or -1 (with msg) when the order is broken. */
int64_t sl_check(hdr_t *h, char *msg, uint32_t msglen) {
    int64_t n = 0;
    blk_t *prev = NULL;
    for (uint64_t off = h->sl_head[0]; off; off = FWD(AT(h, off))[0]) {
        blk_t *b = AT(h, off);
        if (b->state != ST_LIVE || INTERNAL(b) || !SL_LEVEL(b) || SL_LEVEL(b) > SL_MAX) {
            snprintf(msg, msglen, "sorted index holds block %llu in state %u", (unsigned long long)off, b->state);
            return -1;
        }
        if (prev && cmp_key(prev, KEY(b), b->klen) >= 0) {
            snprintf(msg, msglen, "sorted index out of order at block %llu", (unsigned long long)off);
            return -1;
        }
        prev = b;
        if (++n > (int64_t)h->objects) break;
    }
    return n;
}
