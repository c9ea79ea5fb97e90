/* Shared by the compiled fast paths (_sink_c.c, consolidator/_core_c.c): each is the compiled
 * form of loops whose Python reference lives in the module of the same name, and the tests run
 * both on the same input and compare. CPython API only, plus one read of a dict's key-table
 * kind on CPython 3.11 (see unicode_keyed). */

#ifndef KVBM_NATIVE_COMMON_H
#define KVBM_NATIVE_COMMON_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* How a compiled loop ends for one event: taken whole; left untouched for the Python code
 * (which decides, raises or counts); or failed with a Python exception set (MemoryError-like,
 * never bad input). */
enum { TAKE = 0, LEAVE = 1, FAIL = -1 };

#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL

static inline int str_is(PyObject *s, PyObject *want) {
    return s == want || (PyUnicode_CheckExact(s) && PyUnicode_Compare(s, want) == 0);
}

/* Whether every key of the exact dict ``d`` is an exact str. Looking a str key up in such a
 * dict runs no Python code, whereas a key of any other type may run its own ``__eq__``, which
 * may change or free what the caller holds borrowed (the dict itself, its values, the list
 * the dict came from). The compiled loops look up only in dicts that pass this test (their
 * own maps excepted) and leave any other event to the Python code. */
/* Whether ``d`` (an exact dict) is known to hold only exact str keys without walking them.
 * CPython 3.11 keeps such a dict in a "unicode" key table and switches it to a general one
 * at its first key of another type (a str subclass included), never back; the table's kind
 * is one byte (internal header, read only). Walking the keys of every token dict was the
 * largest part of the compiled ingest loop's own work. Other versions answer 0: callers
 * walk. */
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
#define KVBM_DICT_KIND 1
#ifndef Py_BUILD_CORE
#define Py_BUILD_CORE
#define KVBM_UNDEF_BUILD_CORE
#endif
#include "internal/pycore_dict.h"
#ifdef KVBM_UNDEF_BUILD_CORE
#undef Py_BUILD_CORE
#undef KVBM_UNDEF_BUILD_CORE
#endif
static inline int unicode_keyed(PyObject *d) {
    return DK_IS_UNICODE(((PyDictObject *)d)->ma_keys);
}

/* ``d[key]`` (borrowed) for an exact dict and an interned ``key``, found by identity: 1 found,
 * 0 absent, -1 undecided (the caller looks it up by hash). Two interned strings are equal only
 * if they are the same object, so when every key of a unicode-keyed table (exact str only) is
 * interned, walking its few entries decides without hashing or comparing: the event dicts
 * TRT-LLM's serializer builds have 3-6 keys, all literals, hence interned. Reads the same
 * internal 3.11 header as unicode_keyed; runs no Python code. */
static inline int interned_item(PyObject *d, PyObject *key, PyObject **out) {
    PyDictObject *mp = (PyDictObject *)d;
    PyDictKeysObject *dk = mp->ma_keys;
    PyDictUnicodeEntry *ep;
    Py_ssize_t i, n;
    if (!DK_IS_UNICODE(dk) || mp->ma_values != NULL) return -1;
    ep = DK_UNICODE_ENTRIES(dk);
    n = dk->dk_nentries;
    for (i = 0; i < n; i++) {
        PyObject *k = ep[i].me_key;
        if (k == key) {
            *out = ep[i].me_value;
            return *out != NULL;
        }
        if (k != NULL && !PyUnicode_CHECK_INTERNED(k)) return -1;
    }
    return 0;
}
#else
static inline int unicode_keyed(PyObject *d) {
    (void)d;
    return 0;
}

static inline int interned_item(PyObject *d, PyObject *key, PyObject **out) {
    (void)d, (void)key, (void)out;
    return -1;
}
#endif

static inline int str_keys_only(PyObject *d) {
    Py_ssize_t pos = 0, left = PyDict_GET_SIZE(d);
    if (unicode_keyed(d)) return 1;
    PyObject *key, *value;
    /* ``left``: no call past the last entry (nothing can change the dict meanwhile). */
    while (left-- > 0 && PyDict_Next(d, &pos, &key, &value))
        if (!PyUnicode_CheckExact(key)) return 0;
    return 1;
}

/* Whether an exact int lies in [0, max]; never raises. */
static inline int int_in_range(PyObject *v, unsigned long long max) {
    int overflow = 0;
    long long x;
    /* Token ids and most values fit in one digit: answered without a call. */
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)v)) {
        Py_ssize_t c = PyUnstable_Long_CompactValue((PyLongObject *)v);
        return c >= 0 && (unsigned long long)c <= max;
    }
#else
    if (Py_SIZE(v) == 0) return 1;
    if (Py_SIZE(v) == 1) return (unsigned long long)((PyLongObject *)v)->ob_digit[0] <= max;
