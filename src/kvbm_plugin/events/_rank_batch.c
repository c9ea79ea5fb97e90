/* RankBatch: one data-parallel rank's batch and state, the compiled form of event_sink._Rank
 * (see _rank_batch.h and the module comment of _sink_c.c).
 *
 * The events the compiled loops take extend one "open" event, kept as C arrays, while they
 * coalesce as the Python code would coalesce them; when one does not, the open event is
 * written out as its msgpack bytes (exactly what msgspec makes of the map the Python code
 * builds: the smallest int forms, fixstr keys, keys in the map's order) at the end of a run of
 * such bytes. A run becomes one events.EncodedEvents item of the batch (an EncodedBatch list)
 * when the Python code next touches the batch or the batch is taken, and the publisher copies
 * it into the payload as it is (events.batch_payload). So neither the engine thread nor a
 * publisher thread makes, encodes or frees a Python object per event or token. The Python code
 * reads and extends the batch through ``events`` and ``last``, which first turn the open event
 * into its map; ``take()`` (flush) writes it out as bytes.
 */

#include "_rank_batch.h"

#include <string.h>
#include <structmember.h>

static PyObject *S_GPU;
static PyObject *EncodedEventsType, *EncodedBatchType; /* from kvbm_plugin.wire.events */

/* ---- msgpack writer (the forms msgspec writes: smallest int form, fixstr keys) ------------ */

static inline unsigned char *w_be(unsigned char *p, uint64_t v, int bytes) {
    for (int i = bytes - 1; i >= 0; i--) *p++ = (unsigned char)(v >> (8 * i));
    return p;
}

static inline unsigned char *w_uint(unsigned char *p, uint64_t v) {
    if (v < 128) { *p++ = (unsigned char)v; return p; }
    if (v < 256) { *p++ = 0xcc; *p++ = (unsigned char)v; return p; }
    if (v < 65536) { *p++ = 0xcd; return w_be(p, v, 2); }
    if (v <= 0xFFFFFFFFULL) { *p++ = 0xce; return w_be(p, v, 4); }
    *p++ = 0xcf;
    return w_be(p, v, 8);
}

static inline unsigned char *w_int(unsigned char *p, int64_t v) {
    if (v >= 0) return w_uint(p, (uint64_t)v);
    if (v >= -32) { *p++ = (unsigned char)(int8_t)v; return p; }
    if (v >= -128) { *p++ = 0xd0; *p++ = (unsigned char)(int8_t)v; return p; }
    if (v >= -32768) { *p++ = 0xd1; return w_be(p, (uint64_t)v, 2); }
    if (v >= -2147483648LL) { *p++ = 0xd2; return w_be(p, (uint64_t)v, 4); }
    *p++ = 0xd3;
    return w_be(p, (uint64_t)v, 8);
}

static inline unsigned char *w_array(unsigned char *p, Py_ssize_t n) {
    if (n < 16) { *p++ = (unsigned char)(0x90 | n); return p; }
    if (n < 65536) { *p++ = 0xdc; return w_be(p, (uint64_t)n, 2); }
    *p++ = 0xdd;
    return w_be(p, (uint64_t)n, 4);
}

/* A fixstr (< 32 bytes: every key and tag of the wire maps). */
#define W_STR(p, s) (*(p)++ = (unsigned char)(0xa0 | (sizeof(s) - 1)), \
                     memcpy((p), (s), sizeof(s) - 1), (p) += sizeof(s) - 1)
#define NIL 0xc0

/* Whether ``last`` is a BlockStored map that a store with ``parent``/``lora_id`` extends. */
static int extends_stored(PyObject *last, PyObject *parent, PyObject *lora_id) {
    PyObject *type, *hashes, *tail, *last_lora;
    if (last == Py_None || parent == Py_None || !PyDict_CheckExact(last)) return 0;
    type = PyDict_GetItemWithError(last, K_type);
    if (type == NULL || !str_is(type, S_BlockStored)) return PyErr_Occurred() ? -1 : 0;
    hashes = PyDict_GetItemWithError(last, K_block_hashes);
    if (hashes == NULL || !PyList_CheckExact(hashes) || PyList_GET_SIZE(hashes) == 0)
        return PyErr_Occurred() ? -1 : 0;
    tail = PyList_GET_ITEM(hashes, PyList_GET_SIZE(hashes) - 1);
    if (!PyLong_CheckExact(tail)) return 0;
    if (PyObject_RichCompareBool(tail, parent, Py_EQ) != 1) return PyErr_Occurred() ? -1 : 0;
    last_lora = PyDict_GetItemWithError(last, K_lora_id);
    if (last_lora == NULL) return PyErr_Occurred() ? -1 : 0;
    if (last_lora == lora_id) return 1;
    if (!PyLong_CheckExact(last_lora) || !PyLong_CheckExact(lora_id)) return 0;
    return PyObject_RichCompareBool(last_lora, lora_id, Py_EQ);
}

