/* What tiers/_keytable_c.c (the key table), tiers/_keytable_rows.c (the tier index's row
 * writes, which map their keys in the same table) and tiers/_entry_views.c (the index's
 * views) share: the table, the key column as a C array for one call, the hash, the entry
 * points the module registers. Public CPython API only. */

#ifndef KVBM_KEYTABLE_C_H
#define KVBM_KEYTABLE_C_H

#include "../_util/native_common.h"

#define GOLDEN 0x9E3779B97F4A7C15ULL

typedef struct {
    PyObject_HEAD
    int32_t *table;
    size_t size;      /* buckets, a power of two */
    size_t mask;
    int shift;
    PyObject *keys;   /* the owner's array('Q') */
} KeyTable;

/* The key column as a C array for the length of one call. */
typedef struct {
    Py_buffer view;
    const uint64_t *keys;
    Py_ssize_t n;
} Keys;

static inline int keys_open(KeyTable *self, Keys *k) {
    if (PyObject_GetBuffer(self->keys, &k->view, PyBUF_FORMAT) < 0)
        return -1;
    if (k->view.itemsize != 8 || k->view.format == NULL || k->view.format[0] != 'Q') {
        PyBuffer_Release(&k->view);
        PyErr_SetString(PyExc_TypeError, "KeyTable: the key column must be an array('Q')");
        return -1;
    }
    k->keys = (const uint64_t *)k->view.buf;
    k->n = k->view.len / 8;
    return 0;
}

static inline size_t home(const KeyTable *self, uint64_t key) {
    return (size_t)((key * GOLDEN) >> self->shift);
}

/* ``slot``'s key, or an error (a slot the key column does not have: a bug of the owner). */
static inline int key_at(const Keys *k, int32_t slot, uint64_t *out) {
    if (slot < 0 || slot >= k->n) {
        PyErr_Format(PyExc_IndexError, "KeyTable: slot %d is outside the key column (%zd rows)",
                     (int)slot, k->n);
        return -1;
    }
    *out = k->keys[slot];
    return 0;
}

/* Warm what looking ``keys`` up one after another will read: their buckets first, then the
 * key column's and ``flags``' entries of the slots those name. In a table of a million blocks
 * (tens of MB) each lookup misses the caches; warmed together, the misses overlap instead of
 * following one another. A hint only (GCC and Clang; nothing elsewhere): what the lookups
 * find does not change. */
static inline void warm_lookups(const KeyTable *self, const Keys *k, const uint8_t *flags,
                                const uint64_t *keys, Py_ssize_t n) {
#if defined(__GNUC__) || defined(__clang__)
    for (Py_ssize_t i = 0; i < n; i++)
        __builtin_prefetch(&self->table[home(self, keys[i])], 0, 1);
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t slot = self->table[home(self, keys[i])];
        if (slot >= 0 && slot < k->n) {
            __builtin_prefetch(&k->keys[slot], 0, 1);
            __builtin_prefetch(&flags[slot], 0, 1);
        }
    }
#else
    (void)self; (void)k; (void)flags; (void)keys; (void)n;
#endif
}

/* The slot holding ``key`` in ``k`` (the key column, open), or -1. */
static inline int32_t table_find(const KeyTable *self, const Keys *k, uint64_t key, int *err) {
    size_t i = home(self, key);
    for (;;) {
        int32_t slot = self->table[i];
        if (slot < 0)
            return -1;
        uint64_t at;
        if (key_at(k, slot, &at) < 0) {
            *err = 1;
            return -1;
        }
        if (at == key)
            return slot;
        i = (i + 1) & self->mask;
    }
}

/* Map ``key`` to ``slot`` (absent): -1 with RuntimeError set when the table is full. */
static inline int table_insert(KeyTable *self, uint64_t key, int32_t slot) {
    size_t i = home(self, key), probes = 0;
    while (self->table[i] >= 0) {
        if (++probes > self->size) {
            PyErr_SetString(PyExc_RuntimeError, "KeyTable: the table is full");
            return -1;
        }
        i = (i + 1) & self->mask;
    }
    self->table[i] = slot;
    return 0;
}

PyObject *kt_write_rows(KeyTable *self, PyObject *const *args, Py_ssize_t nargs);
extern const char write_rows_doc[];
PyObject *kt_take_run(KeyTable *self, PyObject *const *args, Py_ssize_t nargs);
extern const char take_run_doc[];
PyObject *kt_commit_run(KeyTable *self, PyObject *const *args, Py_ssize_t nargs);
extern const char commit_run_doc[];

/* tiers/_entry_views.c: a TierEntry's storage, and the loop handing out a run's views. */
extern PyTypeObject EntryStorageType;
PyObject *es_views_of(KeyTable *self, PyObject *const *args, Py_ssize_t nargs);
extern const char views_of_doc[];

#endif
