/* The tier index's views, compiled: the storage of a TierEntry (tiers/_entry.py's
 * _EntryStorage is the reference, the base class where this is not built or DYN_KVBM_NATIVE=0)
 * and the loop of TierRows._views_of (tiers/index_rows.py), which hands out one view per slot
 * of a run, the live one where a caller still holds it, else a new one remembered by a weak
 * reference.
 *
 * Kept for the targets "<= 5 us per offloaded and per onboarded block on the executor thread"
 * (docs/performance.md, "What each compiled loop is for"): every block a save reserves and
 * every block a match takes gets a view, about 0.3 us each in Python (the object's __init__,
 * its weak reference and the map's entry), made here without running Python code.
 * tests/tiers/test_keytable_rows.py compares both forms.
 *
 * Called by TierRows on the leader's executor thread; no locks (the GIL is held throughout).
 * Public CPython API only. */

#include "_keytable_c.h"

#include <stddef.h>
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    PyObject *index;    /* the TierIndex whose row this views (``_index``) */
    PyObject *slot;     /* the slot, an int (``slot``) */
    PyObject *snap;     /* None while live; the values once detached (``_snap``) */
    PyObject *weaklist;
} EntryStorage;

static int es_init_fields(EntryStorage *self, PyObject *index, PyObject *slot) {
    Py_INCREF(index);
    Py_INCREF(slot);
    Py_INCREF(Py_None);
    self->index = index;
    self->slot = slot;
    self->snap = Py_None;
    return 0;
}

static PyObject *es_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"index", "slot", NULL};
    PyObject *index, *slot;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO:TierEntry", kwlist, &index, &slot))
        return NULL;
    EntryStorage *self = (EntryStorage *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    es_init_fields(self, index, slot);
    return (PyObject *)self;
}

static int es_traverse(EntryStorage *self, visitproc visit, void *arg) {
    Py_VISIT(self->index);
    Py_VISIT(self->slot);
    Py_VISIT(self->snap);
    return 0;
}

static int es_clear(EntryStorage *self) {
    Py_CLEAR(self->index);
    Py_CLEAR(self->slot);
    Py_CLEAR(self->snap);
    return 0;
}

static void es_dealloc(EntryStorage *self) {
    PyObject_GC_UnTrack(self);
    if (self->weaklist != NULL)
        PyObject_ClearWeakRefs((PyObject *)self);
    es_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef es_members[] = {
    {"_index", T_OBJECT_EX, offsetof(EntryStorage, index), 0, NULL},
    {"slot", T_OBJECT_EX, offsetof(EntryStorage, slot), 0, NULL},
    {"_snap", T_OBJECT_EX, offsetof(EntryStorage, snap), 0, NULL},
    {NULL, 0, 0, 0, NULL},
};

PyTypeObject EntryStorageType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvbm_plugin.tiers._keytable_c.EntryStorage",
    .tp_basicsize = sizeof(EntryStorage),
    .tp_dealloc = (destructor)es_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "EntryStorage(index, slot)\n\nA TierEntry's fields (``_index``, ``slot``, "
              "``_snap``: None until detached), weakly referable; the compiled base of "
              "kvbm_plugin.tiers._entry.TierEntry.",
    .tp_traverse = (traverseproc)es_traverse,
    .tp_clear = (inquiry)es_clear,
    .tp_weaklistoffset = offsetof(EntryStorage, weaklist),
    .tp_members = es_members,
    .tp_new = es_new,
};

/* The object a weak reference points at (a new reference), or NULL with no error where it
 * died; NULL with an error set where ``ref`` is not a weak reference. */
static PyObject *deref(PyObject *ref) {
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *obj;
    if (PyWeakref_GetRef(ref, &obj) < 0)
        return NULL;
    return obj;
#else
    if (!PyWeakref_Check(ref)) {
        PyErr_SetString(PyExc_TypeError, "views_of: a view map's value is not a weakref");
        return NULL;
    }
    PyObject *obj = PyWeakref_GetObject(ref);
    if (obj == Py_None)
        return NULL;
    Py_INCREF(obj);
    return obj;
#endif
}

const char views_of_doc[] =
    "views_of(views, slots, cls, index) -> list\n\n"
    "TierRows._views_of's loop: for each of ``slots`` the live view ``views`` (slot -> weakref)\n"
    "remembers, else a new ``cls`` (a subclass of EntryStorage adding no fields) viewing\n"
    "``index``'s slot, remembered in ``views``.";

PyObject *es_views_of(KeyTable *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;  /* a method of the table only so that an index uses it with a compiled table */
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "views_of takes 4 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *views = args[0], *slots = args[1], *index = args[3];
    PyTypeObject *cls = (PyTypeObject *)args[2];
    if (!PyDict_CheckExact(views) || !PyList_CheckExact(slots)) {
        PyErr_SetString(PyExc_TypeError, "views_of: views must be a dict, slots a list");
        return NULL;
    }
    if (!PyType_Check(cls) || !PyType_IsSubtype(cls, &EntryStorageType)
            || cls->tp_basicsize != EntryStorageType.tp_basicsize || cls->tp_dictoffset) {
        PyErr_SetString(PyExc_TypeError,
                        "views_of: cls must subclass EntryStorage without adding fields");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(slots);
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n && i < PyList_GET_SIZE(slots); i++) {
        /* Held across the calls below: an allocation may run a collection, and a finalizer
         * there may change the list. */
        PyObject *slot = PyList_GET_ITEM(slots, i);
        Py_INCREF(slot);
        PyObject *view = NULL;
        PyObject *ref = PyDict_GetItemWithError(views, slot);
        if (ref != NULL) {
            Py_INCREF(ref);
            view = deref(ref);
            Py_DECREF(ref);
        }
        if (view == NULL && PyErr_Occurred())
            goto fail;
        if (view == NULL) {
            EntryStorage *made = (EntryStorage *)cls->tp_alloc(cls, 0);
            if (made == NULL)
                goto fail;
            es_init_fields(made, index, slot);
            view = (PyObject *)made;
            PyObject *weak = PyWeakref_NewRef(view, NULL);
            if (weak == NULL || PyDict_SetItem(views, slot, weak) < 0) {
                Py_XDECREF(weak);
                Py_DECREF(view);
                goto fail;
            }
            Py_DECREF(weak);
        }
        Py_DECREF(slot);
        PyList_SET_ITEM(out, i, view);
        continue;
    fail:
        Py_DECREF(slot);
        Py_DECREF(out);
        return NULL;
    }
    if (PyList_GET_SIZE(slots) != n) {
        PyErr_SetString(PyExc_RuntimeError, "views_of: the slot list changed during the call");
        Py_DECREF(out);
        return NULL;
    }
    return out;
}
