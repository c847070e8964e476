/* The data path client's GET reply loop for runs of plain CHUNK frames (optional accelerator
 * of kvtier.tiers.remote.data_conn.DataConn.read_reply; the Python loop is the reference).
 *
 *     recv_chunks(fd, head, have, i, n, max_chunk, targets, results, deadline, armed)
 *         -> (i, have, armed)
 *
 * Reads frames i, i+1, ... of an n-frame GET reply from blocking socket fd while each is a
 * CHUNK with no flags, index i, a body of at most max_chunk bytes and (targets given) a target
 * at least that large. Frame i's header is head[:have] plus what is still to come. Each body
 * goes into targets[i] (results gets its length) or into a fresh bytes object (results gets
 * it), read with one MSG_WAITALL recvmsg that also takes the next frame's header: one system
 * call per chunk, no Python per frame, the GIL released while it waits. It stops at the first
 * frame that is anything else, with that frame's whole header in head (have == 16), so the
 * caller's loop deals with it (its checks and error messages stay the only ones). Returns the
 * index reached, how many header bytes head holds, and the timeout now armed.
 *
 * Deadlines, as DataConn.set_deadline keeps them: `armed` is the SO_RCVTIMEO/SO_SNDTIMEO the
 * caller set (seconds). Before each call both are re-armed to what is left until `deadline`
 * (CLOCK_MONOTONIC seconds, as time.monotonic) when a call could otherwise end before it or
 * more than 10 ms after it, and after a call cut short (EAGAIN, or a short count). Past the
 * deadline: TimeoutError ("deadline passed"). EOF: ConnectionError. Other errors: OSError.
 * On an exception, results holds what was read before it; the connection is not usable.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>

#define HEADER_SIZE 16
#define CHUNK_TYPE 5

static double monotonic_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* SO_RCVTIMEO and SO_SNDTIMEO := what is left until `deadline`, when a call started now could end before it or
 * more than REARM_S after it (DataConn.set_deadline's rule). -1: an exception set. */
#define REARM_S 0.01
static int bound_by_deadline(int fd, double deadline, double *armed, int force) {
    double left = deadline - monotonic_now();
    if (left <= 0) {
        PyErr_SetString(PyExc_TimeoutError, "deadline passed");
        return -1;
    }
    if (!force && *armed >= left && *armed - left <= REARM_S)
        return 0; /* (0 armed: no timeout at all) */
    struct timeval tv;
    tv.tv_sec = (time_t)left;
    tv.tv_usec = (suseconds_t)((left - (double)tv.tv_sec) * 1e6);
    if (tv.tv_sec == 0 && tv.tv_usec == 0)
        tv.tv_usec = 1;
    /* both, as set_kernel_timeouts does: `armed` stands for the two */
    if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) != 0 ||
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    *armed = left;
    return 0;
}

/* Fill body[0:blen] with MSG_WAITALL recvmsg calls that also take what comes of head[0:hlen]
 * (the next frame's header) with it. Returns 0 with *head_got set (bytes of head received),
 * or -1 with a Python exception set. */
static int recv_parts(int fd, char *body, size_t blen, char *head, size_t hlen, double deadline,
                      double *armed, size_t *head_got) {
    size_t got = 0;
    int cut = 0; /* the last call was cut short: re-arm to what is left */
    while (got < blen || (blen == 0 && got == 0 && hlen)) { /* (an empty last body: no call) */
        if (bound_by_deadline(fd, deadline, armed, cut) < 0)
            return -1;
        struct iovec iov[2];
        int cnt = 0;
        if (got < blen) {
            iov[cnt].iov_base = body + got;
            iov[cnt].iov_len = blen - got;
            cnt++;
        }
        if (hlen) {
            iov[cnt].iov_base = head;
            iov[cnt].iov_len = hlen;
            cnt++;
        }
        struct msghdr msg;
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = iov;
        msg.msg_iovlen = cnt;
        ssize_t k;
        int err;
        Py_BEGIN_ALLOW_THREADS
        k = recvmsg(fd, &msg, MSG_WAITALL);
        err = errno;
        Py_END_ALLOW_THREADS
        if (k == 0) {
            PyErr_SetString(PyExc_ConnectionError, "node closed the data connection");
            return -1;
        }
        if (k < 0) {
            if (err == EINTR) {
                if (PyErr_CheckSignals() < 0)
                    return -1;
            } else if (err != EAGAIN && err != EWOULDBLOCK) {
                errno = err;
                PyErr_SetFromErrno(PyExc_OSError);
                return -1;
            }
            cut = 1;
            continue;
        }
        got += (size_t)k;
        cut = got < blen;
    }
    *head_got = got - blen;
    return 0;
}

