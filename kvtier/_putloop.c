/* kvtier-server's receive loop for runs of plain PUT frames (optional accelerator of
 * kvtier.server.put_run; the data plane's Python path is the reference).
 *
 *     bind_hash(path) -> bool
 *     recv_puts(fd, head, have, keys, slots, put_type, hash_from) -> (items, have)
 *
 * bind_hash: look up XXH3_64bits (the runtime-dispatched build where there is one) in the
 * already-loaded shared object at `path` (the xxhash package's extension, whose symbols are
 * not global). recv_puts refuses to run before it succeeded; the caller checks that the bound
 * function agrees with xxhash.xxh3_64_intdigest before it relies on it.
 *
 * recv_puts reads the frames of a PUT batch that follow one whose MORE flag was set, from
 * blocking socket fd, while each is a PUT with no flags but MORE/PARENT whose chunk fits the
 * next slot: its keys go to keys[64*j:], its chunk to slots[j] and, in the same MSG_WAITALL
 * recvmsg, the next frame's header to head when MORE is set. The GIL is released for each
 * frame's receive and for xxh3 of chunk[hash_from:] (0 for a shorter chunk), computed here
 * while the chunk is still in cache. It stops after a frame without MORE (have = 0: the batch
 * ended), when the slots are used up, or at a header it does not take (have = HEADER_SIZE and
 * the header in head: the caller's reader deals with it, so its checks and error messages stay
 * the only ones). items: one (flags, count, length, hash) per frame received, `length` the
 * whole body. Nothing here validates a chunk: the caller verifies each against its hash.
 * Errors: EOF -> ConnectionError; a socket error (SO_RCVTIMEO expiry included) -> OSError.
 * After an exception the items received are lost and the connection is not usable.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>

#define HEADER_SIZE 16
#define KEY_BYTES 32
#define FLAG_MORE 1
#define FLAG_PARENT 2

typedef uint64_t (*xxh3_fn)(const void *, size_t);
static xxh3_fn xxh3 = NULL;

static PyObject *bind_hash(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path))
        return NULL;
    /* RTLD_NOLOAD: only an object Python has imported already; nothing new is loaded. */
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL)
        Py_RETURN_FALSE;
    void *fn = dlsym(lib, "XXH3_64bits_dispatch");
    if (fn == NULL)
        fn = dlsym(lib, "XXH3_64bits");
    if (fn == NULL)
        Py_RETURN_FALSE;
    xxh3 = (xxh3_fn)fn; /* the handle stays open: the module it belongs to is never unloaded */
    Py_RETURN_TRUE;
}

static PyObject *hash(PyObject *self, PyObject *args) {
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "y*", &data))
        return NULL;
    if (xxh3 == NULL) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_RuntimeError, "bind_hash has not succeeded");
        return NULL;
    }
    uint64_t h = xxh3(data.buf, (size_t)data.len);
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLongLong(h);
}

static uint64_t le64(const unsigned char *p) {
    uint64_t v = 0;
    for (int k = 7; k >= 0; k--)
        v = v << 8 | p[k];
    return v;
}

/* Receive iov[0..cnt) whole with MSG_WAITALL recvmsg calls, then (hash_len > 0) hash
 * hash_at[0:hash_len]; the GIL released throughout but for a signal check. 0, or -1 with an
 * exception set. */
