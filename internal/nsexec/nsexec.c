// nsexec: the small single-threaded C part of DeltaBox, run by a constructor
// before the Go runtime starts (runc's nsexec pattern). It acts only when the
// binary was re-executed with _DELTABOX_NSEXEC set; otherwise it returns at
// once and the Go program starts normally.
//
// Modes:
//   hold  block until stdin reaches end of file, then exit 0. The daemon
//         starts a holder in a new user namespace to get a handle on that
//         namespace (for idmapped mounts) without paying for a Go runtime.
//
// The checkpoint issues grow this file (joining a tree's user namespace and a
// generation's pid namespace needs a single-threaded caller). It must stay
// small: no allocation, no threads.
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void mode_hold(void) {
	char buf[64];
	for (;;) {
		ssize_t n = read(0, buf, sizeof buf);
		if (n == 0 || (n < 0 && errno != EINTR))
			_exit(0);
	}
}

__attribute__((constructor)) static void deltabox_nsexec(void) {
	const char *mode = getenv("_DELTABOX_NSEXEC");
	if (!mode)
		return;
	if (strcmp(mode, "hold") == 0)
		mode_hold();
	dprintf(2, "deltabox: unknown nsexec mode %s\n", mode);
	_exit(125);
}
