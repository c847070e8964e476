/* The two per-key loops of a tier probe, in C (optional accelerator of kvtier.tiers.base).
 *
 * check_keys(keys: sequence, width: int) -> None
 *     ValueError unless len(key) == width for every key, TypeError for a key that is not
 *     bytes-like (kvtier.tiers.base.check_keys), wherever it is: the TypeError wins.
 * leading_run(mapping: dict, keys: sequence) -> int
 *     How many leading keys are in mapping (kvtier.tiers.base.leading_run): stops at the
 *     first miss.
 *
 * Why: a 131,072-token prompt has 512 chunk keys and every probe of every tier checks them
 * and then walks its index; in Python (set(map(len)), takewhile) each pass costs ~20 ns a key,
 * here a few. Both take any sequence (a list or tuple fast, anything else through
 * PySequence_Fast) and any mapping (an exact dict fast, else the `in` operator). The GIL is
 * held throughout: a dict lookup may run a key's __eq__. The module is optional:
 * kvtier.tiers.base falls back to the Python loops, and a test checks both agree.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *check_keys(PyObject *self, PyObject *args) {
    PyObject *keys;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "On", &keys, &width))
        return NULL;
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (seq == NULL)
        return NULL;
    /* The size and items are read afresh each time: a key's __len__ may change the list. */
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
        /* bytes is what every caller passes; anything else answers len() as in Python. */
        Py_ssize_t len;
        if (PyBytes_CheckExact(key)) {
            len = PyBytes_GET_SIZE(key);
        } else if (!PyObject_CheckBuffer(key)) {
            /* A str of 32 characters has the right len() but is no key (tiers index bytes). */
            PyErr_Format(PyExc_TypeError, "chunk keys are bytes, got %.100s", Py_TYPE(key)->tp_name);
            Py_DECREF(seq);
            return NULL;
        } else {
            Py_INCREF(key);
            len = PyObject_Size(key);
            Py_DECREF(key);
        }
        if (len < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        if (len != width) {
            /* A key that is not bytes-like anywhere in the list is the TypeError, as in Python
             * (which checks every key's type before any length): the same error class for the
             * same keys, whichever loop runs. Only on this error path: no cost to a good probe. */
            for (Py_ssize_t j = i + 1; j < PySequence_Fast_GET_SIZE(seq); j++) {
                PyObject *later = PySequence_Fast_GET_ITEM(seq, j);
                if (!PyBytes_CheckExact(later) && !PyObject_CheckBuffer(later)) {
                    PyErr_Format(PyExc_TypeError, "chunk keys are bytes, got %.100s", Py_TYPE(later)->tp_name);
                    Py_DECREF(seq);
                    return NULL;
                }
            }
            PyErr_Format(PyExc_ValueError, "chunk keys are %zd bytes, got one of %zd", width, len);
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static PyObject *leading_run(PyObject *self, PyObject *args) {
    PyObject *mapping, *keys;
    if (!PyArg_ParseTuple(args, "OO", &mapping, &keys))
        return NULL;
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (seq == NULL)
        return NULL;
    int is_dict = PyDict_CheckExact(mapping);
    Py_ssize_t hits = 0;
    /* Size and items read afresh, the key held: a key's __eq__ may change the list. */
    for (; hits < PySequence_Fast_GET_SIZE(seq); hits++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, hits);
        Py_INCREF(key);
        int found = is_dict ? PyDict_Contains(mapping, key) : PySequence_Contains(mapping, key);
        Py_DECREF(key);
        if (found < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        if (!found)
            break;
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(hits);
}

static PyMethodDef methods[] = {
    {"check_keys", check_keys, METH_VARARGS,
     "check_keys(keys, width) -> None; ValueError unless every key is width bytes long"},
    {"leading_run", leading_run, METH_VARARGS,
     "leading_run(mapping, keys) -> how many leading keys are in mapping"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvtier._probe",
                                    "C loops of a tier probe (optional).", -1, methods};

PyMODINIT_FUNC PyInit__probe(void) { return PyModule_Create(&module); }
