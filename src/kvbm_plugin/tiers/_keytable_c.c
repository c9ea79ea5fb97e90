/* The compiled form of tiers/_rows.py's KeyTable (its reference, and the fallback where this is
 * not built or DYN_KVBM_NATIVE=0): content key -> slot by linear probing over a table sized
 * once, the keys themselves in the owner's ``array('Q')`` key column. Same hash (Fibonacci),
 * same probe order, same backward-shift deletion: for any sequence of calls both return the
 * same slots (tests/tiers/test_keytable_compiled.py runs both on the same churn and compares
 * their tables).
 *
 * Kept for the target "<= 5 us per offloaded block on the executor thread" (docs/performance.md,
 * "What each compiled loop is for"): the leader's tier index looks a key up about six times per
 * offloaded block and once per onboarded block (the match), and each Python probe costs about
 * 0.4 us there.
 *
 * Called by the leader's tier index (TierRows) and the shared directory's rows on the
 * executor thread, and by nothing else; no locks (the GIL is held throughout). The key
 * column is read through the buffer protocol on every call: the owner grows it with append,
 * which may move it, and a buffer held across calls would forbid that. The table is allocated
 * with PyMem_RawCalloc, so tracemalloc counts it as it counts the Python table's array
 * (bench_tiers.py's heap per block). Public CPython API only. */

#include "_keytable_c.h"