static int is_removed_map(PyObject *last) {
    PyObject *type;
    if (last == Py_None || !PyDict_CheckExact(last)) return 0;
    type = PyDict_GetItemWithError(last, K_type);
    if (type == NULL) return PyErr_Occurred() ? -1 : 0;
    return str_is(type, S_BlockRemoved);
}


/* ---- the batch ------------------------------------------------------------------------- */





int rb_grow(void **buf, Py_ssize_t *cap, Py_ssize_t need, size_t item) {
    Py_ssize_t n;
    void *p;
    if (need <= *cap) return 0;
    n = *cap ? *cap : 16;
    while (n < need) n *= 2;
    p = PyMem_Realloc(*buf, (size_t)n * item);
    if (p == NULL) { PyErr_NoMemory(); return -1; }
    *buf = p;
    *cap = n;
    return 0;
}

/* An adapter's ``lora_name`` as msgpack (identity.lora_name: "lora-<task id>", at most 25
 * characters, a fixstr). */
static unsigned char *w_lora_name(unsigned char *p, uint64_t lora) {
    char buf[32];
    int n = snprintf(buf, sizeof buf, "lora-%llu", (unsigned long long)lora);
    *p++ = (unsigned char)(0xa0 | n);
    memcpy(p, buf, (size_t)n);
    return p + n;
}

/* Write the open event out, as the msgpack of the map the Python code builds for it, at the
 * end of the run of encoded events. */
static int seal_run(RankBatch *rb) {
    Py_ssize_t nh = rb->n_hashes, nt = rb->n_tokens, j;
    unsigned char *p;
    if (rb->open == OPEN_NONE) return 0;
    if (rb_grow((void **)&rb->run, &rb->cap_run, rb->n_run + 192 + 9 * nh + 5 * nt, 1) < 0)
        return -1;
    p = (unsigned char *)rb->run + rb->n_run;
    if (rb->open == OPEN_STORED) {
        *p++ = 0x88;
        W_STR(p, "type"); W_STR(p, "BlockStored");
        W_STR(p, "block_hashes");
        p = w_array(p, nh);
        for (j = 0; j < nh; j++) p = w_int(p, rb->hashes[j]);
        W_STR(p, "parent_block_hash");
        if (rb->has_parent) p = w_int(p, rb->parent); else *p++ = NIL;
        W_STR(p, "token_ids");
        p = w_array(p, nt);
        for (j = 0; j < nt; j++) p = w_uint(p, rb->tokens[j]);
        W_STR(p, "block_size");
        p = w_uint(p, (uint64_t)rb->block_size);
        W_STR(p, "lora_id");
        if (rb->has_lora) p = w_uint(p, rb->lora); else *p++ = NIL;
        W_STR(p, "medium"); W_STR(p, "GPU");
        W_STR(p, "lora_name");
        if (rb->has_lora) p = w_lora_name(p, rb->lora); else *p++ = NIL;
    } else {
        *p++ = 0x83;
        W_STR(p, "type"); W_STR(p, "BlockRemoved");
        W_STR(p, "block_hashes");
        p = w_array(p, nh);
        for (j = 0; j < nh; j++) p = w_int(p, rb->hashes[j]);
        W_STR(p, "medium"); W_STR(p, "GPU");
    }
    rb->n_run = (Py_ssize_t)(p - (unsigned char *)rb->run);
    rb->run_events += 1;
    rb->open = OPEN_NONE;
    return 0;
}

