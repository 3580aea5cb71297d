/* yrcache._fast, the values it builds and the headers it finds (see fast.c).
 *
 * A pinned ndarray: get and mget build it here once a get decoded its header in
 * Python and registered it (shaped()): numpy.frombuffer over a Pin, the pinned
 * bytes exported read-only, reshaped; a tensor: torch.from_numpy of that array
 * (over a writable export, as torch has no read-only tensors), viewed as its
 * dtype where numpy has none (bfloat16).  The Pin holds the Arena (so the mapping
 * outlives it) and gives the pin back when the last view built on it dies: here
 * in the process that took it, else through Arena._release (a view inherited
 * across fork, or after the slot was given back).
 *
 * A put: put_value finds the codec header of bytes, of a bytearray and of an
 * ndarray whose layout (buffer format, item size, shape) an earlier put taught
 * it (learn()), so a plain put is one C call with no encoding in Python. */
#include "fast.h"

/* A pinned stretch of the mapping, exported read-only; the last view built on
 * it gives the pin back.  It holds the Arena, so the mapping outlives it. */
typedef struct {
    PyObject_HEAD
    HotPath *hot;
    PyObject *arena;
    char *buf;
    Py_ssize_t len;
    uint32_t pin;
    long pid;
    int readonly;      /* 0 under a tensor: torch has no read-only tensors (as in Python) */
} Pin;

static PyObject *str_views, *str_release, *str_reshape, *str_view;

static int Pin_getbuffer(Pin *self, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)self, self->buf, self->len, self->readonly, flags);
}

static void Pin_dealloc(Pin *self) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    HotPath *hot = self->hot;
    PyObject *pin = PyLong_FromUnsignedLong(self->pin), *r = NULL;
    if (hot->base && hot->slot && self->pid == hot->pid) {   /* ours, and still attached */
        hot->unpin(hot->base, self->pin);
        PyObject *views = PyObject_GetAttr(self->arena, str_views);
        if (views && pin && PyDict_CheckExact(views) && PyDict_DelItem(views, pin) < 0) PyErr_Clear();
        Py_XDECREF(views);
    } else {       /* inherited across fork, or detached: the Arena knows what to do */
        PyObject *pid = PyLong_FromLong(self->pid);
        if (pid && pin) r = PyObject_CallMethodObjArgs(self->arena, str_release, pid, pin, NULL);
        Py_XDECREF(pid);
    }
    Py_XDECREF(r);
    Py_XDECREF(pin);
    PyErr_Clear();
    PyErr_Restore(type, value, tb);
    Py_DECREF(hot);
    Py_DECREF(self->arena);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyBufferProcs Pin_as_buffer = {(getbufferproc)Pin_getbuffer, NULL};

static PyTypeObject PinType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "yrcache._fast.Pin",
    .tp_doc = "A pinned object's bytes in the arena, read-only; the pin goes with the last view.",
    .tp_basicsize = sizeof(Pin),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)Pin_dealloc,
    .tp_as_buffer = &Pin_as_buffer,
};

/* The value get returns for an object pinned as `pin` (its header at meta_off),
 * built here when its header was registered with shaped(): np.frombuffer over a
 * Pin (then reshaped), which owns the pin from then on (*owned = 1).  Else the
 * tuple Python builds it from. */