static uint32_t le32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t le64(const unsigned char *p) {
    return (uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32;
}

static PyObject *recv_chunks(PyObject *self, PyObject *args) {
    int fd;
    Py_buffer head;
    Py_ssize_t have, i, n, max_chunk;
    PyObject *targets, *results;
    double deadline, armed;
    if (!PyArg_ParseTuple(args, "iw*nnnnOO!dd", &fd, &head, &have, &i, &n, &max_chunk, &targets,
                          &PyList_Type, &results, &deadline, &armed))
        return NULL;
    PyObject *out = NULL;
    if (head.len != HEADER_SIZE || have < 0 || have > HEADER_SIZE || i < 0 || n < i || max_chunk < 0) {
        PyErr_SetString(PyExc_ValueError, "recv_chunks: bad arguments");
        goto done;
    }
    Py_ssize_t ntargets = -1;
    if (targets != Py_None) {
        ntargets = PySequence_Length(targets);
        if (ntargets < 0)
            goto done;
    }
    unsigned char *h = head.buf;
    size_t head_got;
    while (i < n) {
        if (have < HEADER_SIZE) {
            if (recv_parts(fd, (char *)h + have, (size_t)(HEADER_SIZE - have), NULL, 0, deadline,
                           &armed, &head_got) < 0)
                goto done;
            have = HEADER_SIZE;
        }
        uint64_t length = le64(h + 8);
        if (h[0] != 'K' || h[1] != 'W' || h[2] != CHUNK_TYPE || h[3] != 0 ||
            le32(h + 4) != (uint32_t)i || length > (uint64_t)max_chunk)
            break; /* not a plain CHUNK for index i: the caller's loop takes it */
        int more = i + 1 < n;
        char *next = more ? (char *)h : NULL;
        size_t next_len = more ? HEADER_SIZE : 0;
        PyObject *item;
        if (ntargets >= 0) {
            if (i >= ntargets)
                break;
            PyObject *target = PySequence_GetItem(targets, i);
            if (target == NULL)
                goto done;
            Py_buffer tb;
            int r = PyObject_GetBuffer(target, &tb, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS);
            Py_DECREF(target);
            if (r < 0)
                goto done;
            if ((uint64_t)tb.len < length) {
                PyBuffer_Release(&tb);
                break; /* too small for its chunk: the caller drains it and raises */
            }
            r = recv_parts(fd, tb.buf, (size_t)length, next, next_len, deadline, &armed, &head_got);
            PyBuffer_Release(&tb);
            if (r < 0)
                goto done;
            item = PyLong_FromUnsignedLongLong(length);
        } else {
            item = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)length);
            if (item == NULL)
                goto done;
            if (recv_parts(fd, PyBytes_AS_STRING(item), (size_t)length, next, next_len, deadline,
                           &armed, &head_got) < 0) {
                Py_DECREF(item);
                goto done;
            }
        }
        if (item == NULL)
            goto done;
        int r = PyList_Append(results, item);
        Py_DECREF(item);
        if (r < 0)
            goto done;
        have = (Py_ssize_t)head_got;
        i++;
    }
    out = Py_BuildValue("nnd", i, have, armed);
done:
    PyBuffer_Release(&head);
    return out;
}

static PyMethodDef methods[] = {
    {"recv_chunks", recv_chunks, METH_VARARGS,
     "recv_chunks(fd, head, have, i, n, max_chunk, targets, results, deadline, armed) -> (i, have, armed)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvtier._replyloop",
                                    "C loop for runs of CHUNK frames in a GET reply (optional).", -1,
                                    methods};

/* The wire constants it was built with, for the test that holds them to the Python ones. */
PyMODINIT_FUNC PyInit__replyloop(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "HEADER_SIZE", HEADER_SIZE) < 0 ||
        PyModule_AddIntConstant(m, "CHUNK_TYPE", CHUNK_TYPE) < 0 ||
        PyModule_AddObject(m, "REARM_S", PyFloat_FromDouble(REARM_S)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
