/* Shared by the files of yrcache._fast: fast.c (the HotPath type, its reads and
 * puts), fast_values.c (the values it builds and the headers it finds), fast_wire.c
 * (cluster batches), fast_own.c (a member's clock and own ASYNC puts), fast_serve.c
 * (a member's single PUT and GET frames) and fast_round.c (a client's small requests
 * and its wait for their replies). */
#ifndef YR_FAST_H
#define YR_FAST_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#include <structmember.h>

#include "arena.h"      /* declarations only: the functions are reached through addresses */

#define CAP_MAX 8192             /* the largest copy a read takes (on the C stack) */
#define MREAD_BYTES (64 << 10)   /* room for the small values one batch read copies out */
#define MREAD_MAX 65536           /* keys in one batch read here */
#define MPUT_RUN 256              /* small values a batch put stores per hold of the arena lock, */
#define MPUT_RUN_BYTES (256 << 10) /* and at most this many bytes of them (unless one is larger) */
#define POPULATE_MIN (1 << 20)   /* tiers/dram.py: a copy this big into a mapping not prefaulted maps its pages first */
#define FLAT_MAX 16              /* headers of 1-D arrays whose small values get builds here */
#define SHAPED_MAX 16            /* headers of ndarrays whose pinned (larger) values get builds here */
#define LAYOUT_MAX 32            /* ndarray layouts whose headers put_value knows */
#define LAYOUT_NDIM 8
#define LAYOUT_FMT 8

typedef struct {                 /* a header and how to build its values: an ndarray (and a tensor on it) */
    PyObject *meta;              /* bytes */
    PyObject *dtype;
    Py_ssize_t itemsize;
    PyObject *shape;             /* a tuple to reshape to; NULL: 1-D */
    PyObject *post;              /* shaped(): torch.from_numpy for a tensor header; NULL: an ndarray */
    PyObject *view_as;           /* shaped(): the torch dtype to view the tensor as; NULL: none */
} Flat;

typedef struct {                 /* an ndarray layout as its buffer describes it, and its codec header */
    PyObject *meta;              /* bytes; NULL: an empty entry */
    char format[LAYOUT_FMT];
    Py_ssize_t itemsize;
    int ndim;
    Py_ssize_t shape[LAYOUT_NDIM];
} Layout;

typedef struct {
    PyObject_HEAD
    __typeof__(&yr_read) read;
    __typeof__(&yr_put) put;
    __typeof__(&yr_mread) mread;
    __typeof__(&yr_unpin) unpin;
    __typeof__(&yr_mput_small) mput;
    void *base;
    unsigned int slot;
    Py_ssize_t max_key;
    uint32_t cap;
    int nflat;
    Flat flat[FLAT_MAX];
    PyObject *frombuffer;        /* numpy.frombuffer, once a header is registered */
    PyObject *ndarray;           /* numpy.ndarray, once a layout is learned */
    long pid;                    /* the process that set `slot` (views of other pids: Python releases them) */
    PyObject *anchor;            /* a weak reference to the tiers.dram.Arena that owns the mapping */
    int nshaped, next_shaped;
    Flat shaped[SHAPED_MAX];     /* ndarray headers whose pinned values get builds here */
    PyObject *bytes_meta;        /* b"B" */
    int next_layout;
    Layout layouts[LAYOUT_MAX];
} HotPath;

/* The entry of `entries` (n of them) registered for header `meta`, or NULL. */
static inline Flat *find_header(Flat *entries, int n, const char *meta, Py_ssize_t len) {
    for (int i = 0; i < n; i++)
        if (PyBytes_GET_SIZE(entries[i].meta) == len && !memcmp(PyBytes_AS_STRING(entries[i].meta), meta, (size_t)len))
            return &entries[i];
    return NULL;
}