PyObject *pinned_value(HotPath *self, const yr_objinfo *f, int views, int *owned) {
    const char *meta = (const char *)self->base + f->meta_off;
    Flat *e = views ? find_header(self->shaped, self->nshaped, meta, (Py_ssize_t)f->meta_len) : NULL;
    PyObject *arena = e && self->anchor && PyWeakref_Check(self->anchor) ? PyWeakref_GetObject(self->anchor) : NULL;
    if (!e || !arena || arena == Py_None || f->nbytes % (uint64_t)e->itemsize) {
        PyObject *m = PyBytes_FromStringAndSize(meta, f->meta_len);
        return m ? Py_BuildValue("(NKKIK)", m, (unsigned long long)f->payload_off, (unsigned long long)f->nbytes,
                                 f->pin, (unsigned long long)f->block_off) : NULL;
    }
    Py_INCREF(arena);       /* (borrowed from the weak reference) */
    PyObject *views_dict = PyObject_GetAttr(arena, str_views);
    PyObject *pk = PyLong_FromUnsignedLong(f->pin), *bk = PyLong_FromUnsignedLongLong(f->block_off);
    int ok = views_dict && pk && bk && PyDict_CheckExact(views_dict) && PyDict_SetItem(views_dict, pk, bk) == 0;
    Py_XDECREF(views_dict);
    Py_XDECREF(pk);
    Py_XDECREF(bk);
    Pin *p = ok ? PyObject_New(Pin, &PinType) : NULL;
    if (!p) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "yrcache: the arena has no views dict");
        Py_DECREF(arena);
        return NULL;
    }
    p->hot = (HotPath *)Py_NewRef((PyObject *)self);
    p->arena = arena;
    p->buf = (char *)self->base + f->payload_off;
    p->len = (Py_ssize_t)f->nbytes;
    p->pin = f->pin;
    p->pid = self->pid;
    p->readonly = e->post == NULL;
    *owned = 1;
    /* own references: code that runs inside numpy (a finalizer) may replace the entry */
    PyObject *fb = Py_NewRef(self->frombuffer), *dtype = Py_NewRef(e->dtype), *shape = Py_XNewRef(e->shape);
    PyObject *post = Py_XNewRef(e->post), *view_as = Py_XNewRef(e->view_as);
    PyObject *args[2] = {(PyObject *)p, dtype};
    PyObject *arr = PyObject_Vectorcall(fb, args, 2, NULL);
    Py_DECREF(p);
    if (arr && shape) Py_SETREF(arr, PyObject_CallMethodOneArg(arr, str_reshape, shape));
    if (arr && post) Py_SETREF(arr, PyObject_CallOneArg(post, arr));          /* torch.from_numpy */
    if (arr && view_as) Py_SETREF(arr, PyObject_CallMethodOneArg(arr, str_view, view_as));
    Py_DECREF(fb);
    Py_DECREF(dtype);
    Py_XDECREF(shape);
    Py_XDECREF(post);
    Py_XDECREF(view_as);
    return arr;
}

/* The entry of a buffer's layout (format, item size, shape), or NULL. */
static Layout *layout_of(HotPath *self, const Py_buffer *v) {
    if (!v->format || v->ndim > LAYOUT_NDIM || strlen(v->format) >= LAYOUT_FMT) return NULL;
    for (int i = 0; i < LAYOUT_MAX; i++) {
        Layout *l = &self->layouts[i];
        if (l->meta && l->ndim == v->ndim && l->itemsize == v->itemsize && !strcmp(l->format, v->format) &&
            (v->ndim == 0 || !memcmp(l->shape, v->shape, (size_t)v->ndim * sizeof(Py_ssize_t))))
            return l;
    }
    return NULL;
}

/* The view and codec header of a value put_value stores (bytes or bytearray: b"B"; a
 * C-contiguous ndarray of a learned layout: its header): 1, the view held; 0: an
 * ndarray of a layout not learned yet; -1: another kind of value (no exception). */
