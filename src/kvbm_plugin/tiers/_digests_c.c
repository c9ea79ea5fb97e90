/* The tiers' chained block digests in one compiled call: ``keys``, the compiled form of
 * content_keys.py's ``_keys_py`` (the reference and the fallback where this is not built or
 * DYN_KVBM_NATIVE=0). tests/tiers/test_digests_compiled.py runs the pair, and hashlib's
 * BLAKE2b block by block, on the same input and compares. Kept for the target "<= 5 us of the
 * executor thread per offloaded and per onboarded block" (docs/performance.md): the Python
 * loop's hashlib call, digest and int conversion cost about 0.9 us per block, the hashing
 * itself about 0.3.
 *
 * Called on TensorRT-LLM's executor thread (rank 0's leader): the digests of every prompt
 * block at the match and of each newly full block at the plan; one digest per block names it
 * in the host and disk tiers (its first 8 bytes, the content key) and in the shared tier (all
 * 16). Short inputs (a few hundred bytes per block): the GIL is kept. Public CPython API
 * only. */

#include "../_util/native_common.h"

#include <stdlib.h>
#include <string.h>

static const uint64_t IV[8] = {
    0x6A09E667F3BCC908ULL, 0xBB67AE8584CAA73BULL, 0x3C6EF372FE94F82BULL,
    0xA54FF53A5F1D36F1ULL, 0x510E527FADE682D1ULL, 0x9B05688C2B3E6C1FULL,
    0x1F83D9ABFB41BD6BULL, 0x5BE0CD19137E2179ULL,
};

static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t load_le64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8); /* any alignment; a plain load where the target allows it */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline void store_le64(unsigned char *p, uint64_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    memcpy(p, &v, 8);
}

#define ROTR64(x, n) (((x) >> (n)) | ((x) << (64 - (n))))
#define G(a, b, c, d, x, y)                \
    do {                                   \
        v[a] = v[a] + v[b] + (x);          \
        v[d] = ROTR64(v[d] ^ v[a], 32);    \
        v[c] = v[c] + v[d];                \
        v[b] = ROTR64(v[b] ^ v[c], 24);    \
        v[a] = v[a] + v[b] + (y);          \
        v[d] = ROTR64(v[d] ^ v[a], 16);    \
        v[c] = v[c] + v[d];                \
        v[b] = ROTR64(v[b] ^ v[c], 63);    \
    } while (0)

/* One compression of the 128-byte block at ``p``; ``t``: bytes hashed so far, this block
 * included; ``last``: the final block. */
