/* yrcache._fast: the hot paths of get, put and mget, in C.
 *
 * A get or put of a small DRAM value through cffi spends most of its time on
 * the Python side (validating and encoding the key, converting a dozen
 * arguments, reading result fields one attribute at a time).  A HotPath does
 * the key checks, the call and the result in one C function.  It does not link
 * against the arena core (a second extension, loaded RTLD_LOCAL): tiers/dram.py
 * hands it the addresses of yr_read, yr_put, yr_mread, yr_unpin and the mapping, sets `slot`
 * (this process's slot; 0 after a fork until the child has its own), and
 * closes it before the mapping goes.
 *
 * read(key) returns (data, meta_len) for a small DRAM object copied out (data:
 * its codec header then its payload, private bytes); (meta, payload_off,
 * nbytes, pin, block_off) for a larger DRAM object it pinned under `slot`; and
 * None when the key is missing; get(key) is read(key), except that it returns
 * values as TieredStore.get does where it can: a small bytes value as a
 * read-only memoryview, a small 1-D array whose header was registered with
 * flat() as a read-only ndarray over a private copy, and a pinned ndarray whose
 * header was registered with shaped() as a read-only view that holds the pin
 * (fast_values.c).  mread(keys) gives a list of what read gives, read in one
 * lock hold, and mget(keys) the values get gives.  put(key, meta, payload,
 * prefaulted) stores a payload in DRAM and returns True; put_value(key, value,
 * prefaulted) does the same with the header found in C (fast_values.c).  Each
 * returns False whenever the caller
 * must take the general path: a key that is not a plain valid str (the general
 * path raises the right error), an object not in DRAM, no slot, no room, a
 * payload that is not one contiguous buffer, or any error code. */
#include "fast.h"

static void HotPath_dealloc(HotPath *self) {
    for (int i = 0; i < self->nflat; i++) {
        Py_DECREF(self->flat[i].meta);
        Py_DECREF(self->flat[i].dtype);
    }
    Py_XDECREF(self->frombuffer);
    Py_XDECREF(self->ndarray);
    Py_XDECREF(self->anchor);
    Py_XDECREF(self->bytes_meta);
    values_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int HotPath_init(HotPath *self, PyObject *args, PyObject *kwds) {
    unsigned long long read, put, mread, unpin, mput, base;
    Py_ssize_t max_key;
    unsigned int cap;
    static char *kwlist[] = {"read", "put", "mread", "unpin", "mput", "base", "max_key", "cap", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "KKKKKKnI", kwlist, &read, &put, &mread, &unpin, &mput, &base,
                                     &max_key, &cap))
        return -1;
    if (!read || !put || !mread || !unpin || !mput || !base || max_key <= 0 || cap == 0 || cap > CAP_MAX) {
        PyErr_SetString(PyExc_ValueError, "HotPath(read, put, mread, unpin, mput, base, max_key, cap): "
                                          "addresses must be set, max_key > 0 and 0 < cap <= 8192");
        return -1;
    }
    self->mread = (__typeof__(&yr_mread))(uintptr_t)mread;
    self->unpin = (__typeof__(&yr_unpin))(uintptr_t)unpin;
    self->mput = (__typeof__(&yr_mput_small))(uintptr_t)mput;
    self->read = (__typeof__(&yr_read))(uintptr_t)read;
    self->slot = 0;
    self->put = (__typeof__(&yr_put))(uintptr_t)put;
    self->base = (void *)(uintptr_t)base;
    self->max_key = max_key;
    self->cap = cap;
    if (!self->bytes_meta && !(self->bytes_meta = PyBytes_FromStringAndSize("B", 1))) return -1;
    return 0;
}

/* The UTF-8 bytes of a valid key (cached in the str: no copy), or NULL. */
const char *key_of(HotPath *self, PyObject *key, Py_ssize_t *klen) {
    return self->base && self->slot ? plain_key(key, self->max_key, klen) : NULL;
}

/* A small value copied out to `p` (its header, then its payload): with `views`, a
 * bytes value or a 1-D array of a registered header as get returns it (read-only,
 * over a private copy); else, and for every other kind, (header + payload, header
 * length), which Python decodes. */
