//go:build linux

// Package image keeps the read-only base root filesystems sandboxes start
// from: the built-in "host" image and imported ones (a rootfs tarball, or an
// OCI image as a docker-save tar or an OCI layout tar).
//
// THIS FILE IS THE AGREED API (written before the implementation): keep the
// exported names and signatures; implement them in other files.
package image

import (
	"context"
	"io"
	"time"
)

// HostImage is the name of the built-in image.
const HostImage = "host"

// Kind is how an image came to be.
type Kind uint8

const (
	KindUnknown Kind = iota
	KindHost         // built in: the host's /usr and friends under a generated /etc
	KindRootfs       // imported from a rootfs tarball
	KindOCI          // imported from an OCI image
)

func (k Kind) String() string {
	switch k {
	case KindHost:
		return "host"
	case KindRootfs:
		return "rootfs"
	case KindOCI:
		return "oci"
	}
	return "unknown"
}

// Info describes an image.
type Info struct {
	Name    string
	Kind    Kind
	Created time.Time
	Size    int64 // bytes on disk it owns (0 for host)
	// Lowers are the directories that make up the image, top first, to be
	// stacked as overlay lowers under a sandbox's layers. Their files are
	// owned by host ids as in the image (root is 0): the runtime idmaps each
	// one into the sandbox's user namespace. A lower may be "/" (the host
	// image's bottom): only the root filesystem's own mount is used, never
	// submounts, and the layers above it hide everything but the allowed
	// top-level entries with whiteouts.
	Lowers []string
	// Env is the image's default environment (PATH, ...), K=V.
	Env []string
}

// Store is the image store. It is safe for concurrent use.
type Store interface {
	// Get returns an image, ready to mount. For the host image it (re)builds
	// the generated layer when missing or stale.
	Get(ctx context.Context, name string) (Info, error)
	List(ctx context.Context) ([]Info, error)
	// Import reads a rootfs tarball (optionally gzip- or xz-compressed), a
	// docker-save tar or an OCI layout tar from r and stores it as name.
	// ErrAlreadyExists if name exists; ErrInvalidArgument for a bad name or a
	// stream that is none of those.
	Import(ctx context.Context, name string, r io.Reader) (Info, error)
	// Remove removes an imported image (ErrFailedPrecondition for "host").
	// The caller checks that no sandbox uses it.
	Remove(ctx context.Context, name string) error
}