/* Append the run of encoded events to the batch as one EncodedEvents item. */
static int flush_run(RankBatch *rb) {
    PyObject *data, *item;
    int r;
    if (rb->run_events == 0) return 0;
    data = PyBytes_FromStringAndSize(rb->run, rb->n_run);
    if (data == NULL) return -1;
    item = PyObject_CallFunction(EncodedEventsType, "Nn", data, rb->run_events);
    if (item == NULL) return -1;
    /* A tuple of bytes and int: no cycle through it, nothing for the collector to visit. */
    if (PyObject_GC_IsTracked(item)) PyObject_GC_UnTrack(item);
    r = PyList_Append(rb->events, item);
    Py_DECREF(item);
    if (r < 0) return -1;
    rb->n_run = rb->run_events = 0;
    return 0;
}

/* The open event as the map the Python code builds (new reference, untracked: it holds only
 * str, int and None and its two int lists). */
static PyObject *open_as_map(RankBatch *rb) {
    PyObject *hashes = NULL, *tokens = NULL, *parent = NULL, *lora = NULL, *name = NULL;
    PyObject *ev = NULL;
    Py_ssize_t j;
    hashes = PyList_New(rb->n_hashes);
    if (hashes == NULL) goto done;
    for (j = 0; j < rb->n_hashes; j++) {
        PyObject *h = PyLong_FromLongLong(rb->hashes[j]);
        if (h == NULL) goto done;
        PyList_SET_ITEM(hashes, j, h);
    }
    PyObject_GC_UnTrack(hashes);
    if (rb->open == OPEN_REMOVED) {
        ev = removed_map(hashes, S_GPU);
        goto done;
    }
    tokens = PyList_New(rb->n_tokens);
    if (tokens == NULL) goto done;
    for (j = 0; j < rb->n_tokens; j++) {
        PyObject *t = PyLong_FromUnsignedLong(rb->tokens[j]);
        if (t == NULL) goto done;
        PyList_SET_ITEM(tokens, j, t);
    }
    PyObject_GC_UnTrack(tokens);
    parent = rb->has_parent ? PyLong_FromLongLong(rb->parent) : Py_NewRef(Py_None);
    lora = rb->has_lora ? PyLong_FromUnsignedLongLong(rb->lora) : Py_NewRef(Py_None);
    name = rb->has_lora ? PyUnicode_FromFormat("lora-%llu", (unsigned long long)rb->lora)
                        : Py_NewRef(Py_None);
    if (parent == NULL || lora == NULL || name == NULL) goto done;
    ev = stored_map(hashes, parent, tokens, rb->block_size_obj, lora, S_GPU, name);
done:
    Py_XDECREF(hashes);
    Py_XDECREF(tokens);
    Py_XDECREF(parent);
    Py_XDECREF(lora);
    Py_XDECREF(name);
    if (ev != NULL) PyObject_GC_UnTrack(ev);
    return ev;
}

/* Turn the open event into its map at the end of the batch, as ``last``: the Python code is
 * about to read or extend the batch. */
static int seal_map(RankBatch *rb) {
    PyObject *ev;
    if (flush_run(rb) < 0) return -1;
    if (rb->open == OPEN_NONE) return 0;
    ev = open_as_map(rb);
    if (ev == NULL || PyList_Append(rb->events, ev) < 0) {
        Py_XDECREF(ev);
        return -1;
    }
    rb->open = OPEN_NONE;
    Py_SETREF(rb->last, ev);
    return 0;
}

/* Start a new open event of ``kind`` after the current one (written out) and ``last``. */
static int open_event(RankBatch *rb, int kind) {
    if (seal_run(rb) < 0) return -1;
    Py_SETREF(rb->last, Py_NewRef(Py_None));
    rb->open = kind;
    rb->n_hashes = rb->n_tokens = 0;
    rb->has_parent = rb->has_lora = 0;
    return 0;
}

static int push_hash(RankBatch *rb, int64_t h) {
    if (rb_grow((void **)&rb->hashes, &rb->cap_hashes, rb->n_hashes + 1, sizeof(int64_t)) < 0)
        return -1;
    rb->hashes[rb->n_hashes++] = h;
    return 0;
}

/* Extend ``last`` (a map the Python code built) with one stored block when it is that
 * chain's previous store with the same adapter: 1 extended, 0 not, -1 error. The objects are
 * made here only: the common path compares the open event's C values. */
