/* Shared by the compiled loops (events/_sink_c.c, consolidator/_core_c.c,
 * tiers/shared/_frame_c.c; _util/compiled.py loads them): each is the compiled form of loops
 * whose Python reference lives in the module of the same name, and the tests run both on the
 * same input and compare. Public CPython API only (3.10 and later; the unstable
 * tier's compact-int reads on 3.12 and later). */

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

/* A hint that ``p`` is read soon (no effect on what the code does). */
#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch(p)
#else
#define PREFETCH(p) ((void)(p))
#endif
static inline int str_is(PyObject *s, PyObject *want) {
    return s == want || (PyUnicode_CheckExact(s) && PyUnicode_Compare(s, want) == 0);
}

/* Whether every key of the exact dict ``d`` is an exact str. Looking a str key up in such a
 * dict runs no Python code, whereas a key of any other type may run its own ``__eq__``, which
 * may change or free what the caller holds borrowed (the dict itself, its values, the list
 * the dict came from). The compiled loops look up only in dicts that pass this test (their
 * own maps excepted) and leave any other event to the Python code. Walks the keys: the event
 * dicts TRT-LLM's serializer builds have 3-6. */
static inline int str_keys_only(PyObject *d) {
    Py_ssize_t pos = 0, left = PyDict_GET_SIZE(d);
    PyObject *key, *value;
    /* ``left``: no call past the last entry (nothing can change the dict meanwhile). */
    while (left-- > 0 && PyDict_Next(d, &pos, &key, &value))
        if (!PyUnicode_CheckExact(key)) return 0;
    return 1;
}

/* The values of the interned ``keys`` (``n`` of them; ``hashes`` their hashes) in the exact
 * dict ``d``, read in one walk of its entries: ``out[i]`` the borrowed value of ``keys[i]``
 * or NULL where absent. 0, or -1 when some key of ``d`` is not an exact str (no error set;
 * the caller leaves the event to the Python code). The same answer as str_keys_only and a
 * lookup per key, for the price of the walk alone: a key that is not one of ``keys`` by
 * identity is compared by its cached hash first. Runs no Python code, so the values stay
 * valid while the caller holds ``d``. */
static inline int str_dict_pick(PyObject *d, PyObject *const *keys, const Py_hash_t *hashes,
                                int n, PyObject **out) {
    Py_ssize_t pos = 0, left = PyDict_GET_SIZE(d);
    PyObject *k, *v;
    int i;
    for (i = 0; i < n; i++) out[i] = NULL;
    /* ``left``: no call past the last entry (nothing can change the dict meanwhile). */
    while (left-- > 0 && PyDict_Next(d, &pos, &k, &v)) {
        if (!PyUnicode_CheckExact(k)) return -1;
        for (i = 0; i < n && k != keys[i]; i++) {}
        if (i == n) {
            Py_hash_t h = PyObject_Hash(k); /* a str's: cached, never fails */
            for (i = 0; i < n; i++)
                if (h == hashes[i] && PyUnicode_Compare(k, keys[i]) == 0) break;
            if (i == n) continue;
        }
        out[i] = v;
    }
    return 0;
}

/* The hashes of ``n`` keys for str_dict_pick; once, at module import. */
static inline int key_hashes(PyObject *const *keys, Py_hash_t *hashes, int n) {
    for (int i = 0; i < n; i++)
        if ((hashes[i] = PyObject_Hash(keys[i])) == -1) return -1;
    return 0;
}

/* d[key] (borrowed) for an exact dict, found by walking its entries in insertion order: 1
 * found, 0 absent, -1 a key that is not an exact str came first (no error set; the caller
 * leaves the event to the Python code). For the small dicts read for one key (a token's id),
 * cheaper than str_keys_only and a lookup. The walk stops at the key: the keys after it do not
 * matter, because among keys of one hash a dict's lookup probes them in insertion order too,
 * so a lookup of ``key`` by the Python code runs no other key's ``__eq__`` either (keys of
 * other hashes are skipped by their hash). ``key`` is interned, as are the literal keys of the
 * dicts read, so the identity test usually decides; an equal str that is another object is
 * still found. */
