/* The shared tier's payload word sums in one compiled pass: the compiled form of the torch
 * reductions in frame.py's ``_sums_torch`` (the reference, and the fallback where this is not
 * built or DYN_KVBM_NATIVE=0); tests/tiers/shared/test_frame_compiled.py runs both, and a
 * bytes-only statement of the definition, on the same input and compares. Kept for the
 * target "checking every loaded object <= 10 % of onboarding": the torch reductions take about
 * 14 % (docs/performance.md).
 *
 * Called by frame.checksum on a worker's shared-tier reader thread (every object read, before
 * any byte may reach the pool) and writer thread (sealing a staged block); never the executor
 * thread. The GIL is released for the loop: the two threads, and the engine's own Python
 * threads, run on while a page is summed.
 *
 * Definition (frame.py's docstring): the bytes as little-endian 64-bit words in rows of 64
 * words (512 bytes); S = sum of the words, W = sum of (r + 1) * rowsum_r over the rows
 * r = 0.., both mod 2**64 (unsigned arithmetic wraps, which is the definition). Public CPython
 * API only. */

#include "../../_util/native_common.h"

#include <string.h>

#define ROW_WORDS 64
#define ROW_BYTES (ROW_WORDS * 8)
#define LANES 8 /* independent sums per row: the compiler keeps them in vector registers */

static inline uint64_t load_le64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8); /* any alignment; a plain load where the target allows it */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

/* S and W over ``rows`` whole rows at ``p``. Runs without the GIL: touches only ``p``. */
static void row_sums(const unsigned char *p, Py_ssize_t rows, uint64_t *s_out,
                     uint64_t *w_out) {
    uint64_t s = 0, w = 0;
    for (Py_ssize_t r = 0; r < rows; r++) {
        const unsigned char *row = p + (size_t)r * ROW_BYTES;
        uint64_t lane[LANES] = {0};
        for (int i = 0; i < ROW_WORDS; i += LANES)
            for (int k = 0; k < LANES; k++)
                lane[k] += load_le64(row + 8 * (i + k));
        uint64_t sum = 0;
        for (int k = 0; k < LANES; k++)
            sum += lane[k];
        s += sum;
        w += (uint64_t)(r + 1) * sum;
    }
    *s_out = s;
    *w_out = w;
}

PyDoc_STRVAR(sums_doc,
"sums(buffer, /) -> (S, W)\n\n"
"The word sum and weighted row sum (frame.py's definition) of a C-contiguous bytes-like\n"
"object whose length is a whole number of 512-byte rows. The GIL is released meanwhile;\n"
"the caller keeps the memory alive and unchanged until it returns.");

static PyObject *sums(PyObject *module, PyObject *arg) {
    (void)module;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    if (view.len % ROW_BYTES != 0) {
        PyErr_Format(PyExc_ValueError,
                     "sums: buffer length %zd is not a whole number of %d-byte rows",
                     view.len, ROW_BYTES);
        PyBuffer_Release(&view);
        return NULL;
    }
    uint64_t s = 0, w = 0;
    const unsigned char *p = (const unsigned char *)view.buf;
    Py_ssize_t rows = view.len / ROW_BYTES;
    Py_BEGIN_ALLOW_THREADS
    row_sums(p, rows, &s, &w);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return Py_BuildValue("(KK)", (unsigned long long)s, (unsigned long long)w);
}

static PyMethodDef methods[] = {
    {"sums", sums, METH_O, sums_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_frame_c",
    "The shared tier's payload word sums, compiled (see frame.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__frame_c(void) {
    return PyModule_Create(&module_def);
}
