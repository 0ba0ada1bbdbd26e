// SPDX-License-Identifier: Apache-2.0

package main

// The exports behind tags, pause and resume (include/cudapool.h, "Pause and
// resume by tag"). The tag stack itself is C's (cudapool.c): a push asks
// Go for the tag's id here, and every malloc passes the id on
// (cpgo_malloc_ctx); the rules are allocator/tags.go's and pause.go's.

/*
#include "capi.h"
*/
import "C"

// tagName converts a tag from C: NULL is every tag (""); an empty string
// is an error, recorded.
func tagName(fn string, tag *C.char) (string, bool) {
	if tag == nil {
		return "", true
	}
	s := C.GoString(tag)
	if s == "" {
		failf(fn, "the tag is empty (NULL names every tag)")
		return "", false
	}
	return s, true
}

// cpgo_tag_id returns the id of the tag named name (naming it on its first
// use), or 0 after recording the error.
//
//export cpgo_tag_id
func cpgo_tag_id(name *C.char) (id C.uint32_t) {
	const fn = "cudapool_tag_push"
	defer guard(fn)
	a := ready(fn)
	if a == nil {
		return 0
	}
	if name == nil {
		failf(fn, "the tag is NULL")
		return 0
	}
	n, err := a.TagID(C.GoString(name))
	if err != nil {
		fail(fn, err)
		return 0
	}
	return C.uint32_t(n)
}

//export cpgo_pause
func cpgo_pause(tag *C.char, keep C.int) (rc C.int) {
	const fn = "cudapool_pause"
	rc = -1
	defer guard(fn)
	a := ready(fn)
	if a == nil {
		return -1
	}
	name, ok := tagName(fn, tag)
	if !ok {
		return -1
	}
	return result(fn, a.Pause(name, keep != 0))
}

//export cpgo_resume
func cpgo_resume(tag *C.char) (rc C.int) {
	const fn = "cudapool_resume"
	rc = -1
	defer guard(fn)
	a := ready(fn)
	if a == nil {
		return -1
	}
	name, ok := tagName(fn, tag)
	if !ok {
		return -1
	}
	return result(fn, a.Resume(name))
}

//export cpgo_paused_bytes
func cpgo_paused_bytes(dev C.int) (n C.longlong) {
	const fn = "cudapool_paused_bytes"
	n = -1
	defer guard(fn)
	a := ready(fn)
	if a == nil {
		return -1
	}
	b, err := a.PausedBytes(int(dev))
	if err != nil {
		fail(fn, err)
		return -1
	}
	return C.longlong(b)
}

//export cpgo_release_host_memory
func cpgo_release_host_memory() (rc C.int) {
	const fn = "cudapool_release_host_memory"
	rc = -1
	defer guard(fn)
	a := ready(fn)
	if a == nil {
		return -1
	}
	_, err := a.ReleaseHostMemory()
	return result(fn, err)
}
