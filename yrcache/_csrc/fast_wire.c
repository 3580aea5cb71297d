/* HotPath.mreply: a cluster member's answer to an MGET, built in one C call.
 *
 * The request body is a list of entries (u16 key length, u64 hlc, u64 writer,
 * then the key's UTF-8 bytes: cluster/wire.py's _ENTRY); the reply body is, per
 * key, an item header (u8 found, a pad byte, u16 header length, u64 payload
 * length, u64 hlc, u64 writer: wire.py's _GOT_ITEM) followed by the codec header
 * and the payload.  The objects are read under one hold of the arena lock
 * (yr_mread) and copied straight into the reply, whose versions come from the
 * member's `versions` dict (key -> (hlc, writer)).  In Python the same reply
 * took a tuple, a header and a view per key (2-4 us per key on a cold path).
 *
 * mreply returns False whenever the general path must answer: an entry list
 * that is not well formed (it raises the protocol error), a key the arena does
 * not take, an object outside DRAM, a pickled object (the general path refuses
 * it), or one larger than MREPLY_COPY (sent from its pinned view there, not
 * copied).  Nothing stays pinned when it returns. */
#include "fast.h"

#define ENTRY_SIZE 18              /* <HQQ */
#define ITEM_SIZE 28               /* <BxHQQQ */
#define MREPLY_MAX 4096            /* wire.MAX_BATCH */
#define MREPLY_COPY (64 << 10)     /* a pinned object up to this size is copied into the reply */

/* The UTF-8 bytes of `key` if it is a key the store takes (an exact str of 1 to
 * `max_key` UTF-8 bytes without NUL: validate.key_bytes's rule), else NULL and
 * no error set (the Python check words the error; lone surrogates included).
 * HotPath.key_of uses it too. */
const char *plain_key(PyObject *key, Py_ssize_t max_key, Py_ssize_t *klen) {
    if (!PyUnicode_CheckExact(key)) return NULL;
    const char *kb = PyUnicode_AsUTF8AndSize(key, klen);
    if (!kb) {
        PyErr_Clear();
        return NULL;
    }
    return *klen > 0 && *klen <= max_key && !memchr(kb, 0, (size_t)*klen) ? kb : NULL;
}

/* (hlc, writer) of `key` in `versions`, (0, 0) when absent; -1 with an error set. */
static int version_of(PyObject *versions, const char *kb, uint32_t klen, uint64_t *hlc, uint64_t *writer) {
    *hlc = *writer = 0;
    PyObject *key = PyUnicode_DecodeUTF8(kb, klen, "strict");
    if (!key) return -1;
    PyObject *v = PyDict_GetItemWithError(versions, key);    /* borrowed */
    Py_DECREF(key);
    if (!v) return PyErr_Occurred() ? -1 : 0;
    if (!PyTuple_CheckExact(v) || PyTuple_GET_SIZE(v) != 2) {
        PyErr_SetString(PyExc_TypeError, "a version is a (hlc, writer) tuple");
        return -1;
    }
    *hlc = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(v, 0));
    *writer = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(v, 1));
    return PyErr_Occurred() ? -1 : 0;
}