static PyObject *small_value(HotPath *self, const char *p, uint32_t meta_len, uint64_t nbytes, int views) {
    if (views && meta_len == 1 && p[0] == 'B') {
        PyObject *data = PyBytes_FromStringAndSize(p + 1, (Py_ssize_t)nbytes);
        if (!data) return NULL;
        PyObject *view = PyMemoryView_FromObject(data);
        Py_DECREF(data);
        return view;
    }
    Flat *f = views && p[0] == 'N' ? find_header(self->flat, self->nflat, p, (Py_ssize_t)meta_len) : NULL;
    if (f && nbytes % (uint64_t)f->itemsize == 0) {   /* (odd sizes: the general path says so) */
        PyObject *data = PyBytes_FromStringAndSize(p + meta_len, (Py_ssize_t)nbytes);
        if (!data) return NULL;
        PyObject *args[2] = {data, f->dtype};
        PyObject *arr = PyObject_Vectorcall(self->frombuffer, args, 2, NULL);
        Py_DECREF(data);
        return arr;
    }
    PyObject *data = PyBytes_FromStringAndSize(p, (Py_ssize_t)meta_len + (Py_ssize_t)nbytes);
    return data ? Py_BuildValue("(NI)", data, meta_len) : NULL;
}

static PyObject *read_key(HotPath *self, PyObject *key, int views) {
    Py_ssize_t klen;
    const char *kb = key_of(self, key, &klen);
    if (!kb) Py_RETURN_FALSE;
    char buf[CAP_MAX];
    yr_objinfo info;
    int r;
    Py_BEGIN_ALLOW_THREADS   /* the arena lock may be contended: let other threads run */
    r = self->read(self->base, self->slot, kb, (uint32_t)klen, &info, buf, self->cap, 1);
    Py_END_ALLOW_THREADS
    if (r == 1) return small_value(self, buf, info.meta_len, info.nbytes, views);   /* copied out */
    if (r == 0) {            /* pinned: the caller (or the view built here) owns the pin from here on */
        int owned = 0;
        PyObject *v = pinned_value(self, &info, views, &owned);
        if (!v && !owned) self->unpin(self->base, info.pin);   /* nobody else will release it */
        return v;
    }
    if (r == YR_ENOTFOUND) Py_RETURN_NONE;
    Py_RETURN_FALSE;
}

static PyObject *HotPath_read(HotPath *self, PyObject *key) {
    return read_key(self, key, 0);
}

static PyObject *HotPath_get(HotPath *self, PyObject *key) {
    return read_key(self, key, 1);
}

/* A batch read: the list mget builds its values from, or False. */
static PyObject *mread_keys(HotPath *self, PyObject *keys, int views) {
    if (!PyList_CheckExact(keys)) Py_RETURN_FALSE;
    Py_ssize_t n = PyList_GET_SIZE(keys), total = 0;
    if (n == 0 || n > MREAD_MAX) Py_RETURN_FALSE;
    const char **kbs = PyMem_Malloc(n * sizeof(char *));
    uint32_t *klens = PyMem_Malloc(n * sizeof(uint32_t));
    yr_objinfo *infos = PyMem_Malloc(n * sizeof(yr_objinfo));
    int32_t *found = PyMem_Malloc(n * sizeof(int32_t));
    char *packed = NULL, *buf = NULL;
    PyObject *out = NULL;
    if (!kbs || !klens || !infos || !found) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t klen;
        kbs[i] = key_of(self, PyList_GET_ITEM(keys, i), &klen);
        if (!kbs[i]) {                   /* an odd key: the general path words its error */
            out = Py_NewRef(Py_False);
            goto done;
        }
        klens[i] = (uint32_t)klen;
        total += klen;
    }
    packed = PyMem_Malloc(total ? total : 1);
    buf = PyMem_Malloc(MREAD_BYTES);
    if (!packed || !buf) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0, at = 0; i < n; at += klens[i], i++) memcpy(packed + at, kbs[i], klens[i]);
    int used;
    Py_BEGIN_ALLOW_THREADS
    used = self->mread(self->base, self->slot, packed, klens, (uint32_t)n, infos, found, buf, MREAD_BYTES,
                       self->cap, 1);
    Py_END_ALLOW_THREADS
    if (used < 0) {                      /* an object in another tier (the general path moves it), an error */
        out = Py_NewRef(Py_False);
        goto done;
    }
    out = PyList_New(n);
    for (Py_ssize_t i = 0; i < n && out; i++) {
        yr_objinfo *f = &infos[i];
        PyObject *item;
        if (found[i] == 0) {
            item = Py_NewRef(Py_None);
        } else if (found[i] == 2) {      /* copied: its header, then its payload right after */
            item = small_value(self, buf + f->meta_off, f->meta_len, f->nbytes, views);
        } else {
            int owned = 0;
            item = pinned_value(self, f, views, &owned);
            if (owned) found[i] = 3;     /* a view holds the pin now */
        }
        if (!item) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, item);
    }
    if (!out) {                          /* failed: give back every pin taken */
        for (Py_ssize_t i = 0; i < n; i++)
            if (found[i] == 1) self->unpin(self->base, infos[i].pin);
    }