static void compress(uint64_t h[8], const unsigned char *p, uint64_t t, int last) {
    uint64_t v[16], m[16];
    for (int i = 0; i < 16; i++)
        m[i] = load_le64(p + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= t; /* (the counter's high word stays 0: inputs here are far below 2**64 bytes) */
    if (last)
        v[14] = ~v[14];
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC unroll 12
#endif
    for (int r = 0; r < 12; r++) {
        const uint8_t *s = SIGMA[r];
        G(0, 4, 8, 12, m[s[0]], m[s[1]]);
        G(1, 5, 9, 13, m[s[2]], m[s[3]]);
        G(2, 6, 10, 14, m[s[4]], m[s[5]]);
        G(3, 7, 11, 15, m[s[6]], m[s[7]]);
        G(0, 5, 10, 15, m[s[8]], m[s[9]]);
        G(1, 6, 11, 12, m[s[10]], m[s[11]]);
        G(2, 7, 8, 13, m[s[12]], m[s[13]]);
        G(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++)
        h[i] ^= v[i] ^ v[i + 8];
}

/* BLAKE2b of ``len`` bytes at ``msg`` from the parameter-block state ``h0`` into ``out``
 * (``outlen`` bytes). */
static void blake2b(const uint64_t h0[8], const unsigned char *msg, size_t len,
                    unsigned char *out, int outlen) {
    uint64_t h[8];
    unsigned char last[128];
    memcpy(h, h0, sizeof h);
    size_t off = 0;
    while (len - off > 128) { /* every block but the last (which may be full) */
        compress(h, msg + off, (uint64_t)(off + 128), 0);
        off += 128;
    }
    memset(last, 0, sizeof last);
    memcpy(last, msg + off, len - off);
    compress(h, last, (uint64_t)len, 1);
    unsigned char full[64];
    for (int i = 0; i < 8; i++)
        store_le64(full + 8 * i, h[i]);
    memcpy(out, full, (size_t)outlen);
}

/* The parameter-block state of BLAKE2b with a ``digest_size``-byte digest, fanout 1, depth 1,
 * personalisation ``person`` (``person_len`` <= 16 bytes, zero-padded), no key, no salt. */
static void param_state(uint64_t h0[8], Py_ssize_t digest_size, const char *person,
                        size_t person_len) {
    unsigned char p[16] = {0};
    memcpy(p, person, person_len);
    memcpy(h0, IV, 8 * sizeof(uint64_t));
    h0[0] ^= 0x01010000ULL ^ (uint64_t)digest_size;
    h0[6] ^= load_le64(p);
    h0[7] ^= load_le64(p + 8);
}

/* ``tokens`` as a fast sequence to read the full blocks ``start..`` of (``*n``: how many full
 * blocks it holds), or NULL with an exception (``what`` names the caller). A token that is not
 * an exact int is read through its __index__, which could change a list under the caller's
 * loop: a list holding one is read as a tuple of it instead (never in the engine). */
static PyObject *token_blocks(PyObject *tokens, Py_ssize_t block_size, Py_ssize_t start,
                              const char *what, Py_ssize_t *n) {
    PyObject *seq = PySequence_Fast(tokens, what);
    if (seq == NULL)
        return NULL;
    *n = PySequence_Fast_GET_SIZE(seq) / block_size;
    if (PyList_CheckExact(seq) && *n > start) {
        PyObject **all = PySequence_Fast_ITEMS(seq);
        for (Py_ssize_t i = start * block_size; i < *n * block_size; i++) {
            if (!PyLong_CheckExact(all[i])) {
                PyObject *frozen = PyList_AsTuple(seq);
                Py_DECREF(seq);
                return frozen;
            }
        }
    }
    return seq;
}

PyDoc_STRVAR(keys_doc,
"keys(parent, tokens, block_size, start, suffix, digests, /) -> list[int]\n\n"
"The content keys of the full blocks start.. of ``tokens`` along a chain (content_keys'\n"
"``chain_digest``, each key its digest's first 8 bytes read little-endian); ``parent``:\n"
"the 16-byte digest before block ``start`` (zeros for a root), ``suffix``: the salt's\n"
"bytes, or b\"\"; ``digests``: a list each block's digest is appended to, or None.");

/* content_keys.chain_digest along a chain. A block whose tokens are all u32 (every token id
 * in practice) is BLAKE2b (16-byte digest, person "kvbm-blk-u32", the parent's digest in
 * BLAKE2b's 16-byte salt field) of its tokens as little-endian u32 and ``suffix``: 32 tokens
 * are one 128-byte compression. Any other block: person "kvbm-blk", over the parent's digest,
 * its tokens as int64 and ``suffix`` (three compressions for 32 tokens). The
 * personalisations keep the two forms apart. */
static PyObject *keys(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "keys() takes 6 arguments (%zd given)", nargs);
        return NULL;
    }
    if (!PyBytes_Check(args[0]) || PyBytes_GET_SIZE(args[0]) != 16) {
        PyErr_SetString(PyExc_ValueError, "keys: parent is a 16-byte digest");
        return NULL;
    }
    Py_ssize_t block_size = PyLong_AsSsize_t(args[2]);
    if (block_size == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t start = PyLong_AsSsize_t(args[3]);
    if (start == -1 && PyErr_Occurred())
        return NULL;
    if (block_size < 1 || start < 0) {
        PyErr_Format(PyExc_ValueError, "keys: block_size %zd must be >= 1 and start %zd >= 0",
                     block_size, start);
        return NULL;
    }
    if (!PyBytes_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "keys: suffix is bytes");
        return NULL;
    }
    PyObject *collect = args[5] == Py_None ? NULL : args[5];
    if (collect != NULL && !PyList_Check(collect)) {
        PyErr_SetString(PyExc_TypeError, "keys: digests is a list or None");
        return NULL;
    }
    Py_ssize_t n;
    PyObject *seq = token_blocks(args[1], block_size, start, "keys: tokens must be a sequence",
                                 &n);
    if (seq == NULL)
        return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL || n <= start) {
        Py_DECREF(seq);
        return out;
    }
    uint64_t h_u32[8], h_i64[8], h[8];
    param_state(h_u32, 16, "kvbm-blk-u32", 12);
    param_state(h_i64, 16, "kvbm-blk", 8);
    Py_ssize_t suffix_len = PyBytes_GET_SIZE(args[4]);
    /* One buffer for the int64 form (the larger): [parent][tokens][suffix]; the u32 form
     * writes [tokens][suffix] from its start. */
    size_t wide_len = 16 + 8 * (size_t)block_size + (size_t)suffix_len;
    unsigned char *msg = PyMem_Malloc(wide_len);
    long long *values = PyMem_Malloc((size_t)block_size * sizeof(long long));
    if (msg == NULL || values == NULL) {
        PyMem_Free(msg);
        PyMem_Free(values);
        Py_DECREF(seq);
        Py_DECREF(out);
        return PyErr_NoMemory();
    }
    const char *suffix = PyBytes_AS_STRING(args[4]);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    unsigned char parent[16];
    memcpy(parent, PyBytes_AS_STRING(args[0]), 16);
    for (Py_ssize_t k = start; k < n; k++) {
        PyObject **block = items + k * block_size;
        int narrow = 1;
        for (Py_ssize_t i = 0; i < block_size; i++) {
            long long value = PyLong_AsLongLong(block[i]);
            if (value == -1 && PyErr_Occurred())
                goto fail;
            values[i] = value;
            narrow &= value >= 0 && value <= 0xFFFFFFFFLL;
        }
        size_t len;
        if (narrow) {
            for (Py_ssize_t i = 0; i < block_size; i++) {
                uint32_t v = (uint32_t)values[i];
                msg[4 * i] = (unsigned char)v;
                msg[4 * i + 1] = (unsigned char)(v >> 8);
                msg[4 * i + 2] = (unsigned char)(v >> 16);
                msg[4 * i + 3] = (unsigned char)(v >> 24);
            }
            memcpy(msg + 4 * block_size, suffix, (size_t)suffix_len);
            len = 4 * (size_t)block_size + (size_t)suffix_len;
            memcpy(h, h_u32, sizeof h);
            h[4] ^= load_le64(parent); /* the salt field: the parent's digest */
            h[5] ^= load_le64(parent + 8);
        } else {
            memcpy(msg, parent, 16);
            for (Py_ssize_t i = 0; i < block_size; i++)
                store_le64(msg + 16 + 8 * i, (uint64_t)values[i]);
            memcpy(msg + 16 + 8 * block_size, suffix, (size_t)suffix_len);
            len = wide_len;
            memcpy(h, h_i64, sizeof h);
        }
        blake2b(h, msg, len, parent, 16);
        PyObject *item = PyLong_FromUnsignedLongLong((unsigned long long)load_le64(parent));
        if (item == NULL)
            goto fail;
        int appended = PyList_Append(out, item);
        Py_DECREF(item);
        if (appended < 0)
            goto fail;
        if (collect != NULL) {
            item = PyBytes_FromStringAndSize((const char *)parent, 16);
            if (item == NULL)
                goto fail;
            appended = PyList_Append(collect, item);
            Py_DECREF(item);
            if (appended < 0)
                goto fail;
        }
    }
    PyMem_Free(msg);
    PyMem_Free(values);
    Py_DECREF(seq);
    return out;
fail:
    PyMem_Free(msg);
    PyMem_Free(values);
    Py_DECREF(seq);
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"keys", (PyCFunction)(void (*)(void))keys, METH_FASTCALL, keys_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_digests_c",
    "The tiers' chained block digests, compiled (see content_keys.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__digests_c(void) {
    return PyModule_Create(&module_def);
}