PyObject *HotPath_mreply(HotPath *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyDict_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "mreply(body, versions: dict)");
        return NULL;
    }
    if (!self->base || !self->slot) Py_RETURN_FALSE;
    Py_buffer body;
    if (PyObject_GetBuffer(args[0], &body, PyBUF_SIMPLE) < 0) return NULL;
    const char *b = body.buf;
    Py_ssize_t len = body.len, n = 0, keybytes = 0;
    for (Py_ssize_t pos = 0; pos < len; n++) {          /* count and check the entries */
        uint16_t klen;
        if (pos + ENTRY_SIZE > len || n >= MREPLY_MAX) goto general;
        memcpy(&klen, b + pos, 2);
        pos += ENTRY_SIZE;
        if (klen == 0 || klen > self->max_key || pos + klen > len || memchr(b + pos, 0, klen)) goto general;
        pos += klen;
        keybytes += klen;
    }
    if (n == 0) goto general;
    PyObject *out = NULL;
    char *packed = PyMem_Malloc((size_t)keybytes), *buf = PyMem_Malloc(MREAD_BYTES);
    uint32_t *klens = PyMem_Malloc((size_t)n * sizeof(uint32_t));
    yr_objinfo *infos = PyMem_Malloc((size_t)n * sizeof(yr_objinfo));
    int32_t *found = PyMem_Calloc((size_t)n, sizeof(int32_t));
    if (!packed || !buf || !klens || !infos || !found) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0, pos = 0, at = 0; i < n; i++) {
        uint16_t klen;
        memcpy(&klen, b + pos, 2);
        memcpy(packed + at, b + pos + ENTRY_SIZE, klen);
        klens[i] = klen;
        pos += ENTRY_SIZE + klen;
        at += klen;
    }
    int used;
    Py_BEGIN_ALLOW_THREADS
    used = self->mread(self->base, self->slot, packed, klens, (uint32_t)n, infos, found, buf, MREAD_BYTES,
                       self->cap, 1);
    Py_END_ALLOW_THREADS
    if (used < 0) {                       /* an object in another tier, an error: nothing is pinned */
        out = Py_NewRef(Py_False);
        goto done;
    }
    Py_ssize_t total = 0;
    int general = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        total += ITEM_SIZE;
        if (!found[i]) continue;
        const char *meta = found[i] == 2 ? buf + infos[i].meta_off : (const char *)self->base + infos[i].meta_off;
        if ((found[i] == 1 && infos[i].nbytes > MREPLY_COPY) || (infos[i].meta_len && meta[0] == 'P'))
            general = 1;
        total += (Py_ssize_t)infos[i].meta_len + (Py_ssize_t)infos[i].nbytes;
    }
    PyObject *reply = general ? NULL : PyBytes_FromStringAndSize(NULL, total);
    char *p = reply ? PyBytes_AS_STRING(reply) : NULL;
    for (Py_ssize_t i = 0, at = 0; p && i < n; at += klens[i], i++) {
        yr_objinfo *f = &infos[i];
        uint64_t hlc, writer;
        if (version_of(args[1], packed + at, klens[i], &hlc, &writer) < 0) {
            if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) PyErr_Clear();   /* the general path says so */
            Py_CLEAR(reply);
            break;
        }
        uint8_t item[ITEM_SIZE] = {0};
        if (!found[i]) {
            memcpy(p, item, ITEM_SIZE);
            p += ITEM_SIZE;
            continue;
        }
        uint16_t mlen = (uint16_t)f->meta_len;
        item[0] = 1;
        memcpy(item + 2, &mlen, 2);
        memcpy(item + 4, &f->nbytes, 8);
        memcpy(item + 12, &hlc, 8);
        memcpy(item + 20, &writer, 8);
        memcpy(p, item, ITEM_SIZE);
        p += ITEM_SIZE;
        const char *src = found[i] == 2 ? buf : (const char *)self->base;
        memcpy(p, src + f->meta_off, f->meta_len);
        p += f->meta_len;
        memcpy(p, src + f->payload_off, f->nbytes);
        p += f->nbytes;
    }
    for (Py_ssize_t i = 0; i < n; i++)     /* copied (or given up on): release every pin */
        if (found[i] == 1) self->unpin(self->base, infos[i].pin);
    if (reply) out = Py_BuildValue("(nN)", n, reply);
    else if (!PyErr_Occurred()) out = Py_NewRef(Py_False);
done:
    PyMem_Free(packed);
    PyMem_Free(buf);
    PyMem_Free(klens);
    PyMem_Free(infos);
    PyMem_Free(found);
    PyBuffer_Release(&body);
    return out;
general:
    PyBuffer_Release(&body);
    Py_RETURN_FALSE;
}

static PyObject *keys_valid(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t max_key, klen;
    if (nargs != 2 || !PyList_CheckExact(args[0]) || (max_key = PyLong_AsSsize_t(args[1])) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "keys_valid(keys: list, max_key: int)");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(args[0]); i++)
        if (!plain_key(PyList_GET_ITEM(args[0], i), max_key, &klen)) Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