done:
    PyMem_Free(kbs);
    PyMem_Free(klens);
    PyMem_Free(infos);
    PyMem_Free(found);
    PyMem_Free(packed);
    PyMem_Free(buf);
    return out;
}

static PyObject *HotPath_mread(HotPath *self, PyObject *keys) {
    return mread_keys(self, keys, 0);
}

static PyObject *HotPath_mget(HotPath *self, PyObject *keys) {
    return mread_keys(self, keys, 1);
}

static PyObject *HotPath_put(HotPath *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "put(key, meta, payload, prefaulted) takes 4 arguments");
        return NULL;
    }
    Py_ssize_t klen;
    const char *kb = key_of(self, args[0], &klen);
    if (!kb || !PyBytes_CheckExact(args[1])) Py_RETURN_FALSE;
    Py_buffer view;
    if (PyObject_GetBuffer(args[2], &view, PyBUF_SIMPLE) < 0) {   /* not one contiguous buffer */
        PyErr_Clear();
        Py_RETURN_FALSE;
    }
    int populate = !PyObject_IsTrue(args[3]) && view.len >= POPULATE_MIN;
    yr_retired out;
    int r;
    Py_BEGIN_ALLOW_THREADS   /* a large copy runs outside the arena lock and without the GIL */
    r = self->put(self->base, self->slot, kb, (uint32_t)klen, PyBytes_AS_STRING(args[1]),
                  (uint32_t)PyBytes_GET_SIZE(args[1]), view.buf, (uint64_t)view.len, 0, 0.0, populate, &out);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (r == YR_OK) Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

/* Room for n rows; -1 with MemoryError. */
int rows_init(Rows *r, Py_ssize_t n) {
    r->n = n;
    r->held = 0;
    r->kbs = PyMem_Malloc((size_t)n * sizeof(char *) + 1);
    r->klens = PyMem_Malloc((size_t)n * sizeof(uint32_t) + 1);
    r->metas = PyMem_Malloc((size_t)n * sizeof(PyObject *) + 1);
    r->views = PyMem_Malloc((size_t)n * sizeof(Py_buffer) + 1);
    if (r->kbs && r->klens && r->metas && r->views) return 0;
    PyErr_NoMemory();
    return -1;
}

/* Release the views held and the room (after rows_init, whatever it returned). */
void rows_free(Rows *r) {
    for (Py_ssize_t i = 0; i < r->held; i++) PyBuffer_Release(&r->views[i]);
    PyMem_Free(r->kbs);
    PyMem_Free(r->klens);
    PyMem_Free(r->metas);
    PyMem_Free(r->views);
}

/* Store n rows (key, header, payload view) in DRAM, MPUT_RUN rows (or MPUT_RUN_BYTES) per
 * hold of the arena lock (yr_mput_small), until one does not fit: (stored, how many of those replaced a
 * lower-tier copy), or the arena's negative error code; NULL with an exception.
 * Keys and headers are copied here before the GIL is released (the caller's
 * objects may change then); the views stay the caller's to release. */
