/* The response cache's vector work as three compiled calls (agent_under_test/similarity.py is the
 * reference each must agree with, and the fallback where this module was not built).
 *
 * A cache miss is on every uncached call's path. In numpy it took seven calls, each 2-4 us in a serving
 * agent (the model's forward pass leaves the caches cold), about 40 us a miss against a budget of 5 % of a
 * call (~18 us). Here a miss is two calls of well under a microsecond: unit() and scan().
 *
 * Vectors and matrices are little-endian float32 bytes (a matrix: its rows one after another); every sum
 * is a double. The module refuses to load on a big-endian host, so the numpy reference serves there.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define MAX_COLUMNS 64   /* a feature row wider than this is not a book level: refused */

/* A float32 (or raw bytes) C-contiguous buffer; 0, or -1 with an exception set. */
static int get_floats(PyObject *obj, Py_buffer *view, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *f = view->format;
    if (f != NULL && strcmp(f, "f") != 0 && strcmp(f, "<f") != 0 && strcmp(f, "=f") != 0 &&
        strcmp(f, "B") != 0) {
        PyErr_Format(PyExc_TypeError, "%s: float32 values or their bytes, not format '%s'", what, f);
        PyBuffer_Release(view);
        return -1;
    }
    if (view->len % 4 != 0) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes is not a whole number of float32", what, view->len);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static double dot(const float *a, const float *b, Py_ssize_t d)
{
    double s = 0.0;
    for (Py_ssize_t i = 0; i < d; i++)
        s += (double)a[i] * (double)b[i];
    return s;
}

PyDoc_STRVAR(unit_doc,
"unit(x, n) -> bytes\n\n"
"x: n rows of float32 features, one after another. Each column's mean over the rows is taken out (not\n"
"when n == 1) and the result divided by its norm: float32 bytes, all zeros when the norm is <= 1e-12.");

static PyObject *unit(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "unit(x, n) takes 2 arguments");
        return NULL;
    }
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    Py_buffer xb;
    if (get_floats(args[0], &xb, "unit") < 0)
        return NULL;
    Py_ssize_t count = xb.len / 4;
    if (n <= 0 || count == 0 || count % n != 0 || count / n > MAX_COLUMNS) {
        PyErr_Format(PyExc_ValueError, "unit: %zd values are not %zd rows of at most %d columns",
                     count, n, MAX_COLUMNS);
        PyBuffer_Release(&xb);
        return NULL;
    }
    Py_ssize_t k = count / n;
    PyObject *out = PyBytes_FromStringAndSize(NULL, xb.len);
    if (out == NULL) {
        PyBuffer_Release(&xb);
        return NULL;
    }
    const float *x = (const float *)xb.buf;
    float *o = (float *)PyBytes_AS_STRING(out);
    double mean[MAX_COLUMNS] = {0.0};
    if (n > 1) {
        for (Py_ssize_t r = 0; r < n; r++)
            for (Py_ssize_t c = 0; c < k; c++)
                mean[c] += x[r * k + c];
        for (Py_ssize_t c = 0; c < k; c++)
            mean[c] /= (double)n;
    }
    double sq = 0.0;
    for (Py_ssize_t i = 0; i < count; i++) {
        double v = (double)x[i] - mean[i % k];
        sq += v * v;
    }
    double norm = sqrt(sq);
    if (norm <= 1e-12) {
        memset(o, 0, (size_t)xb.len);
    } else {
        for (Py_ssize_t i = 0; i < count; i++)
            o[i] = (float)(((double)x[i] - mean[i % k]) / norm);
    }
    PyBuffer_Release(&xb);
    return out;
}

/* The matrix's rows against vec: 0 with *rows set, or -1 with an exception set (both views released). */
static int get_pair(PyObject *const *args, Py_ssize_t nargs, const char *what, Py_buffer *mb, Py_buffer *vb,
                    Py_ssize_t *rows)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "%s(matrix, vec) takes 2 arguments", what);
        return -1;
    }
    if (get_floats(args[0], mb, what) < 0)
        return -1;
    if (get_floats(args[1], vb, what) < 0) {
        PyBuffer_Release(mb);
        return -1;
    }
    if (vb->len == 0 || mb->len % vb->len != 0) {
        PyErr_Format(PyExc_ValueError, "%s: a matrix of %zd bytes is not rows of %zd", what, mb->len, vb->len);
        PyBuffer_Release(mb);
        PyBuffer_Release(vb);
        return -1;
    }
    *rows = mb->len / vb->len;
    return 0;
}