static PyObject *wire_entries(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t max_key, total = 0, klen;
    if (nargs != 2 || !PyList_CheckExact(args[0]) || (max_key = PyLong_AsSsize_t(args[1])) < 0 || max_key > 65535) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "wire_entries(keys: list, max_key: int)");
        return NULL;
    }
    PyObject *keys = args[0];
    Py_ssize_t n = PyList_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!plain_key(PyList_GET_ITEM(keys, i), max_key, &klen)) Py_RETURN_NONE;
        total += ENTRY_SIZE + klen;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, total);
    if (!out) return NULL;
    char *p = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {          /* (the keys' UTF-8 is cached in them now) */
        const char *kb = PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(keys, i), &klen);
        uint16_t k16 = (uint16_t)klen;
        memcpy(p, &k16, 2);
        memset(p + 2, 0, ENTRY_SIZE - 2);
        memcpy(p + ENTRY_SIZE, kb, (size_t)klen);
        p += ENTRY_SIZE + klen;
    }
    return out;
}

/* One Got(meta, buf, (hlc, writer), -1) of an MGET reply. */
static PyObject *got_item(PyTypeObject *got, PyObject *meta, PyObject *buf, uint64_t hlc, uint64_t writer) {
    PyObject *version = Py_BuildValue("(KK)", (unsigned long long)hlc, (unsigned long long)writer);
    PyObject *fields = version ? Py_BuildValue("(OONi)", meta, buf, version, -1) : NULL;
    PyObject *args = fields ? PyTuple_Pack(1, fields) : NULL;
    PyObject *item = args ? PyTuple_Type.tp_new(got, args, NULL) : NULL;
    Py_XDECREF(fields);
    Py_XDECREF(args);
    return item;
}

static PyObject *wire_items(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t n, max_meta;
    if (nargs != 4 || !PyByteArray_CheckExact(args[0]) || (n = PyLong_AsSsize_t(args[1])) < 0 ||
        (max_meta = PyLong_AsSsize_t(args[2])) < 0 || !PyType_Check(args[3]) ||
        !PyType_IsSubtype((PyTypeObject *)args[3], &PyTuple_Type)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "wire_items(body: bytearray, n, max_meta, Got)");
        return NULL;
    }
    PyObject *body = args[0], *out = PyList_New(n), *view = PyMemoryView_FromObject(body), *meta = NULL;
    const char *b = PyByteArray_AS_STRING(body);
    Py_ssize_t len = PyByteArray_GET_SIZE(body), pos = 0;
    for (Py_ssize_t i = 0; out && view && i < n; i++) {
        uint8_t found;
        uint16_t mlen;
        uint64_t nbytes, hlc, writer;
        if (pos + ITEM_SIZE > len) goto bad;
        found = (uint8_t)b[pos];
        memcpy(&mlen, b + pos + 2, 2);
        memcpy(&nbytes, b + pos + 4, 8);
        memcpy(&hlc, b + pos + 12, 8);
        memcpy(&writer, b + pos + 20, 8);
        pos += ITEM_SIZE;
        if (!found) {
            PyList_SET_ITEM(out, i, Py_NewRef(Py_None));
            continue;
        }
        if (mlen > max_meta || mlen > len - pos || nbytes > (uint64_t)(len - pos - mlen)) goto bad;
        /* the items of a batch mostly share a header: one bytes object for a run of them */
        if (!meta || PyBytes_GET_SIZE(meta) != mlen || memcmp(PyBytes_AS_STRING(meta), b + pos, mlen)) {
            Py_XSETREF(meta, PyBytes_FromStringAndSize(b + pos, mlen));
            if (!meta) break;
        }
        pos += mlen;
        PyObject *buf = PySequence_GetSlice(view, pos, pos + (Py_ssize_t)nbytes);
        PyObject *item = buf ? got_item((PyTypeObject *)args[3], meta, buf, hlc, writer) : NULL;
        Py_XDECREF(buf);
        if (!item) break;
        PyList_SET_ITEM(out, i, item);
        pos += (Py_ssize_t)nbytes;
    }
    if (!view || PyErr_Occurred()) Py_CLEAR(out);
    Py_XDECREF(view);
    Py_XDECREF(meta);
    return out;
bad:                                             /* the caller raises its protocol error */
    Py_XDECREF(out);
    Py_XDECREF(view);
    Py_XDECREF(meta);
    Py_RETURN_NONE;
}

#define PUT_ITEM_SIZE 44         /* <HHQQQqd: klen, mlen, nbytes, hlc, writer, priority, expire_at */

/* The n items of an MPUT body held whole: (key, meta, payload bytes, (hlc, writer),
 * priority, expire_at) each, as wire.parse_mput gives them; None when the body is
 * malformed (parse_mput then raises the protocol error that says how). */