PyObject *store_rows(HotPath *self, const Rows *r, long long priority, double expire_at) {
    Py_ssize_t n = r->n;
    const char *const *kbs = r->kbs;
    const uint32_t *klens = r->klens;
    PyObject *const *metas = r->metas;
    const Py_buffer *views = r->views;
    PyObject *out = NULL;
    size_t ktotal = 0, mtotal = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        ktotal += klens[i];
        mtotal += (size_t)PyBytes_GET_SIZE(metas[i]);
    }
    uint32_t *mlens = PyMem_Malloc((size_t)n * sizeof(uint32_t) + 1);
    uint64_t *nbytes = PyMem_Malloc((size_t)n * sizeof(uint64_t) + 1);
    const char **data = PyMem_Malloc((size_t)n * sizeof(char *) + 1);
    yr_retired *retired = PyMem_Malloc(MPUT_RUN * sizeof(yr_retired));
    char *keys = PyMem_Malloc(ktotal + 1), *heads = PyMem_Malloc(mtotal + 1);
    if (!mlens || !nbytes || !data || !retired || !keys || !heads) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0, k = 0, m = 0; i < n; i++) {
        mlens[i] = (uint32_t)PyBytes_GET_SIZE(metas[i]);
        memcpy(keys + k, kbs[i], klens[i]);
        memcpy(heads + m, PyBytes_AS_STRING(metas[i]), mlens[i]);
        k += klens[i];
        m += mlens[i];
        nbytes[i] = (uint64_t)views[i].len;
        data[i] = views[i].len ? (const char *)views[i].buf : NULL;
    }
    Py_ssize_t stored = 0;
    unsigned long lower = 0;
    int rc = 0;
    size_t k = 0, m = 0;
    Py_BEGIN_ALLOW_THREADS
    while (stored < n) {     /* a lock hold per MPUT_RUN rows or MPUT_RUN_BYTES: others wait ~50 us at most */
        uint32_t run = 0, low = 0;
        for (uint64_t bytes = 0; stored + run < n && run < MPUT_RUN; run++) {
            bytes += nbytes[stored + run];
            if (run && bytes > MPUT_RUN_BYTES) break;
        }
        rc = self->mput(self->base, self->slot, keys + k, klens + stored, heads + m, mlens + stored,
                        data + stored, nbytes + stored, run, (int64_t)priority, expire_at, retired, &low);
        if (rc < 0) break;
        lower += low;
        for (int i = 0; i < rc; i++, stored++) {
            k += klens[stored];
            m += mlens[stored];
        }
        if ((uint32_t)rc < run) break;     /* one did not fit */
    }
    Py_END_ALLOW_THREADS
    out = rc < 0 && stored == 0 ? PyLong_FromLong(rc) : Py_BuildValue("(nk)", stored, lower);
done:
    PyMem_Free(mlens);
    PyMem_Free(nbytes);
    PyMem_Free(data);
    PyMem_Free(retired);
    PyMem_Free(keys);
    PyMem_Free(heads);
    return out;
}

/* The arguments shared by mput and mput_values: (list, priority, expire_at); -1 with
 * an exception when they are not that, or the mapping cannot take a put now. */
int batch_args(HotPath *self, PyObject *const *args, Py_ssize_t nargs, const char *usage, long long *priority,
               double *expire_at) {
    if (nargs != 3 || !PyList_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    *priority = PyLong_AsLongLong(args[1]);
    *expire_at = PyFloat_AsDouble(args[2]);
    if (PyErr_Occurred()) return -1;
    if (!self->base || !self->slot) {
        PyErr_SetString(PyExc_ValueError, "the arena is closed, or this process has no slot in it yet");
        return -1;
    }
    return 0;
}

/* mput(rows, priority, expire_at): rows of (key bytes, meta bytes, payload, nbytes), keys
 * and headers validated by the caller, each payload one contiguous buffer of exactly
 * nbytes: store_rows' answer. */
static PyObject *HotPath_mput(HotPath *self, PyObject *const *args, Py_ssize_t nargs) {
    long long priority;
    double expire_at;
    if (batch_args(self, args, nargs, "mput(rows: list, priority: int, expire_at: float)", &priority,
                   &expire_at) < 0)
        return NULL;
    PyObject *rows = args[0], *out = NULL;
    Rows r;
    if (rows_init(&r, PyList_GET_SIZE(rows)) < 0) goto done;
    for (Py_ssize_t i = 0; i < r.n; i++) {
        PyObject *row = PyList_GET_ITEM(rows, i);
        if (!PyTuple_CheckExact(row) || PyTuple_GET_SIZE(row) != 4 || !PyBytes_CheckExact(PyTuple_GET_ITEM(row, 0))
            || !PyBytes_CheckExact(PyTuple_GET_ITEM(row, 1)) || !PyLong_CheckExact(PyTuple_GET_ITEM(row, 3))) {
            PyErr_Format(PyExc_TypeError, "mput: row %zd is not (key: bytes, meta: bytes, payload, nbytes: int)", i);
            goto done;
        }
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(row, 2), &r.views[i], PyBUF_SIMPLE) < 0) goto done;
        r.held = i + 1;
        long long nb = PyLong_AsLongLong(PyTuple_GET_ITEM(row, 3));
        if (nb != (long long)r.views[i].len) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "mput: row %zd says %lld bytes, its payload has %zd", i, nb,
                             r.views[i].len);
            goto done;
        }
        r.kbs[i] = PyBytes_AS_STRING(PyTuple_GET_ITEM(row, 0));
        r.klens[i] = (uint32_t)PyBytes_GET_SIZE(PyTuple_GET_ITEM(row, 0));
        r.metas[i] = PyTuple_GET_ITEM(row, 1);
    }
    out = store_rows(self, &r, priority, expire_at);
