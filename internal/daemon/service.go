//go:build linux

package daemon

import (
	"context"
	"fmt"
	"io"

	"connectrpc.com/connect"

	v1 "github.com/deltabox/deltabox/api/deltabox/v1"
	"github.com/deltabox/deltabox/api/deltabox/v1/deltaboxv1connect"
	"github.com/deltabox/deltabox/errdefs"
	"github.com/deltabox/deltabox/internal/sandbox"
)

// service implements the API on a Backend. Its handlers validate, convert
// and call the backend; they return plain errors wrapping errdefs classes,
// which the edge interceptor converts to codes. Backend errors are returned
// as they are: the backend names the object in its messages.
type service struct {
	b Backend
}

var _ deltaboxv1connect.DeltaBoxServiceHandler = (*service)(nil)

func (s *service) Info(ctx context.Context, _ *connect.Request[v1.InfoRequest]) (*connect.Response[v1.InfoResponse], error) {
	si, err := s.b.SystemInfo(ctx)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&v1.InfoResponse{
		Version:     si.Version,
		Storage:     si.Storage,
		StateDir:    si.StateDir,
		Kernel:      si.Kernel,
		CgroupMode:  si.CgroupMode,
		Criu:        si.CRIU,
		Btrfs:       si.Btrfs,
		Overlay:     si.Overlay,
		IdmapMounts: si.IDMapMounts,
		Templates:   int32(si.Templates), TemplateBytes: si.TemplateBytes, TemplateBudgetBytes: si.TemplateBudget,
		Sandboxes: int32(si.Sandboxes),
		Images:    int32(si.Images),
	}), nil
}

func (s *service) CreateSandbox(ctx context.Context, req *connect.Request[v1.CreateSandboxRequest]) (*connect.Response[v1.CreateSandboxResponse], error) {
	m := req.Msg
	lim := m.GetLimits()
	if err := validImageName(m.Image, true); err != nil {
		return nil, err
	}
	if err := validEnv(m.Env); err != nil {
		return nil, err
	}
	if err := validLabels(m.Labels); err != nil {
		return nil, err
	}
	if m.Workdir != "" {
		if err := validPath("workdir", m.Workdir); err != nil {
			return nil, err
		}
	}
	if err := validLimit("memory limit", lim.GetMemoryBytes()); err != nil {
		return nil, err
	}
	if err := validLimit("pids limit", lim.GetPids()); err != nil {
		return nil, err
	}
	if err := validCPUs(lim.GetCpus()); err != nil {
		return nil, err
	}
	info, err := s.b.CreateSandbox(ctx, sandbox.Config{
		Image:   m.Image,
		Env:     m.Env,
		Workdir: m.Workdir,
		Labels:  m.Labels,
		Limits: sandbox.Limits{
			MemoryBytes: lim.GetMemoryBytes(),
			Pids:        lim.GetPids(),
			CPUs:        lim.GetCpus(),
		},
	})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&v1.CreateSandboxResponse{Sandbox: sandboxToProto(info)}), nil
}

func (s *service) GetSandbox(ctx context.Context, req *connect.Request[v1.GetSandboxRequest]) (*connect.Response[v1.GetSandboxResponse], error) {
	if err := validSandboxID(req.Msg.Id); err != nil {
		return nil, err
	}
	info, err := s.b.GetSandbox(ctx, req.Msg.Id)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&v1.GetSandboxResponse{Sandbox: sandboxToProto(info)}), nil
}

func (s *service) ListSandboxes(ctx context.Context, _ *connect.Request[v1.ListSandboxesRequest]) (*connect.Response[v1.ListSandboxesResponse], error) {
	infos, err := s.b.ListSandboxes(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]*v1.Sandbox, len(infos))
	for i, info := range infos {
		out[i] = sandboxToProto(info)
	}
	return connect.NewResponse(&v1.ListSandboxesResponse{Sandboxes: out}), nil
}

func (s *service) DeleteSandbox(ctx context.Context, req *connect.Request[v1.DeleteSandboxRequest]) (*connect.Response[v1.DeleteSandboxResponse], error) {
	if err := validSandboxID(req.Msg.Id); err != nil {
		return nil, err
	}
	if err := s.b.DeleteSandbox(ctx, req.Msg.Id, req.Msg.Force); err != nil {
		return nil, err
	}
	return connect.NewResponse(&v1.DeleteSandboxResponse{}), nil
}

func (s *service) ImportImage(ctx context.Context, stream *connect.ClientStream[v1.ImportImageRequest]) (*connect.Response[v1.ImportImageResponse], error) {
	if !stream.Receive() {
		return nil, headerMissing("import image", stream.Err())
	}
	hdr := stream.Msg().GetHeader()
	if hdr == nil {
		return nil, invalid("import image: the first message must be the header")
	}
	if err := validImageName(hdr.Name, false); err != nil {
		return nil, err
	}
	r := newStreamReader(stream, (*v1.ImportImageRequest).GetData, func(m *v1.ImportImageRequest) bool {
		_, ok := m.Msg.(*v1.ImportImageRequest_Data)
		return ok
	})
	info, err := s.b.ImportImage(ctx, hdr.Name, r)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&v1.ImportImageResponse{Image: imageToProto(info)}), nil
}

func (s *service) ListImages(ctx context.Context, _ *connect.Request[v1.ListImagesRequest]) (*connect.Response[v1.ListImagesResponse], error) {
	infos, err := s.b.ListImages(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]*v1.Image, len(infos))
	for i, info := range infos {
		out[i] = imageToProto(info)
	}
	return connect.NewResponse(&v1.ListImagesResponse{Images: out}), nil
}

func (s *service) RemoveImage(ctx context.Context, req *connect.Request[v1.RemoveImageRequest]) (*connect.Response[v1.RemoveImageResponse], error) {
	if err := validImageName(req.Msg.Name, false); err != nil {
		return nil, err
	}
	if err := s.b.RemoveImage(ctx, req.Msg.Name); err != nil {
		return nil, err
	}
	return connect.NewResponse(&v1.RemoveImageResponse{}), nil
}

// headerMissing explains an upload stream that ended before its header.
func headerMissing(op string, err error) error {
	if err != nil {
		return fmt.Errorf("%s: %w", op, err)
	}
	return invalid("%s: empty request stream", op)
}

// streamReader reads the data messages of a client stream as one byte
// stream, without buffering more than one message.
type streamReader[T any] struct {
	stream interface {
		Receive() bool
		Msg() *T
		Err() error
	}
	data   func(*T) []byte
	isData func(*T) bool
	buf    []byte
	err    error
}

func newStreamReader[T any](stream *connect.ClientStream[T], data func(*T) []byte, isData func(*T) bool) io.Reader {
	return &streamReader[T]{stream: stream, data: data, isData: isData}
}

func (r *streamReader[T]) Read(p []byte) (int, error) {
	for len(r.buf) == 0 {
		if r.err != nil {
			return 0, r.err
		}
		if !r.stream.Receive() {
			r.err = r.stream.Err()
			if r.err == nil {
				r.err = io.EOF
			}
			continue
		}
		m := r.stream.Msg()
		if !r.isData(m) {
			r.err = fmt.Errorf("unexpected message after the header: %w", errdefs.ErrInvalidArgument)
			continue
		}
		r.buf = r.data(m)
	}
	n := copy(p, r.buf)
	r.buf = r.buf[n:]
	return n, nil
}