#endif
    x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow > 0 && max > (unsigned long long)LLONG_MAX) {
        unsigned long long u = PyLong_AsUnsignedLongLong(v);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        return u <= max;
    }
    if (overflow != 0) return 0;
    if (x == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return x >= 0 && (unsigned long long)x <= max;
}

/* The value of an exact int in [0, 2**32) into *out: 1, or 0 for anything else (never
 * raises). Token ids fit one digit: read without a call. */
static inline int u32_value(PyObject *v, uint32_t *out) {
    if (!PyLong_CheckExact(v)) return 0;
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)v)) {
        Py_ssize_t c = PyUnstable_Long_CompactValue((PyLongObject *)v);
        if (c < 0 || c > 0xFFFFFFFFLL) return 0;
        *out = (uint32_t)c;
        return 1;
    }
#else
    if (Py_SIZE(v) == 0) { *out = 0; return 1; }
    if (Py_SIZE(v) == 1) { *out = (uint32_t)((PyLongObject *)v)->ob_digit[0]; return 1; }
#endif
    if (!int_in_range(v, 0xFFFFFFFFULL)) return 0;
    *out = (uint32_t)PyLong_AsUnsignedLong(v);
    return 1;
}

static inline int list_extend(PyObject *list, PyObject *items) {
    Py_ssize_t n = PyList_GET_SIZE(list);
    return PyList_SetSlice(list, n, n, items);
}

/* The wire format's map keys and event tags (vLLM's field names), one copy per extension. */
static PyObject *K_type, *K_block_hashes, *K_parent_block_hash, *K_token_ids, *K_block_size,
    *K_lora_id, *K_medium, *K_lora_name, *S_BlockStored, *S_BlockRemoved, *K_extra_keys,
    *K_mm_keys, *K_cache_salt;

static inline int intern_wire_keys(void) {
    return ((K_type = PyUnicode_InternFromString("type")) == NULL
            || (K_block_hashes = PyUnicode_InternFromString("block_hashes")) == NULL
            || (K_parent_block_hash = PyUnicode_InternFromString("parent_block_hash")) == NULL
            || (K_token_ids = PyUnicode_InternFromString("token_ids")) == NULL
            || (K_block_size = PyUnicode_InternFromString("block_size")) == NULL
            || (K_lora_id = PyUnicode_InternFromString("lora_id")) == NULL
            || (K_medium = PyUnicode_InternFromString("medium")) == NULL
            || (K_lora_name = PyUnicode_InternFromString("lora_name")) == NULL
            || (K_extra_keys = PyUnicode_InternFromString("extra_keys")) == NULL
            || (K_mm_keys = PyUnicode_InternFromString("mm_keys")) == NULL
            || (K_cache_salt = PyUnicode_InternFromString("cache_salt")) == NULL
            || (S_BlockStored = PyUnicode_InternFromString("BlockStored")) == NULL
            || (S_BlockRemoved = PyUnicode_InternFromString("BlockRemoved")) == NULL) ? -1 : 0;
}

/* An empty dict with room for ``n`` keys: filling it never resizes its table. */
static inline PyObject *new_map(Py_ssize_t n) {
#if PY_VERSION_HEX < 0x030E0000
    return _PyDict_NewPresized(n);
#else
    (void)n;
    return PyDict_New();
#endif
}

/* A BlockStored wire map, keys in the order the Python code builds them (new reference). */
static inline PyObject *stored_map(PyObject *hashes, PyObject *parent, PyObject *token_ids,
                            PyObject *block_size, PyObject *lora_id, PyObject *medium,
                            PyObject *lora_name) {
    PyObject *ev = new_map(8);
    if (ev == NULL || PyDict_SetItem(ev, K_type, S_BlockStored) < 0
        || PyDict_SetItem(ev, K_block_hashes, hashes) < 0
        || PyDict_SetItem(ev, K_parent_block_hash, parent) < 0
        || PyDict_SetItem(ev, K_token_ids, token_ids) < 0
        || PyDict_SetItem(ev, K_block_size, block_size) < 0
        || PyDict_SetItem(ev, K_lora_id, lora_id) < 0
        || PyDict_SetItem(ev, K_medium, medium) < 0
        || PyDict_SetItem(ev, K_lora_name, lora_name) < 0) {
        Py_XDECREF(ev);
        return NULL;
    }
    return ev;
}

/* A BlockRemoved wire map (new reference). */
static inline PyObject *removed_map(PyObject *hashes, PyObject *medium) {
    PyObject *ev = new_map(3);
    if (ev == NULL || PyDict_SetItem(ev, K_type, S_BlockRemoved) < 0
        || PyDict_SetItem(ev, K_block_hashes, hashes) < 0
        || PyDict_SetItem(ev, K_medium, medium) < 0) {
        Py_XDECREF(ev);
        return NULL;
    }
    return ev;
}

#endif
