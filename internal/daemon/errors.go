package daemon

import (
	"context"
	"errors"

	"connectrpc.com/connect"

	"github.com/deltabox/deltabox/errdefs"
)

// codes is THE table that turns an error class into an RPC code. It is the
// only place in the daemon where that happens (the edge interceptor calls
// toConnect for every handler's error); the SDK has the inverse table.
// Context errors come first: a handler that gave up because its client went
// away or its deadline passed says so with the matching code.
var codes = []struct {
	err  error
	code connect.Code
}{
	{context.Canceled, connect.CodeCanceled},
	{context.DeadlineExceeded, connect.CodeDeadlineExceeded},
	{errdefs.ErrNotFound, connect.CodeNotFound},
	{errdefs.ErrAlreadyExists, connect.CodeAlreadyExists},
	{errdefs.ErrInvalidArgument, connect.CodeInvalidArgument},
	{errdefs.ErrFailedPrecondition, connect.CodeFailedPrecondition},
	{errdefs.ErrUnavailable, connect.CodeUnavailable},
	{errdefs.ErrResourceExhausted, connect.CodeResourceExhausted},
	{errdefs.ErrDeadlineExceeded, connect.CodeDeadlineExceeded},
	{errdefs.ErrPermissionDenied, connect.CodePermissionDenied},
	{errdefs.ErrUnimplemented, connect.CodeUnimplemented},
	{errdefs.ErrInternal, connect.CodeInternal},
}

// toConnect converts a handler's error to a *connect.Error whose message is
// the error's text. An error of no class that already carries a connect code
// (a failed Send or Receive on a stream) keeps it; anything else is
// Internal.
func toConnect(err error) error {
	if err == nil {
		return nil
	}
	for _, c := range codes {
		if errors.Is(err, c.err) {
			return connect.NewError(c.code, err)
		}
	}
	if ce := new(connect.Error); errors.As(err, &ce) {
		if ce == err {
			return ce
		}
		return connect.NewError(ce.Code(), err)
	}
	return connect.NewError(connect.CodeInternal, err)
}