static int parse_key(PyObject *arg, uint64_t *out) {
    if (!PyLong_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "KeyTable: key must be an int, not %.100s",
                     Py_TYPE(arg)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(arg);
    if (v == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = (uint64_t)v;
    return 0;
}

static PyObject *kt_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"capacity", "keys", NULL};
    Py_ssize_t capacity;
    PyObject *keys;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nO:KeyTable", kwlist, &capacity, &keys))
        return NULL;
    if (capacity < 0) {
        PyErr_Format(PyExc_ValueError, "KeyTable: capacity %zd is negative", capacity);
        return NULL;
    }
    /* bits = max(3, (2 * capacity).bit_length()), as the Python table sizes itself. */
    int bits = 0;
    for (size_t c = 2 * (size_t)capacity; c; c >>= 1)
        bits++;
    if (bits < 3)
        bits = 3;
    if (bits > 40) {
        PyErr_Format(PyExc_ValueError, "KeyTable: capacity %zd is too large", capacity);
        return NULL;
    }
    KeyTable *self = (KeyTable *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->size = (size_t)1 << bits;
    self->mask = self->size - 1;
    self->shift = 64 - bits;
    self->table = PyMem_RawMalloc(self->size * sizeof(int32_t));
    if (self->table == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    memset(self->table, 0xff, self->size * sizeof(int32_t)); /* every bucket -1 */
    Py_INCREF(keys);
    self->keys = keys;
    return (PyObject *)self;
}

static void kt_dealloc(KeyTable *self) {
    PyMem_RawFree(self->table);
    Py_XDECREF(self->keys);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyDoc_STRVAR(find_doc, "find(key, /) -> int\n\nThe slot holding ``key`` (a u64), or -1.");

static PyObject *kt_find(KeyTable *self, PyObject *arg) {
    uint64_t key;
    if (parse_key(arg, &key) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return NULL;
        PyErr_Clear(); /* not a u64: in no table (the Python table compares and misses) */
        return PyLong_FromLong(-1);
    }
    Keys k;
    if (keys_open(self, &k) < 0)
        return NULL;
    int err = 0;
    int32_t slot = table_find(self, &k, key, &err);
    PyBuffer_Release(&k.view);
    if (err)
        return NULL;
    return PyLong_FromLong(slot);
}

PyDoc_STRVAR(find_digests_doc,
"find_digests(digests, hi, stride, /) -> list[int]\n\n"
"The slot of each of ``digests`` (a list of 16-byte digests: the table's key is a digest's\n"
"first 8 bytes little-endian, and ``hi[stride * slot]`` must hold its last 8), or -1 (also\n"
"for a digest that is not 16 bytes). The shared directory's lookups of a run.");

static PyObject *kt_find_digests(KeyTable *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "find_digests() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    if (!PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "find_digests: digests must be a list");
        return NULL;
    }
    Py_ssize_t stride = PyLong_AsSsize_t(args[2]);
    if (stride == -1 && PyErr_Occurred())
        return NULL;
    if (stride < 1) {
        PyErr_Format(PyExc_ValueError, "find_digests: stride %zd must be >= 1", stride);
        return NULL;
    }
    Py_buffer hi;
    if (PyObject_GetBuffer(args[1], &hi, PyBUF_FORMAT) < 0)
        return NULL;
    if (hi.itemsize != 8 || hi.format == NULL || hi.format[0] != 'Q') {
        PyBuffer_Release(&hi);
        PyErr_SetString(PyExc_TypeError, "find_digests: hi must be an array('Q')");
        return NULL;
    }
    Keys k;
    if (keys_open(self, &k) < 0) {
        PyBuffer_Release(&hi);
        return NULL;
    }
    const uint64_t *his = (const uint64_t *)hi.buf;
    Py_ssize_t his_n = hi.len / 8;
    Py_ssize_t n = PyList_GET_SIZE(args[0]);
    PyObject *out = PyList_New(n);
    if (out == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *digest = PyList_GET_ITEM(args[0], i);
        int32_t slot = -1;
        if (PyBytes_Check(digest) && PyBytes_GET_SIZE(digest) == 16) {
            const unsigned char *d = (const unsigned char *)PyBytes_AS_STRING(digest);
            uint64_t lo, h;
            memcpy(&lo, d, 8);
            memcpy(&h, d + 8, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
            lo = __builtin_bswap64(lo);
            h = __builtin_bswap64(h);
#endif
            int err = 0;
            slot = table_find(self, &k, lo, &err);
            if (err) {
                Py_CLEAR(out);
                goto done;
            }
            if (slot >= 0 && (stride * (Py_ssize_t)slot >= his_n || his[stride * slot] != h))
                slot = -1;
        }
        PyObject *v = PyLong_FromLong(slot);
        if (v == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, v);
    }
done:
    PyBuffer_Release(&k.view);
    PyBuffer_Release(&hi);
    return out;
}

PyDoc_STRVAR(insert_doc,
"insert(key, slot, /)\n\nMap ``key`` (absent; ``keys[slot] == key`` already) to ``slot``.");

static PyObject *kt_insert(KeyTable *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "insert() takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    uint64_t key;
    if (parse_key(args[0], &key) < 0)
        return NULL;
    long slot = PyLong_AsLong(args[1]);
    if (slot == -1 && PyErr_Occurred())
        return NULL;
    if (slot < 0 || slot > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "KeyTable: slot %ld is not a row", slot);
        return NULL;
    }
    if (table_insert(self, key, (int32_t)slot) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(delete_doc,
"delete(key, /)\n\nForget ``key`` (present; ``keys[slot]`` still holds it).");

static PyObject *kt_delete(KeyTable *self, PyObject *arg) {
    uint64_t key;
    if (parse_key(arg, &key) < 0)
        return NULL;
    Keys k;
    if (keys_open(self, &k) < 0)
        return NULL;
    size_t mask = self->mask, i = home(self, key);
    int32_t *table = self->table;
    for (size_t probes = 0;; probes++) {
        uint64_t at;
        if (probes > self->size || table[i] < 0) {
            PyBuffer_Release(&k.view);
            PyErr_Format(PyExc_KeyError, "KeyTable: key %llu is not in the table",
                         (unsigned long long)key);
            return NULL;
        }
        if (key_at(&k, table[i], &at) < 0)
            goto fail;
        if (at == key)
            break;
        i = (i + 1) & mask;
    }
    /* Backward-shift deletion, as the Python table: move later members of the cluster whose
     * home is at or before the hole into it. */
    size_t j = i;
    for (;;) {
        table[i] = -1;
        int32_t slot;
        for (;;) {
            j = (j + 1) & mask;
            slot = table[j];
            if (slot < 0) {
                PyBuffer_Release(&k.view);
                Py_RETURN_NONE;
            }
            uint64_t at;
            if (key_at(&k, slot, &at) < 0)
                goto fail;
            size_t h = home(self, at);
            if (((j - h) & mask) >= ((j - i) & mask))
                break;
        }
        table[i] = slot;
        i = j;
    }
fail:
    PyBuffer_Release(&k.view);
    return NULL;
}

PyDoc_STRVAR(clear_doc, "clear()\n\nForget every key.");

static PyObject *kt_clear(KeyTable *self, PyObject *Py_UNUSED(ignored)) {
    memset(self->table, 0xff, self->size * sizeof(int32_t));
    Py_RETURN_NONE;
}

PyDoc_STRVAR(buckets_doc,
"buckets() -> list\n\nEvery bucket's slot (-1: empty), in table order (tests compare the two\n"
"forms with it).");

static PyObject *kt_buckets(KeyTable *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyList_New((Py_ssize_t)self->size);
    if (out == NULL)
        return NULL;
    for (size_t i = 0; i < self->size; i++) {
        PyObject *v = PyLong_FromLong(self->table[i]);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, v);
    }
    return out;
}

static PyMethodDef kt_methods[] = {
    {"find", (PyCFunction)kt_find, METH_O, find_doc},
    {"find_digests", (PyCFunction)(void (*)(void))kt_find_digests, METH_FASTCALL,
     find_digests_doc},
    {"insert", (PyCFunction)(void (*)(void))kt_insert, METH_FASTCALL, insert_doc},
    {"delete", (PyCFunction)kt_delete, METH_O, delete_doc},
    {"clear", (PyCFunction)kt_clear, METH_NOARGS, clear_doc},
    {"buckets", (PyCFunction)kt_buckets, METH_NOARGS, buckets_doc},
    {"write_rows", (PyCFunction)(void (*)(void))kt_write_rows, METH_FASTCALL, write_rows_doc},
    {"take_run", (PyCFunction)(void (*)(void))kt_take_run, METH_FASTCALL, take_run_doc},
    {"commit_run", (PyCFunction)(void (*)(void))kt_commit_run, METH_FASTCALL, commit_run_doc},
    {"views_of", (PyCFunction)(void (*)(void))es_views_of, METH_FASTCALL, views_of_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(kt_doc,
"KeyTable(capacity, keys)\n\n"
"A u64 content key -> slot map over ``keys`` (an array('Q') key column the owner writes);\n"
"the compiled form of kvbm_plugin.tiers._rows.KeyTable.");

static PyTypeObject KeyTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvbm_plugin.tiers._keytable_c.KeyTable",
    .tp_basicsize = sizeof(KeyTable),
    .tp_dealloc = (destructor)kt_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = kt_doc,
    .tp_methods = kt_methods,
    .tp_new = kt_new,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_keytable_c",
    "The tier index's key table, row loops and views, compiled (tiers/_rows.py's KeyTable, "
    "tiers/index.py and tiers/_entry.py are the references).",
    -1, NULL,
};

PyMODINIT_FUNC PyInit__keytable_c(void) {
    if (PyType_Ready(&KeyTableType) < 0 || PyType_Ready(&EntryStorageType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&KeyTableType);
    if (PyModule_AddObject(m, "KeyTable", (PyObject *)&KeyTableType) < 0) {
        Py_DECREF(&KeyTableType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&EntryStorageType);
    if (PyModule_AddObject(m, "EntryStorage", (PyObject *)&EntryStorageType) < 0) {
        Py_DECREF(&EntryStorageType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