static int extend_last_store(RankBatch *rb, int64_t h, int has_parent, int64_t parent,
                             int has_lora, uint64_t lora) {
    PyObject *p = NULL, *l = NULL, *hv = NULL, *lh, *lt;
    Py_ssize_t j;
    int ext = -1;
    p = has_parent ? PyLong_FromLongLong(parent) : Py_NewRef(Py_None);
    l = has_lora ? PyLong_FromUnsignedLongLong(lora) : Py_NewRef(Py_None);
    if (p == NULL || l == NULL) goto done;
    ext = extends_stored(rb->last, p, l);
    if (ext <= 0) goto done;
    ext = -1;
    lh = PyDict_GetItemWithError(rb->last, K_block_hashes);
    lt = PyDict_GetItemWithError(rb->last, K_token_ids);
    if (lh == NULL || lt == NULL || !PyList_CheckExact(lh) || !PyList_CheckExact(lt)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "BlockStored map lost its lists");
        goto done;
    }
    hv = PyLong_FromLongLong(h);
    if (hv == NULL || PyList_Append(lh, hv) < 0) goto done;
    for (j = 0; j < rb->block_size; j++) {
        PyObject *t = PyLong_FromUnsignedLong(rb->scratch[j]);
        if (t == NULL || PyList_Append(lt, t) < 0) { Py_XDECREF(t); goto done; }
        Py_DECREF(t);
    }
    ext = 1;
done:
    Py_XDECREF(p);
    Py_XDECREF(l);
    Py_XDECREF(hv);
    return ext;
}

int rb_append_store(RankBatch *rb, int64_t h, int has_parent, int64_t parent, int has_lora,
                    uint64_t lora) {
    Py_ssize_t bs = rb->block_size;
    int ext;
    if (rb->last != Py_None) {
        ext = extend_last_store(rb, h, has_parent, parent, has_lora, lora);
        if (ext != 0) return ext < 0 ? -1 : 0;
    }
    ext = rb->open == OPEN_STORED && has_parent && rb->n_hashes > 0
          && rb->hashes[rb->n_hashes - 1] == parent && rb->has_lora == has_lora
          && (!has_lora || rb->lora == lora);
    if (!ext) {
        if (open_event(rb, OPEN_STORED) < 0) return -1;
        rb->has_parent = has_parent;
        rb->parent = parent;
        rb->has_lora = has_lora;
        rb->lora = lora;
    }
    if (push_hash(rb, h) < 0
        || rb_grow((void **)&rb->tokens, &rb->cap_tokens, rb->n_tokens + bs, sizeof(uint32_t)) < 0)
        return -1;
    memcpy(rb->tokens + rb->n_tokens, rb->scratch, (size_t)bs * sizeof(uint32_t));
    rb->n_tokens += bs;
    return !ext;
}

int rb_append_removed(RankBatch *rb, const int64_t *hashes, Py_ssize_t n) {
    Py_ssize_t j;
    int ext, fresh = 0;
    if (rb->last != Py_None) {
        ext = is_removed_map(rb->last);
        if (ext < 0) return -1;
        if (ext) {
            PyObject *lh = PyDict_GetItemWithError(rb->last, K_block_hashes);
            if (lh == NULL || !PyList_CheckExact(lh)) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_RuntimeError, "BlockRemoved map lost its list");
                return -1;
            }
            for (j = 0; j < n; j++) {
                PyObject *h = PyLong_FromLongLong(hashes[j]);
                if (h == NULL || PyList_Append(lh, h) < 0) { Py_XDECREF(h); return -1; }
                Py_DECREF(h);
            }
            return 0;
        }
    }
    if (rb->open != OPEN_REMOVED) {
        if (open_event(rb, OPEN_REMOVED) < 0) return -1;
        fresh = 1;
    }
    if (rb_grow((void **)&rb->hashes, &rb->cap_hashes, rb->n_hashes + n, sizeof(int64_t)) < 0)
        return -1;
    memcpy(rb->hashes + rb->n_hashes, hashes, (size_t)n * sizeof(int64_t));
    rb->n_hashes += n;
    return fresh;
}

/* ---- RankBatch as a Python type -------------------------------------------------------- */