PyDoc_STRVAR(scan_doc,
"scan(matrix, vec) -> (best, similarity)\n\n"
"The first row of `matrix` (rows of len(vec) bytes) with the largest dot product with `vec`, and that\n"
"product; (-1, -inf) for no rows.");

static PyObject *scan(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    Py_buffer mb, vb;
    Py_ssize_t rows;
    if (get_pair(args, nargs, "scan", &mb, &vb, &rows) < 0)
        return NULL;
    Py_ssize_t d = vb.len / 4, best = -1;
    double top = -INFINITY;
    const float *m = (const float *)mb.buf, *v = (const float *)vb.buf;
    for (Py_ssize_t r = 0; r < rows; r++) {
        double s = dot(m + r * d, v, d);
        if (s > top || best < 0) {
            top = s;
            best = r;
        }
    }
    PyBuffer_Release(&mb);
    PyBuffer_Release(&vb);
    return Py_BuildValue("(nd)", best, top);
}

PyDoc_STRVAR(sims_doc,
"sims(matrix, vec) -> list[float]\n\n"
"Every row's dot product with `vec`, in row order.");

static PyObject *sims(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    Py_buffer mb, vb;
    Py_ssize_t rows;
    if (get_pair(args, nargs, "sims", &mb, &vb, &rows) < 0)
        return NULL;
    PyObject *out = PyList_New(rows);
    if (out != NULL) {
        Py_ssize_t d = vb.len / 4;
        const float *m = (const float *)mb.buf, *v = (const float *)vb.buf;
        for (Py_ssize_t r = 0; r < rows; r++) {
            PyObject *f = PyFloat_FromDouble(dot(m + r * d, v, d));
            if (f == NULL) {
                Py_CLEAR(out);
                break;
            }
            PyList_SET_ITEM(out, r, f);
        }
    }
    PyBuffer_Release(&mb);
    PyBuffer_Release(&vb);
    return out;
}

PyDoc_STRVAR(scan_tails_doc,
"scan_tails(rows, vec) -> (best, similarity)\n\n"
"scan() over a list of rows that each end with a vector of len(vec) bytes (a packed entry: its header, then\n"
"its vector), without slicing them out: the first row with the largest dot product and that product.\n"
"Items that are not bytes, or are no longer than vec, are passed over; (-1, -inf) when none is left.");

static PyObject *scan_tails(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "scan_tails(rows, vec) takes a list and a vector");
        return NULL;
    }
    Py_buffer vb;
    if (get_floats(args[1], &vb, "scan_tails") < 0)
        return NULL;
    Py_ssize_t width = vb.len, d = vb.len / 4, best = -1;
    double top = -INFINITY;
    const float *v = (const float *)vb.buf;
    PyObject *rows = args[0];
    for (Py_ssize_t r = 0; r < PyList_GET_SIZE(rows); r++) {
        PyObject *row = PyList_GET_ITEM(rows, r);
        if (!PyBytes_Check(row) || width == 0 || PyBytes_GET_SIZE(row) <= width)
            continue;
        /* the tail sits after a header of any length: read it unaligned */
        const char *tail = PyBytes_AS_STRING(row) + PyBytes_GET_SIZE(row) - width;
        double s = 0.0;
        for (Py_ssize_t i = 0; i < d; i++) {
            float a;
            memcpy(&a, tail + 4 * i, sizeof a);
            s += (double)a * (double)v[i];
        }
        if (s > top || best < 0) {
            top = s;
            best = r;
        }
    }
    PyBuffer_Release(&vb);
    return Py_BuildValue("(nd)", best, top);
}

static PyMethodDef methods[] = {
    {"unit", (PyCFunction)(void (*)(void))unit, METH_FASTCALL, unit_doc},
    {"scan", (PyCFunction)(void (*)(void))scan, METH_FASTCALL, scan_doc},
    {"sims", (PyCFunction)(void (*)(void))sims, METH_FASTCALL, sims_doc},
    {"scan_tails", (PyCFunction)(void (*)(void))scan_tails, METH_FASTCALL, scan_tails_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_similarity",
    "The response cache's vector work, compiled (see agent_under_test/similarity.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__similarity(void)
{
#if PY_BIG_ENDIAN
    PyErr_SetString(PyExc_ImportError, "_similarity reads little-endian float32 only");
    return NULL;
#else
    return PyModule_Create(&module);
#endif
}