static PyObject *wire_mput(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t n, max_key, max_meta;
    if (nargs != 4 || !PyByteArray_CheckExact(args[0]) || (n = PyLong_AsSsize_t(args[1])) < 0 ||
        (max_key = PyLong_AsSsize_t(args[2])) < 0 || (max_meta = PyLong_AsSsize_t(args[3])) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "wire_mput(body: bytearray, n, max_key, max_meta)");
        return NULL;
    }
    const char *b = PyByteArray_AS_STRING(args[0]);
    Py_ssize_t len = PyByteArray_GET_SIZE(args[0]), pos = 0;
    PyObject *out = PyList_New(n), *meta = NULL;
    for (Py_ssize_t i = 0; out && i < n; i++) {
        uint16_t klen, mlen;
        uint64_t nbytes, hlc, writer;
        int64_t priority;
        double expire_at;
        if (PUT_ITEM_SIZE > len - pos) goto bad;
        memcpy(&klen, b + pos, 2);
        memcpy(&mlen, b + pos + 2, 2);
        memcpy(&nbytes, b + pos + 4, 8);
        memcpy(&hlc, b + pos + 12, 8);
        memcpy(&writer, b + pos + 20, 8);
        memcpy(&priority, b + pos + 28, 8);
        memcpy(&expire_at, b + pos + 36, 8);
        pos += PUT_ITEM_SIZE;
        if (klen > max_key || mlen > max_meta || (Py_ssize_t)klen + mlen > len - pos ||
            nbytes > (uint64_t)(len - pos - klen - mlen))
            goto bad;
        PyObject *key = PyUnicode_DecodeUTF8(b + pos, klen, "strict");
        if (!key) {
            PyErr_Clear();
            goto bad;
        }
        pos += klen;
        /* the items of a batch mostly share a header: one bytes object for a run of them */
        if (!meta || PyBytes_GET_SIZE(meta) != mlen || memcmp(PyBytes_AS_STRING(meta), b + pos, mlen))
            Py_XSETREF(meta, PyBytes_FromStringAndSize(b + pos, mlen));
        pos += mlen;
        PyObject *payload = meta ? PyBytes_FromStringAndSize(b + pos, (Py_ssize_t)nbytes) : NULL;
        pos += (Py_ssize_t)nbytes;
        PyObject *item = payload ? Py_BuildValue("(NON(KK)Ld)", key, meta, payload, (unsigned long long)hlc,
                                                 (unsigned long long)writer, (long long)priority, expire_at)
                                 : NULL;
        if (!payload) Py_DECREF(key);
        if (!item) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, item);
    }
    Py_XDECREF(meta);
    if (out && pos != len) goto bad_out;
    return out;
bad:
    Py_XDECREF(meta);
bad_out:
    Py_XDECREF(out);
    Py_RETURN_NONE;
}

/* One put item's fields, checked: a 7-tuple (key str, meta bytes, payload buffer,
 * nbytes, (hlc, writer), priority, expire_at) whose payload is one C-contiguous buffer
 * of exactly nbytes <= small bytes; 0, or -1 (with no error set: not for this path). */
typedef struct {
    const char *kb, *meta;
    Py_ssize_t klen, mlen;
    Py_buffer payload;
    unsigned long long hlc, writer;
    long long priority;
    double expire_at;
} PutFields;

static int put_fields(PyObject *item, Py_ssize_t max_key, Py_ssize_t max_meta, Py_ssize_t small, PutFields *f) {
    if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 7) return -1;
    PyObject *meta = PyTuple_GET_ITEM(item, 1), *version = PyTuple_GET_ITEM(item, 4);
    if (!PyBytes_CheckExact(meta) || !PyTuple_CheckExact(version) || PyTuple_GET_SIZE(version) != 2 ||
        !PyFloat_CheckExact(PyTuple_GET_ITEM(item, 6)))
        return -1;
    f->kb = plain_key(PyTuple_GET_ITEM(item, 0), max_key, &f->klen);
    f->meta = PyBytes_AS_STRING(meta);
    f->mlen = PyBytes_GET_SIZE(meta);
    Py_ssize_t nbytes = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 3));
    f->hlc = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(version, 0));
    f->writer = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(version, 1));
    f->priority = PyLong_AsLongLong(PyTuple_GET_ITEM(item, 5));
    f->expire_at = PyFloat_AS_DOUBLE(PyTuple_GET_ITEM(item, 6));
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    if (!f->kb || f->mlen > max_meta || nbytes < 0 || nbytes > small) return -1;
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(item, 2), &f->payload, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        return -1;
    }
    if (f->payload.len != nbytes) {
        PyBuffer_Release(&f->payload);
        return -1;
    }
    return 0;
}

