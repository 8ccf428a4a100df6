package deltabox

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"syscall"

	"connectrpc.com/connect"

	"github.com/deltabox/deltabox/errdefs"
)

// classes is THE table that turns an RPC code back into the error class the
// daemon produced (the inverse of the daemon's table). Codes the daemon never
// sends for a class map to the nearest one; anything else is ErrInternal.
var classes = map[connect.Code]error{
	connect.CodeNotFound:           errdefs.ErrNotFound,
	connect.CodeAlreadyExists:      errdefs.ErrAlreadyExists,
	connect.CodeInvalidArgument:    errdefs.ErrInvalidArgument,
	connect.CodeFailedPrecondition: errdefs.ErrFailedPrecondition,
	connect.CodeUnavailable:        errdefs.ErrUnavailable,
	connect.CodeResourceExhausted:  errdefs.ErrResourceExhausted,
	connect.CodeDeadlineExceeded:   errdefs.ErrDeadlineExceeded,
	connect.CodePermissionDenied:   errdefs.ErrPermissionDenied,
	connect.CodeUnimplemented:      errdefs.ErrUnimplemented,
	connect.CodeInternal:           errdefs.ErrInternal,
	connect.CodeUnauthenticated:    errdefs.ErrPermissionDenied,
	connect.CodeCanceled:           context.Canceled,
}

// Error is an error the daemon (or the transport) returned. Its text is the
// daemon's message; errors.Is matches its errdefs class, and errors.As finds
// the *connect.Error underneath.
type Error struct {
	msg   string
	class error
	cause *connect.Error
}

func (e *Error) Error() string { return e.msg }

// Unwrap gives the class and the connect error.
func (e *Error) Unwrap() []error { return []error{e.class, e.cause} }

// Code is the RPC code.
func (e *Error) Code() connect.Code { return e.cause.Code() }

// err converts an error of an RPC to its class.
func (c *Client) err(err error) error {
	if err == nil {
		return nil
	}
	var ce *connect.Error
	if !errors.As(err, &ce) {
		return err
	}
	if errors.Is(err, syscall.EACCES) && c.local {
		return &Error{
			msg:   fmt.Sprintf("deltabox daemon at %s: permission denied: the socket is root-only, use sudo", c.target),
			class: errdefs.ErrPermissionDenied,
			cause: ce,
		}
	}
	if unreachable(err) {
		how := "start it with `sudo deltabox serve`"
		if !c.local {
			how = "is `deltabox serve --listen` running there?"
		}
		return &Error{
			msg:   fmt.Sprintf("deltabox daemon not reachable at %s: %s (%v)", c.target, how, ce.Unwrap()),
			class: errdefs.ErrUnavailable,
			cause: ce,
		}
	}
	class, ok := classes[ce.Code()]
	if !ok {
		class = errdefs.ErrInternal
	}
	msg := ce.Message()
	if msg == "" {
		msg = ce.Code().String()
	}
	if ce.Code() == connect.CodeUnauthenticated {
		msg = fmt.Sprintf("daemon at %s refused the token: %s", c.target, msg)
	}
	return &Error{msg: msg, class: class, cause: ce}
}

// unreachable reports whether err is a failure to connect to the daemon at
// all (no socket, or nobody listening).
func unreachable(err error) bool {
	if errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ENOENT) ||
		errors.Is(err, fs.ErrNotExist) {
		return true
	}
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}
