/* A cluster member's single PUT and GET requests in one C call (OwnPuts.serve; the
 * rest of OwnPuts is fast_own.c; the frame format is cluster/wire.py).
 *
 * transport.Server hands serve(buf, start, end) its read buffer before any Python
 * parses the next frame; serve answers the frame at buf[start:end] when it is whole
 * and plain: a PUT of at most SMALL_PUT bytes with no tier, ttl or priority (a WriteMode.NONE
 * object too: the general path), of bytes or a learned ndarray layout, applied as
 * Node.apply does (the key's lock, the version rule, clock.observe, F_REPLICATE:
 * queued); a GET of a whole DRAM object of at most SMALL_GET bytes, copied into the
 * reply, or of a missing key.  It returns (consumed, reply), (consumed, reply, key,
 * version) when the forwarder must be woken or the queue is full (Forwarder.add it), or
 * None: anything else, or anything read_frame would refuse, for the general path
 * (nothing consumed or changed). */
#include "fast.h"

#define HDR_SIZE 72               /* wire.HDR: <2sBBHHIIQQQqdQQ */
#define PROTO 1
#define OP_PUT 1
#define OP_GET 2
#define F_REPLICATE 1
#define ST_OK 0
#define ST_NOT_FOUND 1
#define ST_STALE 2
#define ST_SAME 5
#define WIRE_MAX_KEY 1024
#define WIRE_MAX_META 4096
#define SMALL_PUT (64 << 10)
#define SMALL_GET (64 << 10)

typedef struct {
    uint16_t op, flags, status;
    uint32_t klen, mlen;
    uint64_t plen, hlc, writer, offset, length;
    int64_t priority;
    double expire_at;
} Head;

static void read_head(const char *p, Head *h) {
    h->op = (uint8_t)p[3];
    memcpy(&h->flags, p + 4, 2);
    memcpy(&h->status, p + 6, 2);
    memcpy(&h->klen, p + 8, 4);
    memcpy(&h->mlen, p + 12, 4);
    memcpy(&h->plen, p + 16, 8);
    memcpy(&h->hlc, p + 24, 8);
    memcpy(&h->writer, p + 32, 8);
    memcpy(&h->priority, p + 40, 8);
    memcpy(&h->expire_at, p + 48, 8);
    memcpy(&h->offset, p + 56, 8);
    memcpy(&h->length, p + 64, 8);
}

/* A reply header (wire.pack) at p: op, status, meta length, payload length, version. */
static void write_head(char *p, int op, int status, uint32_t mlen, uint64_t plen, uint64_t hlc, uint64_t writer) {
    memset(p, 0, HDR_SIZE);
    p[0] = 'Y';
    p[1] = 'R';
    p[2] = PROTO;
    p[3] = (char)op;
    uint16_t st = (uint16_t)status;
    memcpy(p + 6, &st, 2);
    memcpy(p + 12, &mlen, 4);
    memcpy(p + 16, &plen, 8);
    memcpy(p + 24, &hlc, 8);
    memcpy(p + 32, &writer, 8);
}

static PyObject *head_reply(int op, int status) {
    PyObject *r = PyBytes_FromStringAndSize(NULL, HDR_SIZE);
    if (r) write_head(PyBytes_AS_STRING(r), op, status, 0, 0, 0, 0);
    return r;
}

/* Does the codec header `meta` fit a payload of n bytes: bytes (b"B"), or an ndarray
 * layout put_value learned, of exactly n bytes?  (Anything else: the general path,
 * which parses it.) */
static int plain_meta(HotPath *hot, const char *meta, uint32_t mlen, uint64_t n) {
    if (mlen == 1 && meta[0] == 'B') return 1;
    for (int i = 0; i < LAYOUT_MAX; i++) {
        Layout *l = &hot->layouts[i];
        if (!l->meta || PyBytes_GET_SIZE(l->meta) != (Py_ssize_t)mlen || memcmp(PyBytes_AS_STRING(l->meta), meta, mlen))
            continue;
        uint64_t want = (uint64_t)l->itemsize;
        for (int d = 0; d < l->ndim; d++) want *= (uint64_t)l->shape[d];
        return want == n;
    }
    return 0;
}