static int RankBatch_init(RankBatch *rb, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"block_size", NULL};
    PyObject *bs;
    Py_ssize_t n;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!", kwlist, &PyLong_Type, &bs)) return -1;
    n = PyLong_AsSsize_t(bs);
    if (n == -1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return -1;
        PyErr_Clear(); /* no token list is that long: every store goes to the Python code */
        n = PY_SSIZE_T_MAX;
    }
    if (n <= 0) {
        PyErr_Format(PyExc_ValueError, "RankBatch: block_size=%zd must be positive", n);
        return -1;
    }
    rb->block_size = n;
    Py_XSETREF(rb->block_size_obj, Py_NewRef(bs));
    PyMem_Free(rb->scratch);
    rb->scratch = NULL; /* allocated at the first store taken */
    rb->cap_scratch = 0;
    Py_XSETREF(rb->events, PyObject_CallNoArgs(EncodedBatchType));
    Py_XSETREF(rb->last, Py_NewRef(Py_None));
    Py_XSETREF(rb->suppressed, PyDict_New());
    Py_XSETREF(rb->live, PyDict_New());
    Py_XSETREF(rb->live_keys, PyDict_New());
    Py_XSETREF(rb->published, PyDict_New());
    Py_XSETREF(rb->kids, PyDict_New());
    rb->open = OPEN_NONE;
    rb->fast_hooks = 1;
    if (rb->events == NULL || rb->suppressed == NULL || rb->live == NULL
        || rb->live_keys == NULL || rb->published == NULL || rb->kids == NULL)
        return -1;
    return 0;
}

static int RankBatch_traverse(RankBatch *rb, visitproc visit, void *arg) {
    Py_VISIT(rb->events);
    Py_VISIT(rb->last);
    Py_VISIT(rb->suppressed);
    Py_VISIT(rb->live);
    Py_VISIT(rb->live_keys);
    Py_VISIT(rb->published);
    Py_VISIT(rb->kids);
    Py_VISIT(rb->fallback_store);
    Py_VISIT(rb->fallback_remove);
    Py_VISIT(rb->block_size_obj);
    return 0;
}

static int RankBatch_clear(RankBatch *rb) {
    Py_CLEAR(rb->events);
    Py_CLEAR(rb->last);
    Py_CLEAR(rb->suppressed);
    Py_CLEAR(rb->live);
    Py_CLEAR(rb->live_keys);
    Py_CLEAR(rb->published);
    Py_CLEAR(rb->kids);
    Py_CLEAR(rb->fallback_store);
    Py_CLEAR(rb->fallback_remove);
    Py_CLEAR(rb->block_size_obj);
    return 0;
}

static void RankBatch_dealloc(RankBatch *rb) {
    PyObject_GC_UnTrack(rb);
    RankBatch_clear(rb);
    PyMem_Free(rb->hashes);
    PyMem_Free(rb->tokens);
    PyMem_Free(rb->scratch);
    PyMem_Free(rb->run);
    Py_TYPE(rb)->tp_free((PyObject *)rb);
}

/* ``events`` and ``last`` as the Python code sees them: the open event turned into its map. */
static PyObject *RankBatch_get_events(RankBatch *rb, void *closure) {
    if (rb->events == NULL || seal_map(rb) < 0) return NULL;
    return Py_NewRef(rb->events);
}

static int RankBatch_set_events(RankBatch *rb, PyObject *value, void *closure) {
    if (value == NULL || !PyList_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "RankBatch.events must be a list");
        return -1;
    }
    if (seal_map(rb) < 0) return -1;
    Py_XSETREF(rb->events, Py_NewRef(value));
    return 0;
}

static PyObject *RankBatch_get_last(RankBatch *rb, void *closure) {
    if (rb->last == NULL || seal_map(rb) < 0) return NULL;
    return Py_NewRef(rb->last);
}

static int RankBatch_set_last(RankBatch *rb, PyObject *value, void *closure) {
    if (value == NULL || (value != Py_None && !PyDict_CheckExact(value))) {
        PyErr_SetString(PyExc_TypeError, "RankBatch.last must be a dict or None");
        return -1;
    }
    if (seal_map(rb) < 0) return -1;
    Py_XSETREF(rb->last, Py_NewRef(value));
    return 0;
}