static int recv_all(int fd, struct iovec *iov, int cnt, const char *hash_at, size_t hash_len,
                    uint64_t *digest) {
    for (;;) {
        ssize_t k = 0;
        int err = 0;
        Py_BEGIN_ALLOW_THREADS
        while (cnt > 0) {
            struct msghdr msg;
            memset(&msg, 0, sizeof msg);
            msg.msg_iov = iov;
            msg.msg_iovlen = cnt;
            k = recvmsg(fd, &msg, MSG_WAITALL);
            if (k <= 0) {
                err = errno;
                break;
            }
            while (cnt > 0 && (size_t)k >= iov->iov_len) { /* drop what is full */
                k -= (ssize_t)iov->iov_len;
                iov++;
                cnt--;
            }
            if (cnt > 0) {
                iov->iov_base = (char *)iov->iov_base + k;
                iov->iov_len -= (size_t)k;
            }
        }
        if (cnt == 0 && hash_len)
            *digest = xxh3(hash_at, hash_len);
        Py_END_ALLOW_THREADS
        if (cnt == 0)
            return 0;
        if (k == 0) {
            PyErr_SetString(PyExc_ConnectionError, "peer closed the connection");
            return -1;
        }
        if (err != EINTR) {
            errno = err;
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        if (PyErr_CheckSignals() < 0)
            return -1;
    }
}

static PyObject *recv_puts(PyObject *self, PyObject *args) {
    int fd, put_type;
    Py_buffer head, keys;
    Py_ssize_t have, hash_from;
    PyObject *slots;
    if (!PyArg_ParseTuple(args, "iw*nw*O!in", &fd, &head, &have, &keys, &PyList_Type, &slots,
                          &put_type, &hash_from))
        return NULL;
    PyObject *items = NULL, *out = NULL;
    Py_ssize_t nslots = PyList_GET_SIZE(slots);
    if (xxh3 == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "recv_puts: bind_hash has not succeeded");
        goto done;
    }
    if (head.len != HEADER_SIZE || have < 0 || have > HEADER_SIZE || hash_from < 0 ||
        keys.len < nslots * 2 * KEY_BYTES) {
        PyErr_SetString(PyExc_ValueError, "recv_puts: bad arguments");
        goto done;
    }
    items = PyList_New(0);
    if (items == NULL)
        goto done;
    unsigned char *h = head.buf;
    for (Py_ssize_t j = 0; j < nslots; j++) {
        struct iovec iov[3];
        uint64_t digest = 0;
        if (have < HEADER_SIZE) {
            iov[0].iov_base = h + have;
            iov[0].iov_len = (size_t)(HEADER_SIZE - have);
            if (recv_all(fd, iov, 1, NULL, 0, &digest) < 0)
                goto done;
            have = HEADER_SIZE;
        }
        int flags = h[3];
        uint32_t count = (uint32_t)h[4] | (uint32_t)h[5] << 8 | (uint32_t)h[6] << 16 | (uint32_t)h[7] << 24;
        uint64_t length = le64(h + 8);
        size_t keylen = flags & FLAG_PARENT ? 2 * KEY_BYTES : KEY_BYTES;
        Py_buffer slot;
        if (PyObject_GetBuffer(PyList_GET_ITEM(slots, j), &slot, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        if (h[0] != 'K' || h[1] != 'W' || h[2] != put_type || (flags & ~(FLAG_MORE | FLAG_PARENT)) ||
            length <= keylen || length - keylen > (uint64_t)slot.len) {
            PyBuffer_Release(&slot);
            break; /* not one this loop takes: the caller's reader gets the header */
        }
        size_t chunk = (size_t)(length - keylen);
        int more = flags & FLAG_MORE;
        iov[0].iov_base = (char *)keys.buf + j * 2 * KEY_BYTES;
        iov[0].iov_len = keylen;
        iov[1].iov_base = slot.buf;
        iov[1].iov_len = chunk;
        iov[2].iov_base = h;
        iov[2].iov_len = HEADER_SIZE;
        size_t hash_len = chunk > (size_t)hash_from ? chunk - (size_t)hash_from : 0;
        int r = recv_all(fd, iov, more ? 3 : 2, (char *)slot.buf + hash_from, hash_len, &digest);
        PyBuffer_Release(&slot);
        if (r < 0)
            goto done;
        PyObject *item = Py_BuildValue("iIKK", flags, count, (unsigned long long)length,
                                       (unsigned long long)digest);
        if (item == NULL || PyList_Append(items, item) < 0) {
            Py_XDECREF(item);
            goto done;
        }
        Py_DECREF(item);
        have = more ? HEADER_SIZE : 0;
        if (!more)
            break;
    }
    out = Py_BuildValue("On", items, have);
done:
    Py_XDECREF(items);
    PyBuffer_Release(&head);
    PyBuffer_Release(&keys);
    return out;
}

static PyMethodDef methods[] = {
    {"bind_hash", bind_hash, METH_VARARGS, "bind_hash(path) -> bool"},
    {"hash", hash, METH_VARARGS, "hash(data) -> int: the bound XXH3_64bits of data"},
    {"recv_puts", recv_puts, METH_VARARGS,
     "recv_puts(fd, head, have, keys, slots, put_type, hash_from) -> (items, have)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvtier._putloop",
                                    "C loop for runs of PUT frames on the server (optional).", -1,
                                    methods};

/* The wire constants it was built with, for the test that holds them to the Python ones. */
PyMODINIT_FUNC PyInit__putloop(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "HEADER_SIZE", HEADER_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "KEY_BYTES", KEY_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "MORE", FLAG_MORE) < 0 ||
        PyModule_AddIntConstant(m, "PARENT", FLAG_PARENT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
