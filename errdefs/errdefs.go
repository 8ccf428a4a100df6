// Package errdefs defines the error classes every DeltaBox error belongs to.
//
// Code anywhere in DeltaBox wraps one of these sentinels with %w; callers test
// with errors.Is. The API edge converts each class to one RPC code in a single
// table (internal/daemon), and the SDK converts the code back, so a client sees
// the same class the daemon produced. This package is public because both the
// daemon and the SDK (which must not import internal/) share it.
package errdefs

import "errors"

// The classes. Their messages are short because they are always wrapped by a
// message that names the operation and the object.
var (
	ErrNotFound           = errors.New("not found")
	ErrAlreadyExists      = errors.New("already exists")
	ErrInvalidArgument    = errors.New("invalid argument")
	ErrFailedPrecondition = errors.New("failed precondition")
	ErrUnavailable        = errors.New("unavailable")
	ErrResourceExhausted  = errors.New("resource exhausted")
	ErrDeadlineExceeded   = errors.New("deadline exceeded")
	ErrPermissionDenied   = errors.New("permission denied")
	ErrUnimplemented      = errors.New("not implemented")
	ErrInternal           = errors.New("internal")
)

// Class is the class of an error, for tables that map classes to codes.
type Class uint8

// The classes, in the order of Classify's checks.
const (
	ClassUnknown Class = iota
	ClassNotFound
	ClassAlreadyExists
	ClassInvalidArgument
	ClassFailedPrecondition
	ClassUnavailable
	ClassResourceExhausted
	ClassDeadlineExceeded
	ClassPermissionDenied
	ClassUnimplemented
	ClassInternal
)

var classes = [...]struct {
	class Class
	err   error
	name  string
}{
	{ClassNotFound, ErrNotFound, "not found"},
	{ClassAlreadyExists, ErrAlreadyExists, "already exists"},
	{ClassInvalidArgument, ErrInvalidArgument, "invalid argument"},
	{ClassFailedPrecondition, ErrFailedPrecondition, "failed precondition"},
	{ClassUnavailable, ErrUnavailable, "unavailable"},
	{ClassResourceExhausted, ErrResourceExhausted, "resource exhausted"},
	{ClassDeadlineExceeded, ErrDeadlineExceeded, "deadline exceeded"},
	{ClassPermissionDenied, ErrPermissionDenied, "permission denied"},
	{ClassUnimplemented, ErrUnimplemented, "not implemented"},
	{ClassInternal, ErrInternal, "internal"},
}

// Classify returns the class of err: the first sentinel err wraps.
func Classify(err error) Class {
	if err == nil {
		return ClassUnknown
	}
	for _, c := range classes {
		if errors.Is(err, c.err) {
			return c.class
		}
	}
	return ClassUnknown
}

// Sentinel returns the sentinel error of a class (ErrInternal for ClassUnknown).
func (c Class) Sentinel() error {
	for _, e := range classes {
		if e.class == c {
			return e.err
		}
	}
	return ErrInternal
}

func (c Class) String() string {
	for _, e := range classes {
		if e.class == c {
			return e.name
		}
	}
	return "unknown"
}

// IsNotFound and friends are shorthands for errors.Is.
func IsNotFound(err error) bool           { return errors.Is(err, ErrNotFound) }
func IsAlreadyExists(err error) bool      { return errors.Is(err, ErrAlreadyExists) }
func IsInvalidArgument(err error) bool    { return errors.Is(err, ErrInvalidArgument) }
func IsFailedPrecondition(err error) bool { return errors.Is(err, ErrFailedPrecondition) }
func IsUnavailable(err error) bool        { return errors.Is(err, ErrUnavailable) }
func IsResourceExhausted(err error) bool  { return errors.Is(err, ErrResourceExhausted) }