/* fast.c */
extern PyTypeObject HotPathType;
const char *key_of(HotPath *self, PyObject *key, Py_ssize_t *klen);
typedef struct {                 /* the rows of a batch put, gathered for store_rows */
    Py_ssize_t n, held;          /* rows; views held so far (released by rows_free) */
    const char **kbs;            /* key bytes (borrowed: the caller's objects hold them) */
    uint32_t *klens;
    PyObject **metas;            /* bytes headers (borrowed) */
    Py_buffer *views;            /* payloads */
} Rows;
int rows_init(Rows *r, Py_ssize_t n);
void rows_free(Rows *r);
PyObject *store_rows(HotPath *self, const Rows *r, long long priority, double expire_at);
int batch_args(HotPath *self, PyObject *const *args, Py_ssize_t nargs, const char *usage, long long *priority,
               double *expire_at);

/* fast_values.c */
int values_ready(void);
void values_clear(HotPath *self);
PyObject *pinned_value(HotPath *self, const yr_objinfo *f, int views, int *owned);
int value_view(HotPath *self, PyObject *value, Py_buffer *view, PyObject **meta);
int put_view(HotPath *self, const char *kb, Py_ssize_t klen, PyObject *meta, const Py_buffer *view,
             int prefaulted);
PyObject *HotPath_put_value(HotPath *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *HotPath_mput_values(HotPath *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *HotPath_learn(HotPath *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *HotPath_shaped(HotPath *self, PyObject *const *args, Py_ssize_t nargs);

/* fast_wire.c */
PyObject *HotPath_mreply(HotPath *self, PyObject *const *args, Py_ssize_t nargs);
const char *plain_key(PyObject *key, Py_ssize_t max_key, Py_ssize_t *klen);
extern PyMethodDef wire_functions[];   /* module functions: MGET requests and replies of a pure client */
int round_ready(PyObject *module);    /* fast_round.c: adds round_trip, await_replies, round_stats */

/* fast_own.c: a member's clock, key locks and own ASYNC puts (see there) */
typedef struct {
    PyObject_HEAD
    unsigned long long last;     /* the latest hlc handed out or observed */
    unsigned long long writer;   /* this process's random 63-bit writer id */
} Clock;

/* KeyLock: the lock of a group of keys on a member (Node.lock(key)), a threading.Lock
 * that OwnPuts takes and gives back without calling into Python. */
typedef struct {
    PyObject_HEAD
    PyThread_type_lock lock;
} KeyLock;

typedef struct {
    PyObject_HEAD
    HotPath *hot;                /* the member's arena */
    Clock *clock;
    PyObject *versions;          /* dict: key -> (hlc, writer) */
    PyObject *tombs;             /* dict: key -> ((hlc, writer), when) */
    PyObject *single;            /* set: keys of WriteMode.NONE objects */
    PyObject *locks;             /* list of 64 KeyLock: the key's is locks[hash(key) & 63] */
    PyObject *queue;             /* the forwarder's OrderedDict: key -> (version, targets) */
    PyObject *forwarder;         /* for its _asleep flag */
    PyObject *modes;             /* tuple: the write_mode= objects that mean ASYNC here (None when the default) */
    Py_ssize_t queue_max, batch;
    int prefaulted;
    int active;                  /* this member is in the ring (Router.update keeps it) */
} OwnPuts;

extern PyTypeObject ClockType, KeyLockType, OwnPutsType;
unsigned long long clock_take(Clock *c, unsigned long long n);
int keylock_take(KeyLock *self, int blocking);
int version_parts(PyObject *v, unsigned long long *hlc, unsigned long long *writer);
int not_newer(OwnPuts *self, PyObject *key, unsigned long long hlc, unsigned long long writer);
int applied(OwnPuts *self, PyObject *key, PyObject *version);
int enqueue(OwnPuts *self, PyObject *key, PyObject *version, unsigned long long hlc, unsigned long long writer);
int own_ready(PyObject *m);            /* adds Clock, KeyLock and OwnPuts to the module */

/* fast_serve.c: a member's single PUT and GET frames (OwnPuts.serve) */
PyObject *OwnPuts_serve(OwnPuts *self, PyObject *const *args, Py_ssize_t nargs);

#endif