/* The body of an MPUT frame for small put items (peer.put_item's bytes, joined), or
 * None when one of them is not for this path (the Python encoder takes them). */
static PyObject *wire_puts(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t max_key, max_meta, small, total = 0;
    if (nargs != 4 || !PyList_CheckExact(args[0]) || (max_key = PyLong_AsSsize_t(args[1])) < 0 ||
        max_key > 65535 || (max_meta = PyLong_AsSsize_t(args[2])) < 0 || max_meta > 65535 ||
        (small = PyLong_AsSsize_t(args[3])) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "wire_puts(items: list, max_key, max_meta, small)");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(args[0]);
    PutFields f;
    for (Py_ssize_t i = 0; i < n; i++) {              /* check every item and size the body */
        if (put_fields(PyList_GET_ITEM(args[0], i), max_key, max_meta, small, &f) < 0) Py_RETURN_NONE;
        total += PUT_ITEM_SIZE + f.klen + f.mlen + f.payload.len;
        PyBuffer_Release(&f.payload);
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, total);
    char *p = out ? PyBytes_AS_STRING(out) : NULL;
    for (Py_ssize_t i = 0; p && i < n; i++) {
        if (put_fields(PyList_GET_ITEM(args[0], i), max_key, max_meta, small, &f) < 0) {   /* changed meanwhile */
            Py_CLEAR(out);
            Py_RETURN_NONE;
        }
        uint16_t k16 = (uint16_t)f.klen, m16 = (uint16_t)f.mlen;
        uint64_t nb = (uint64_t)f.payload.len;
        memcpy(p, &k16, 2);
        memcpy(p + 2, &m16, 2);
        memcpy(p + 4, &nb, 8);
        memcpy(p + 12, &f.hlc, 8);
        memcpy(p + 20, &f.writer, 8);
        memcpy(p + 28, &f.priority, 8);
        memcpy(p + 36, &f.expire_at, 8);
        p += PUT_ITEM_SIZE;
        memcpy(p, f.kb, (size_t)f.klen);
        p += f.klen;
        memcpy(p, f.meta, (size_t)f.mlen);
        p += f.mlen;
        memcpy(p, f.payload.buf, (size_t)f.payload.len);
        p += f.payload.len;
        PyBuffer_Release(&f.payload);
    }
    return out;
}

PyMethodDef wire_functions[] = {
    {"keys_valid", (PyCFunction)(void (*)(void))keys_valid, METH_FASTCALL,
     "keys_valid(keys: list, max_key) -> bool: every key an exact str of 1 to max_key UTF-8 bytes "
     "without NUL (validate.key_bytes's rule; False: check them one by one for the error)."},
    {"wire_entries", (PyCFunction)(void (*)(void))wire_entries, METH_FASTCALL,
     "wire_entries(keys: list, max_key) -> bytes | None: an MGET request body (cluster/wire.py's "
     "entry list, versions 0) for keys that keys_valid accepts; None for any other."},
    {"wire_items", (PyCFunction)(void (*)(void))wire_items, METH_FASTCALL,
     "wire_items(body: bytearray, n, max_meta, Got) -> list | None: the n items of an MGET reply "
     "body, each None or Got(meta, view of body, (hlc, writer), -1); None for a malformed body."},
    {"wire_puts", (PyCFunction)(void (*)(void))wire_puts, METH_FASTCALL,
     "wire_puts(items: list, max_key, max_meta, small) -> bytes | None: an MPUT body for put items "
     "(key, meta, payload, nbytes, (hlc, writer), priority, expire_at), each payload one contiguous "
     "buffer of nbytes <= small; None when one is not (the Python encoder takes them)."},
    {"wire_mput", (PyCFunction)(void (*)(void))wire_mput, METH_FASTCALL,
     "wire_mput(body: bytearray, n, max_key, max_meta) -> list | None: the n items of an MPUT body "
     "held whole, each (key, meta, payload bytes, (hlc, writer), priority, expire_at) as "
     "wire.parse_mput gives them; None for a malformed body."},
    {NULL, NULL, 0, NULL},
};