done:
    rows_free(&r);
    return out;
}

static PyObject *HotPath_flat(HotPath *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyBytes_CheckExact(args[0]) || !PyLong_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "flat(meta: bytes, dtype, itemsize: int, frombuffer)");
        return NULL;
    }
    Py_ssize_t itemsize = PyLong_AsSsize_t(args[2]);
    if (itemsize <= 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "flat(): itemsize must be > 0");
        return NULL;
    }
    if (find_header(self->flat, self->nflat, PyBytes_AS_STRING(args[0]), PyBytes_GET_SIZE(args[0])))
        Py_RETURN_TRUE;
    if (self->nflat == FLAT_MAX) Py_RETURN_FALSE;
    Flat *f = &self->flat[self->nflat++];
    f->meta = Py_NewRef(args[0]);
    f->dtype = Py_NewRef(args[1]);
    f->itemsize = itemsize;
    Py_XSETREF(self->frombuffer, Py_NewRef(args[3]));
    Py_RETURN_TRUE;
}

static PyObject *HotPath_get_slot(HotPath *self, void *closure) {
    return PyLong_FromUnsignedLong(self->slot);
}

static int HotPath_set_slot(HotPath *self, PyObject *value, void *closure) {
    unsigned long slot = value ? PyLong_AsUnsignedLong(value) : (unsigned long)-1;
    if (slot == (unsigned long)-1 || slot > UINT32_MAX) {
        if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_ValueError, "slot must be an int from 0 to 2**32-1");
        }
        return -1;
    }
    self->slot = (unsigned int)slot;
    self->pid = (long)getpid();     /* the pins taken under this slot are this process's */
    return 0;
}

