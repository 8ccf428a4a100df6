package deltabox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"connectrpc.com/connect"

	v1 "github.com/deltabox/deltabox/api/deltabox/v1"
)

// ImageInfo describes an image.
type ImageInfo struct {
	Name    string    `json:"name"`
	Kind    string    `json:"kind"` // host | rootfs | oci
	Created time.Time `json:"created"`
	Size    int64     `json:"size"` // bytes on disk it owns (0 for host)
	Env     []string  `json:"env,omitempty"`
}

var imageKinds = map[v1.ImageKind]string{
	v1.ImageKind_IMAGE_KIND_HOST:   "host",
	v1.ImageKind_IMAGE_KIND_ROOTFS: "rootfs",
	v1.ImageKind_IMAGE_KIND_OCI:    "oci",
}

func imageInfo(m *v1.Image) ImageInfo {
	kind, ok := imageKinds[m.GetKind()]
	if !ok {
		kind = "unknown"
	}
	info := ImageInfo{Name: m.GetName(), Kind: kind, Size: m.GetSize(), Env: m.GetEnv()}
	if m.Created != nil {
		info.Created = m.Created.AsTime()
	}
	return info
}

// ImportImage imports an image named name from r: a rootfs tarball
// (optionally gzip- or xz-compressed), a docker-save tar or an OCI layout
// tar. It streams r; nothing is buffered whole.
func (c *Client) ImportImage(ctx context.Context, name string, r io.Reader) (ImageInfo, error) {
	stream := c.rpc.ImportImage(ctx)
	send := func(m *v1.ImportImageRequest) error { return stream.Send(m) }
	err := sendStream(send,
		&v1.ImportImageRequest{Msg: &v1.ImportImageRequest_Header{Header: &v1.ImportImageHeader{Name: name}}},
		r, func(b []byte) *v1.ImportImageRequest {
			return &v1.ImportImageRequest{Msg: &v1.ImportImageRequest_Data{Data: b}}
		})
	res, cerr := stream.CloseAndReceive()
	if cerr != nil {
		return ImageInfo{}, c.err(cerr)
	}
	if err != nil {
		return ImageInfo{}, fmt.Errorf("import image %q: %w", name, err)
	}
	return imageInfo(res.Msg.Image), nil
}

// ListImages lists the images.
func (c *Client) ListImages(ctx context.Context) ([]ImageInfo, error) {
	res, err := c.rpc.ListImages(ctx, connect.NewRequest(&v1.ListImagesRequest{}))
	if err != nil {
		return nil, c.err(err)
	}
	out := make([]ImageInfo, len(res.Msg.Images))
	for i, m := range res.Msg.Images {
		out[i] = imageInfo(m)
	}
	return out, nil
}

// RemoveImage removes an imported image.
func (c *Client) RemoveImage(ctx context.Context, name string) error {
	_, err := c.rpc.RemoveImage(ctx, connect.NewRequest(&v1.RemoveImageRequest{Name: name}))
	return c.err(err)
}

// errSendReader marks an error of the local reader, not of the stream.
type errSendReader struct{ err error }

func (e errSendReader) Error() string { return "read: " + e.err.Error() }
func (e errSendReader) Unwrap() error { return e.err }

// sendStream sends header, then r in chunks. A Send that fails with io.EOF
// means the server ended the call: the caller's CloseAndReceive says why, so
// that is not an error here. It returns only errors of reading r.
func sendStream[T any](send func(*T) error, header *T, r io.Reader, data func([]byte) *T) error {
	if err := send(header); err != nil {
		return nil
	}
	buf := make([]byte, v1.ChunkSize)
	for {
		n, err := r.Read(buf)
		if n > 0 {
			if send(data(buf[:n])) != nil {
				return nil
			}
		}
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return errSendReader{err}
		}
	}
}