int value_view(HotPath *self, PyObject *value, Py_buffer *view, PyObject **meta) {
    if (PyBytes_CheckExact(value) || PyByteArray_CheckExact(value)) {
        if (PyObject_GetBuffer(value, view, PyBUF_SIMPLE) < 0) {
            PyErr_Clear();
            return -1;
        }
        *meta = self->bytes_meta;
        return 1;
    }
    if (self->ndarray && (PyObject *)Py_TYPE(value) == self->ndarray) {
        if (PyObject_GetBuffer(value, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            PyErr_Clear();       /* not contiguous, or a dtype buffers cannot describe */
            return -1;
        }
        Layout *l = layout_of(self, view);
        if (!l) {
            PyBuffer_Release(view);
            return 0;
        }
        *meta = l->meta;
        return 1;
    }
    return !self->ndarray && !strcmp(Py_TYPE(value)->tp_name, "numpy.ndarray") ? 0 : -1;
}

/* Store `view` under `key` and the codec header `meta` with priority 0 and no ttl (its
 * pages mapped first when the mapping was not prefaulted), the copy with the GIL
 * released; the arena's return code.  put_value's step, and OwnPuts.put's. */
int put_view(HotPath *self, const char *kb, Py_ssize_t klen, PyObject *meta, const Py_buffer *view,
             int prefaulted) {
    int populate = !prefaulted && view->len >= POPULATE_MIN;
    Py_INCREF(meta);     /* learn() may replace the entry while the GIL is released */
    yr_retired out;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = self->put(self->base, self->slot, kb, (uint32_t)klen, PyBytes_AS_STRING(meta),
                  (uint32_t)PyBytes_GET_SIZE(meta), view->buf, (uint64_t)view->len, 0, 0.0, populate, &out);
    Py_END_ALLOW_THREADS
    Py_DECREF(meta);
    return r;
}

/* put_value(key, value, prefaulted): put(), with the value's codec header found
 * here: b"B" for bytes and bytearray, a learned header for a C-contiguous
 * ndarray.  True: stored; None: an ndarray of a layout not learned yet (the
 * caller encodes it, and may teach it with learn()); False: the general path. */
PyObject *HotPath_put_value(HotPath *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "put_value(key, value, prefaulted) takes 3 arguments");
        return NULL;
    }
    Py_ssize_t klen;
    const char *kb = key_of(self, args[0], &klen);
    if (!kb) Py_RETURN_FALSE;
    PyObject *meta;
    Py_buffer view;
    int found = value_view(self, args[1], &view, &meta);
    if (found <= 0) return Py_NewRef(found == 0 ? Py_None : Py_False);
    int r = put_view(self, kb, klen, meta, &view, PyObject_IsTrue(args[2]));
    PyBuffer_Release(&view);
    if (r == YR_OK) Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

/* mput_values(pairs, priority, expire_at, small): the (key, value) pairs stored as mput
 * stores rows, every key checked and every header found first (nothing stored
 * otherwise); False also when a value is over `small` bytes (a large copy runs outside
 * the arena lock, in put). */
PyObject *HotPath_mput_values(HotPath *self, PyObject *const *args, Py_ssize_t nargs) {
    long long priority;
    double expire_at;
    Py_ssize_t small = nargs == 4 ? PyLong_AsSsize_t(args[3]) : -1;
    if (small < 0 || batch_args(self, args, 3, "mput_values(pairs: list, priority: int, expire_at: float, "
                                "small: int)", &priority, &expire_at) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "mput_values(pairs, priority, expire_at, small)");
        return NULL;
    }
    PyObject *pairs = args[0], *out = NULL;
    Rows r;
    if (rows_init(&r, PyList_GET_SIZE(pairs)) < 0) goto done;
    for (Py_ssize_t i = 0; i < r.n; i++) {
        PyObject *pair = PyList_GET_ITEM(pairs, i);
        Py_ssize_t klen;
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2 ||
            !(r.kbs[i] = key_of(self, PyTuple_GET_ITEM(pair, 0), &klen))) {
            out = Py_NewRef(Py_False);
            goto done;
        }
        r.klens[i] = (uint32_t)klen;
        int found = value_view(self, PyTuple_GET_ITEM(pair, 1), &r.views[i], &r.metas[i]);
        if (found <= 0) {
            out = Py_NewRef(found == 0 ? Py_None : Py_False);
            goto done;
        }
        r.held = i + 1;
        if (r.views[i].len > small) {
            out = Py_NewRef(Py_False);
            goto done;
        }
    }
    out = store_rows(self, &r, priority, expire_at);
done:
    rows_free(&r);
    return out;
}

/* learn(array, meta): from now on put_value stores an ndarray of this one's
 * layout under the codec header `meta` (which the caller encoded from it, with
 * no conversion).  The oldest of 32 layouts makes room. */
