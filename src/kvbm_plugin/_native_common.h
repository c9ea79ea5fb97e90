/* Shared by the compiled fast paths (_event_sink_c.c, _consolidator_c.c): each is the compiled
 * form of loops whose Python reference lives in the module of the same name, and the tests run
 * both on the same input and compare. CPython API only. */

#ifndef KVBM_NATIVE_COMMON_H
#define KVBM_NATIVE_COMMON_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* How a compiled loop ends for one event: taken whole; left untouched for the Python code
 * (which decides, raises or counts); or failed with a Python exception set (MemoryError-like,
 * never bad input). */
enum { TAKE = 0, LEAVE = 1, FAIL = -1 };

#define INTERN(var, text) \
    if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL

static inline int str_is(PyObject *s, PyObject *want) {
    return s == want || (PyUnicode_CheckExact(s) && PyUnicode_Compare(s, want) == 0);
}

static inline int list_extend(PyObject *list, PyObject *items) {
    Py_ssize_t n = PyList_GET_SIZE(list);
    return PyList_SetSlice(list, n, n, items);
}

#endif