static PyObject *serve_put(OwnPuts *self, const char *p, const Head *h, Py_ssize_t size) {
    HotPath *hot = self->hot;
    const char *kb = p + HDR_SIZE, *meta = kb + h->klen, *payload = meta + h->mlen;
    if ((h->flags & ~F_REPLICATE) || h->priority || h->expire_at != 0.0 || h->plen > SMALL_PUT ||
        !h->mlen || !plain_meta(hot, meta, h->mlen, h->plen) || !hot->base || !hot->slot)
        Py_RETURN_NONE;
    PyObject *key = PyUnicode_DecodeUTF8(kb, h->klen, "strict");
    if (!key) {
        PyErr_Clear();            /* read_frame says what is wrong with it */
        Py_RETURN_NONE;
    }
    PyObject *out = NULL, *version = NULL, *reply = NULL;
    Py_hash_t hash = PyObject_Hash(key);
    if (hash == -1) goto done;
    KeyLock *lock = (KeyLock *)PyList_GET_ITEM(self->locks, (size_t)hash & 63);
    if (!keylock_take(lock, 0)) {
        out = Py_NewRef(Py_None);             /* another thread writes this key: the general path waits */
        goto done;
    }
    int older = not_newer(self, key, h->hlc, h->writer);
    if (older) {
        PyThread_release_lock(lock->lock);
        if (older < 0) goto done;
        reply = head_reply(OP_PUT, older == 2 ? ST_SAME : ST_STALE);
        if (reply) out = Py_BuildValue("(nN)", size, reply);
        goto done;
    }
    yr_retired retired;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = hot->put(hot->base, hot->slot, kb, h->klen, meta, h->mlen, payload, h->plen, 0, 0.0, 0, &retired);
    Py_END_ALLOW_THREADS
    if (r != YR_OK) {
        PyThread_release_lock(lock->lock);
        out = Py_NewRef(Py_None);             /* no room: the general path makes some, or says so */
        goto done;
    }
    PyObject *ph = PyLong_FromUnsignedLongLong(h->hlc), *pw = ph ? PyLong_FromUnsignedLongLong(h->writer) : NULL;
    version = pw ? PyTuple_Pack(2, ph, pw) : NULL;
    Py_XDECREF(ph);
    Py_XDECREF(pw);
    int bad = !version || applied(self, key, version) < 0;
    PyThread_release_lock(lock->lock);
    if (bad) goto done;
    if (h->hlc > self->clock->last) self->clock->last = h->hlc;      /* clock.observe */
    int queued = h->flags & F_REPLICATE ? enqueue(self, key, version, h->hlc, h->writer) : 1;
    if (queued < 0 || !(reply = head_reply(OP_PUT, ST_OK))) goto done;
    out = queued ? Py_BuildValue("(nN)", size, reply) : Py_BuildValue("(nNOO)", size, reply, key, version);
done:
    Py_DECREF(key);
    Py_XDECREF(version);
    return out;
}

static PyObject *serve_get(OwnPuts *self, const char *p, const Head *h, Py_ssize_t size) {
    HotPath *hot = self->hot;
    const char *kb = p + HDR_SIZE;
    if (h->mlen || h->plen || h->offset || h->length < SMALL_GET || !hot->base || !hot->slot)
        Py_RETURN_NONE;
    PyObject *key = PyUnicode_DecodeUTF8(kb, h->klen, "strict");
    if (!key) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *out = NULL;
    char buf[CAP_MAX];
    yr_objinfo info;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = hot->read(hot->base, hot->slot, kb, h->klen, &info, buf, hot->cap, 1);
    Py_END_ALLOW_THREADS
    if (r == YR_ENOTFOUND) {
        PyObject *reply = head_reply(OP_GET, ST_NOT_FOUND);
        out = reply ? Py_BuildValue("(nN)", size, reply) : NULL;
        goto done;
    }
    if (r != 0 && r != 1) {
        out = Py_NewRef(Py_None);             /* in another tier: the general path */
        goto done;
    }
    const char *src = r == 1 ? buf : (const char *)hot->base;
    const char *meta = src + (r == 1 ? 0 : info.meta_off), *payload = r == 1 ? buf + info.meta_len
                                                                               : src + info.payload_off;
    if (info.nbytes > SMALL_GET || (info.meta_len && meta[0] == 'P')) {
        out = Py_NewRef(Py_None);             /* sent from its pinned view there (or refused there) */
    } else {
        unsigned long long hlc = 0, writer = 0;
        PyObject *v = PyDict_GetItemWithError(self->versions, key);
        PyObject *reply = NULL;
        if ((v || !PyErr_Occurred()) && (!v || version_parts(v, &hlc, &writer) == 0) &&
            (reply = PyBytes_FromStringAndSize(NULL, HDR_SIZE + (Py_ssize_t)info.meta_len + (Py_ssize_t)info.nbytes))) {
            char *o = PyBytes_AS_STRING(reply);
            write_head(o, OP_GET, ST_OK, info.meta_len, info.nbytes, hlc, writer);
            memcpy(o + HDR_SIZE, meta, info.meta_len);
            memcpy(o + HDR_SIZE + info.meta_len, payload, info.nbytes);
            out = Py_BuildValue("(nN)", size, reply);
        }
    }
    if (r == 0) hot->unpin(hot->base, info.pin);
done:
    Py_DECREF(key);
    return out;
}

PyObject *OwnPuts_serve(OwnPuts *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t start, end;
    if (nargs != 3 || (start = PyLong_AsSsize_t(args[1])) < 0 || (end = PyLong_AsSsize_t(args[2])) < start) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "serve(buf, start, end)");
        return NULL;
    }
    if (!self->active || end - start < HDR_SIZE) Py_RETURN_NONE;
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *out = NULL;
    if (end > b.len) {
        PyErr_SetString(PyExc_ValueError, "serve: end is past the buffer");
        goto done;
    }
    const char *p = (const char *)b.buf + start;
    Head h;
    read_head(p, &h);
    Py_ssize_t size = HDR_SIZE + (Py_ssize_t)h.klen + (Py_ssize_t)h.mlen;
    if (p[0] != 'Y' || p[1] != 'R' || p[2] != PROTO || !h.klen || h.klen > WIRE_MAX_KEY ||
        h.klen > (uint64_t)self->hot->max_key || h.mlen > WIRE_MAX_META ||
        h.plen > SMALL_PUT || (size += (Py_ssize_t)h.plen) > end - start || memchr(p + HDR_SIZE, 0, h.klen))
        out = Py_NewRef(Py_None);             /* another op's size limits, a partial frame, a bad key: read_frame */
    else if (h.op == OP_PUT)
        out = serve_put(self, p, &h, size);
    else if (h.op == OP_GET)
        out = serve_get(self, p, &h, size);
    else
        out = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&b);
    return out;
}

