/* cupy_checked.c - cudapool's malloc for CuPy's CFunctionAllocator, with
 * the NULL check in C.
 *
 * Design
 *
 * CuPy's CFunctionAllocator hands whatever its C malloc returns to CuPy's
 * memory object, NULL included: cudapool.cupy wraps the bound
 * CFunctionAllocator.malloc in a Python function that checks for NULL, a
 * Python frame per allocation. CuPy 14.1 and later call the C malloc with the
 * GIL held and check for a Python exception after it (_call_malloc is
 * "except *"), so a malloc that sets one on failure needs no wrapper: this
 * one. cudapool_cupy_malloc_checked calls cudapool_cupy_malloc; a result
 * other than NULL goes back as it is (the success path runs no Python), and
 * for NULL it calls the Python function given to init, which may collect
 * garbage and try again, returns the address, or raises (CuPy's
 * OutOfMemoryError or cudapool's error): NULL is returned only with a Python
 * exception set. An exception the current-stream function set (it returned
 * -1) is left standing.
 *
 * Compiled by cudapool.cupy on first use (cached beside the C++ class), against
 * the running Python's headers; loaded with ctypes.PyDLL. Not linked against
 * libcudapool.so: init is given cudapool_cupy_malloc's address. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>

typedef void *(*cupy_malloc_fn)(void *param, size_t size, int device);

/* Set by init, under the GIL, before the allocator is handed to CuPy. */
static cupy_malloc_fn real_malloc;
static PyObject *on_null; /* a strong reference */

/* cudapool_cupy_checked_init sets the C malloc to call and the Python
 * function called when it returns NULL (size, device) -> address or raise.
 * 0, or -1 with a Python exception set. Call with the GIL held. */
int cudapool_cupy_checked_init(void *malloc_fn, PyObject *callback) {
	if (malloc_fn == NULL || callback == NULL || !PyCallable_Check(callback)) {
		PyErr_SetString(PyExc_TypeError, "cudapool_cupy_checked_init: a C function address and a callable are needed");
		return -1;
	}
	Py_INCREF(callback);
	PyObject *old = on_null;
	on_null = callback;
	real_malloc = (cupy_malloc_fn)malloc_fn;
	Py_XDECREF(old);
	return 0;
}

/* cudapool_cupy_malloc_checked has CuPy's CFunctionAllocator malloc type;
 * CuPy calls it with the GIL held and size > 0. */
void *cudapool_cupy_malloc_checked(void *param, size_t size, int device) {
	void *p = real_malloc(param, size, device);
	if (p != NULL)
		return p;
	if (PyErr_Occurred())
		return NULL; /* the current-stream function failed: its exception stands */
	PyObject *r = PyObject_CallFunction(on_null, "ni", (Py_ssize_t)size, device);
	if (r == NULL)
		return NULL; /* the callback raised */
	p = PyLong_AsVoidPtr(r);
	Py_DECREF(r);
	if (p == NULL && !PyErr_Occurred())
		PyErr_SetString(PyExc_MemoryError, "cudapool: the allocation failed and no error was raised");
	return p;
}