static inline int str_keyed_item(PyObject *d, PyObject *key, PyObject **out) {
    Py_ssize_t pos = 0, len = PyUnicode_GET_LENGTH(key), left = PyDict_GET_SIZE(d);
    PyObject *k, *v;
    while (left-- > 0 && PyDict_Next(d, &pos, &k, &v)) {
        if (k == key) {
            *out = v;
            return 1;
        }
        if (!PyUnicode_CheckExact(k)) return -1;
        if (PyUnicode_GET_LENGTH(k) == len && PyUnicode_Compare(k, key) == 0) {
            *out = v;
            return 1;
        }
    }
    return 0;
}

/* Whether an exact int lies in [0, max]; never raises. */
static inline int int_in_range(PyObject *v, unsigned long long max) {
    int overflow = 0;
    long long x;
    /* Token ids and most values are compact (one digit): read without a call on 3.12+. */
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)v)) {
        Py_ssize_t c = PyUnstable_Long_CompactValue((PyLongObject *)v);
        return c >= 0 && (unsigned long long)c <= max;
    }
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
 * raises). Token ids are compact: read without a call on 3.12+. */
static inline int u32_value(PyObject *v, uint32_t *out) {
    int overflow = 0;
    long long x;
    if (!PyLong_CheckExact(v)) return 0;
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)v)) {
        Py_ssize_t c = PyUnstable_Long_CompactValue((PyLongObject *)v);
        if (c < 0 || c > 0xFFFFFFFFLL) return 0;
        *out = (uint32_t)c;
        return 1;
    }
#endif
    x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (x == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (overflow != 0 || x < 0 || x > 0xFFFFFFFFLL) return 0;
    *out = (uint32_t)x;
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

/* The wire maps' keys, in the order the Python code builds them (values None): each map is a
 * copy of one, whose values are then set. PyDict_Copy clones the key table whole, so filling
 * the copy neither inserts nor resizes. */
static PyObject *T_stored, *T_removed;

static inline PyObject *map_template(PyObject *const *keys, Py_ssize_t n) {
    PyObject *t = PyDict_New();
    for (Py_ssize_t i = 0; t != NULL && i < n; i++)
        if (PyDict_SetItem(t, keys[i], Py_None) < 0) Py_CLEAR(t);
    return t;
}

/* Interns the wire keys and builds the map templates; once, at module import. */
static inline int intern_wire_keys(void) {
    if ((K_type = PyUnicode_InternFromString("type")) == NULL
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
        || (S_BlockRemoved = PyUnicode_InternFromString("BlockRemoved")) == NULL)
        return -1;
    {
        PyObject *const stored[] = {K_type, K_block_hashes, K_parent_block_hash, K_token_ids,
                                    K_block_size, K_lora_id, K_medium, K_lora_name};
        PyObject *const removed[] = {K_type, K_block_hashes, K_medium};
        T_stored = map_template(stored, 8);
        T_removed = map_template(removed, 3);
    }
    return T_stored == NULL || T_removed == NULL ? -1 : 0;
}

/* A BlockStored wire map, keys in the order the Python code builds them (new reference). */
static inline PyObject *stored_map(PyObject *hashes, PyObject *parent, PyObject *token_ids,
                            PyObject *block_size, PyObject *lora_id, PyObject *medium,
                            PyObject *lora_name) {
    PyObject *ev = PyDict_Copy(T_stored);
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
    PyObject *ev = PyDict_Copy(T_removed);
    if (ev == NULL || PyDict_SetItem(ev, K_type, S_BlockRemoved) < 0
        || PyDict_SetItem(ev, K_block_hashes, hashes) < 0
        || PyDict_SetItem(ev, K_medium, medium) < 0) {
        Py_XDECREF(ev);
        return NULL;
    }
    return ev;
}

#endif