PyObject *HotPath_learn(HotPath *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyBytes_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "learn(array, meta: bytes)");
        return NULL;
    }
    PyTypeObject *type = Py_TYPE(args[0]);   /* plain ndarrays only: the layout of bytes (say) */
    if (self->ndarray ? (PyObject *)type != self->ndarray : strcmp(type->tp_name, "numpy.ndarray") != 0)
        Py_RETURN_FALSE;                      /* says nothing of an array's header */
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        Py_RETURN_FALSE;
    }
    int ok = view.format && view.ndim <= LAYOUT_NDIM && strlen(view.format) < LAYOUT_FMT;
    if (ok && !layout_of(self, &view)) {
        Layout *l = &self->layouts[self->next_layout];
        self->next_layout = (self->next_layout + 1) % LAYOUT_MAX;
        Py_XSETREF(l->meta, Py_NewRef(args[1]));
        strcpy(l->format, view.format);
        l->itemsize = view.itemsize;
        l->ndim = view.ndim;
        if (view.ndim) memcpy(l->shape, view.shape, (size_t)view.ndim * sizeof(Py_ssize_t));
        if (!self->ndarray) self->ndarray = Py_NewRef((PyObject *)Py_TYPE(args[0]));
    }
    PyBuffer_Release(&view);
    return PyBool_FromLong(ok);
}

/* shaped(meta, dtype, itemsize, shape, frombuffer[, post, view_as]): from now on
 * get and mget build a pinned value with this header as frombuffer(Pin, dtype),
 * reshaped to `shape` unless it is None; for a tensor header, then post(array)
 * (torch.from_numpy) and .view(view_as) unless it is None.  16 headers, the
 * oldest replaced. */
PyObject *HotPath_shaped(HotPath *self, PyObject *const *args, Py_ssize_t nargs) {
    if ((nargs != 5 && nargs != 7) || !PyBytes_CheckExact(args[0]) || !PyLong_Check(args[2]) ||
        (args[3] != Py_None && !PyTuple_CheckExact(args[3])) || (nargs == 7 && !PyCallable_Check(args[5]))) {
        PyErr_SetString(PyExc_TypeError, "shaped(meta: bytes, dtype, itemsize: int, shape: tuple | None, "
                                         "frombuffer[, post: callable, view_as | None])");
        return NULL;
    }
    Py_ssize_t itemsize = PyLong_AsSsize_t(args[2]);
    if (itemsize <= 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "shaped(): itemsize must be > 0");
        return NULL;
    }
    if (find_header(self->shaped, self->nshaped, PyBytes_AS_STRING(args[0]), PyBytes_GET_SIZE(args[0])))
        Py_RETURN_TRUE;
    Flat *e;
    if (self->nshaped < SHAPED_MAX) {
        e = &self->shaped[self->nshaped++];
    } else {
        e = &self->shaped[self->next_shaped];
        self->next_shaped = (self->next_shaped + 1) % SHAPED_MAX;
        Py_CLEAR(e->meta);
        Py_CLEAR(e->dtype);
        Py_CLEAR(e->shape);
        Py_CLEAR(e->post);
        Py_CLEAR(e->view_as);
    }
    e->meta = Py_NewRef(args[0]);
    e->dtype = Py_NewRef(args[1]);
    e->itemsize = itemsize;
    e->shape = args[3] == Py_None ? NULL : Py_NewRef(args[3]);
    e->post = nargs == 7 ? Py_NewRef(args[5]) : NULL;
    e->view_as = nargs == 7 && args[6] != Py_None ? Py_NewRef(args[6]) : NULL;
    Py_XSETREF(self->frombuffer, Py_NewRef(args[4]));
    Py_RETURN_TRUE;
}

/* Ready the Pin type and the names its methods look up (module init). */
int values_ready(void) {
    if (PyType_Ready(&PinType) < 0) return -1;
    str_views = PyUnicode_InternFromString("views");
    str_release = PyUnicode_InternFromString("_release");
    str_reshape = PyUnicode_InternFromString("reshape");
    str_view = PyUnicode_InternFromString("view");
    return str_views && str_release && str_reshape && str_view ? 0 : -1;
}

/* Drop what a HotPath's registries hold (its dealloc). */
void values_clear(HotPath *self) {
    for (int i = 0; i < self->nshaped; i++) {
        Py_DECREF(self->shaped[i].meta);
        Py_DECREF(self->shaped[i].dtype);
        Py_XDECREF(self->shaped[i].shape);
        Py_XDECREF(self->shaped[i].post);
        Py_XDECREF(self->shaped[i].view_as);
    }
    for (int i = 0; i < LAYOUT_MAX; i++) Py_XDECREF(self->layouts[i].meta);
}