static PyGetSetDef HotPath_getset[] = {
    {"slot", (getter)HotPath_get_slot, (setter)HotPath_set_slot,
     "this process's slot in the arena (0: none yet); setting it records the process", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyObject *HotPath_close(HotPath *self, PyObject *unused) {
    self->base = NULL;        /* every later call takes the general path */
    Py_RETURN_NONE;
}

static PyMethodDef HotPath_methods[] = {
    {"read", (PyCFunction)HotPath_read, METH_O,
     "read(key) -> (data, meta_len) | (meta, payload_off, nbytes, pin, block_off) | None | False: "
     "a small DRAM value copied out, a larger one pinned, a miss, or False (take the general path)."},
    {"get", (PyCFunction)HotPath_get, METH_O,
     "get(key) -> memoryview | ndarray | what read(key) returns: read, except that a small bytes "
     "value or 1-D array of a registered header comes back as get returns it (read-only, private)."},
    {"mread", (PyCFunction)HotPath_mread, METH_O,
     "mread(keys: list) -> list | False: per key None (missing), (data, meta_len) (copied out) or "
     "(meta, payload_off, nbytes, pin, block_off) (pinned), read in one lock hold; or False."},
    {"mget", (PyCFunction)HotPath_mget, METH_O,
     "mget(keys: list) -> list | False: mread, except that small bytes values and 1-D arrays of "
     "registered headers come back as get returns them."},
    {"put", (PyCFunction)(void (*)(void))HotPath_put, METH_FASTCALL,
     "put(key, meta, payload, prefaulted) -> bool: a payload stored in DRAM with priority 0 "
     "and no ttl, or False (take the general path)."},
    {"mput", (PyCFunction)(void (*)(void))HotPath_mput, METH_FASTCALL,
     "mput(rows, priority, expire_at) -> (stored, lower) | error code: rows of (key bytes, meta, "
     "payload, nbytes) stored in DRAM, 256 per lock hold, until one does not fit, and how many of them "
     "replaced a lower-tier copy; or the arena's negative error code."},
    {"mput_values", (PyCFunction)(void (*)(void))HotPath_mput_values, METH_FASTCALL,
     "mput_values(pairs, priority, expire_at, small) -> (stored, lower) | error code | None | False: "
     "mput of (key, value) pairs whose headers are found here (put_value's values, each of at most "
     "`small` bytes); None: an ndarray of a layout not learned yet; False: a key or value for the "
     "general path (none stored)."},
    {"put_value", (PyCFunction)(void (*)(void))HotPath_put_value, METH_FASTCALL,
     "put_value(key, value, prefaulted) -> True | None | False: put() of bytes, a bytearray or a "
     "C-contiguous ndarray of a learned layout, its header found here; None: an ndarray layout "
     "not learned yet (encode it, then learn()); False: take the general path."},
    {"learn", (PyCFunction)(void (*)(void))HotPath_learn, METH_FASTCALL,
     "learn(array, meta) -> bool: put_value stores ndarrays of this layout under meta from now "
     "on (32 layouts, the oldest replaced); False for a layout a buffer cannot describe here."},
    {"flat", (PyCFunction)(void (*)(void))HotPath_flat, METH_FASTCALL,
     "flat(meta, dtype, itemsize, frombuffer) -> bool: from now on get builds a small value with "
     "this 1-D ndarray header as frombuffer(private copy, dtype); False when 16 are registered."},
    {"shaped", (PyCFunction)(void (*)(void))HotPath_shaped, METH_FASTCALL,
     "shaped(meta, dtype, itemsize, shape, frombuffer) -> True: from now on get and mget build a "
     "pinned value with this ndarray header as frombuffer(pinned bytes, dtype), reshaped to shape "
     "unless it is None (16 headers, the oldest replaced)."},
    {"mreply", (PyCFunction)(void (*)(void))HotPath_mreply, METH_FASTCALL,
     "mreply(body, versions) -> (n, reply body) | False: a cluster member's MGET reply for the "
     "request body (its entry list), read in one lock hold and copied into one bytes object, "
     "versions from the dict; False: take the general path (nothing stays pinned)."},
    {"close", (PyCFunction)HotPath_close, METH_NOARGS,
     "close(): forget the mapping; later calls return False."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef HotPath_members[] = {
    {"anchor", T_OBJECT, offsetof(HotPath, anchor), 0,
     "a weak reference to the Arena that owns the mapping (the views get builds hold it)"},
    {NULL, 0, 0, 0, NULL},
};

PyTypeObject HotPathType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "yrcache._fast.HotPath",
    .tp_doc = "HotPath(read, put, mread, unpin, base, max_key, cap): gets, puts and batch reads "
              "of one arena mapping, each in one C call.",
    .tp_basicsize = sizeof(HotPath),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)HotPath_dealloc,
    .tp_init = (initproc)HotPath_init,
    .tp_methods = HotPath_methods,
    .tp_members = HotPath_members,
    .tp_getset = HotPath_getset,
};

static struct PyModuleDef fastmodule = {
    PyModuleDef_HEAD_INIT, "yrcache._fast", "The hot paths of get, put and mget (see _csrc/fast.c).",
    -1, wire_functions,
};

PyMODINIT_FUNC PyInit__fast(void) {
    if (PyType_Ready(&HotPathType) < 0 || values_ready() < 0) return NULL;
    PyObject *m = PyModule_Create(&fastmodule);
    if (!m) return NULL;
    Py_INCREF(&HotPathType);
    if (PyModule_AddObject(m, "HotPath", (PyObject *)&HotPathType) < 0) {
        Py_DECREF(&HotPathType);
        Py_DECREF(m);
        return NULL;
    }
    if (own_ready(m) < 0 || round_ready(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