static PyObject *RankBatch_get_pending(RankBatch *rb, void *closure) {
    return PyLong_FromSsize_t(PyList_GET_SIZE(rb->events) + rb->run_events
                              + (rb->open != OPEN_NONE));
}

static PyObject *RankBatch_take(RankBatch *rb, PyObject *unused) {
    PyObject *fresh = PyObject_CallNoArgs(EncodedBatchType), *out;
    if (fresh == NULL) return NULL;
    if (seal_run(rb) < 0 || flush_run(rb) < 0) { Py_DECREF(fresh); return NULL; }
    out = rb->events;
    rb->events = fresh;
    Py_SETREF(rb->last, Py_NewRef(Py_None));
    return out;
}

static PyObject *RankBatch_v2_counts(RankBatch *rb, PyObject *unused) {
    return Py_BuildValue("LLLL", rb->v2_blocks_stored, rb->v2_stores, rb->v2_blocks_removed,
                         rb->v2_removes);
}

static PyMethodDef RankBatch_methods[] = {
    {"take", (PyCFunction)RankBatch_take, METH_NOARGS,
     "take() -> EncodedBatch: the batch, every event the compiled code took written out as\n"
     "wire bytes (EncodedEvents runs); a new batch starts."},
    {"v2_store", (PyCFunction)RankBatch_v2_store, METH_O,
     "v2_store(block): V2 hook add_stored_block_event_from_block, fast path."},
    {"v2_remove", (PyCFunction)RankBatch_v2_remove, METH_O,
     "v2_remove(block_hashes): V2 hook add_removed_event, fast path."},
    {"v2_counts", (PyCFunction)RankBatch_v2_counts, METH_NOARGS,
     "v2_counts() -> (blocks_stored, stores, blocks_removed, removes) taken by the fast path."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef RankBatch_getset[] = {
    {"events", (getter)RankBatch_get_events, (setter)RankBatch_set_events,
     "The batch being built (the open event turned into its map first).", NULL},
    {"last", (getter)RankBatch_get_last, (setter)RankBatch_set_last,
     "The last map of the batch, for coalescing (the open event turned into its map first).",
     NULL},
    {"pending", (getter)RankBatch_get_pending, NULL, "Events in the batch.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef RankBatch_members[] = {
    {"suppressed", T_OBJECT_EX, offsetof(RankBatch, suppressed), 0, NULL},
    {"live", T_OBJECT_EX, offsetof(RankBatch, live), 0, NULL},
    {"live_keys", T_OBJECT_EX, offsetof(RankBatch, live_keys), 0, NULL},
    {"published", T_OBJECT_EX, offsetof(RankBatch, published), 0, NULL},
    {"kids", T_OBJECT_EX, offsetof(RankBatch, kids), 0, NULL},
    {"fallback_store", T_OBJECT, offsetof(RankBatch, fallback_store), 0, NULL},
    {"fallback_remove", T_OBJECT, offsetof(RankBatch, fallback_remove), 0, NULL},
    {"fast_hooks", T_BOOL, offsetof(RankBatch, fast_hooks), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

PyTypeObject RankBatchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvbm_plugin.events._sink_c.RankBatch",
    .tp_doc = "One data-parallel rank's batch and state (compiled form of event_sink._Rank).",
    .tp_basicsize = sizeof(RankBatch),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)RankBatch_init,
    .tp_dealloc = (destructor)RankBatch_dealloc,
    .tp_traverse = (traverseproc)RankBatch_traverse,
    .tp_clear = (inquiry)RankBatch_clear,
    .tp_methods = RankBatch_methods,
    .tp_members = RankBatch_members,
    .tp_getset = RankBatch_getset,
};

int rank_batch_ready(void) {
    PyObject *events;
    if (intern_wire_keys() < 0 || (S_GPU = PyUnicode_InternFromString("GPU")) == NULL)
        return -1;
    events = PyImport_ImportModule("kvbm_plugin.wire.events");
    if (events == NULL) return -1;
    EncodedEventsType = PyObject_GetAttrString(events, "EncodedEvents");
    EncodedBatchType = EncodedEventsType == NULL ? NULL
                       : PyObject_GetAttrString(events, "EncodedBatch");
    Py_DECREF(events);
    if (EncodedBatchType == NULL) return -1;
    return PyType_Ready(&RankBatchType);
}
