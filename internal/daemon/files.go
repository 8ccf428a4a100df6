//go:build linux

package daemon

import (
	"context"

	"connectrpc.com/connect"

	v1 "github.com/deltabox/deltabox/api/deltabox/v1"
	"github.com/deltabox/deltabox/internal/safefs"
)

// The file handlers open the sandbox's root with Backend.Files for the
// duration of one call; safefs confines every path to it.

// write says the call may change the filesystem.
func (s *service) root(ctx context.Context, id, what, path string, write bool) (*safefs.Root, func(), error) {
	if err := validSandboxID(id); err != nil {
		return nil, nil, err
	}
	if err := validPath(what, path); err != nil {
		return nil, nil, err
	}
	return s.b.Files(ctx, id, write)
}

func (s *service) ReadFile(ctx context.Context, req *connect.Request[v1.ReadFileRequest], stream *connect.ServerStream[v1.ReadFileResponse]) error {
	m := req.Msg
	if err := validLimit("max bytes", m.MaxBytes); err != nil {
		return err
	}
	root, release, err := s.root(ctx, m.SandboxId, "read file", m.Path, false)
	if err != nil {
		return err
	}
	defer release()
	_, err = root.ReadFile(ctx, m.Path, chunkWriter(func(b []byte) error {
		return stream.Send(&v1.ReadFileResponse{Data: b})
	}), m.MaxBytes)
	return err
}

func (s *service) WriteFile(ctx context.Context, stream *connect.ClientStream[v1.WriteFileRequest]) (*connect.Response[v1.WriteFileResponse], error) {
	if !stream.Receive() {
		return nil, headerMissing("write file", stream.Err())
	}
	hdr := stream.Msg().GetHeader()
	if hdr == nil {
		return nil, invalid("write file: the first message must be the header")
	}
	if hdr.Mode > 0o7777 {
		return nil, invalid("write file: bad mode %#o", hdr.Mode)
	}
	perm := v1.GoFileMode(v1.FileType_FILE_TYPE_REGULAR, hdr.Mode)
	if hdr.Mode == 0 {
		perm = 0o644
	}
	root, release, err := s.root(ctx, hdr.SandboxId, "write file", hdr.Path, true)
	if err != nil {
		return nil, err
	}
	defer release()
	cr := &countingReader{r: newStreamReader(stream, (*v1.WriteFileRequest).GetData, func(m *v1.WriteFileRequest) bool {
		_, ok := m.Msg.(*v1.WriteFileRequest_Data)
		return ok
	})}
	if err := root.WriteFile(ctx, hdr.Path, cr, perm, 0); err != nil {
		return nil, err
	}
	return connect.NewResponse(&v1.WriteFileResponse{Size: cr.n}), nil
}

func (s *service) Stat(ctx context.Context, req *connect.Request[v1.StatRequest]) (*connect.Response[v1.StatResponse], error) {
	root, release, err := s.root(ctx, req.Msg.SandboxId, "stat", req.Msg.Path, false)
	if err != nil {
		return nil, err
	}
	defer release()
	fi, err := root.Stat(ctx, req.Msg.Path)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&v1.StatResponse{Info: fileInfoToProto(fi)}), nil
}

func (s *service) ListDir(ctx context.Context, req *connect.Request[v1.ListDirRequest]) (*connect.Response[v1.ListDirResponse], error) {
	root, release, err := s.root(ctx, req.Msg.SandboxId, "list directory", req.Msg.Path, false)
	if err != nil {
		return nil, err
	}
	defer release()
	fis, err := root.ListDir(ctx, req.Msg.Path)
	if err != nil {
		return nil, err
	}
	out := make([]*v1.FileInfo, len(fis))
	for i, fi := range fis {
		out[i] = fileInfoToProto(fi)
	}
	return connect.NewResponse(&v1.ListDirResponse{Entries: out}), nil
}

func (s *service) Mkdir(ctx context.Context, req *connect.Request[v1.MkdirRequest]) (*connect.Response[v1.MkdirResponse], error) {
	m := req.Msg
	if m.Mode > 0o7777 {
		return nil, invalid("mkdir: bad mode %#o", m.Mode)
	}
	perm := v1.GoFileMode(v1.FileType_FILE_TYPE_UNSPECIFIED, m.Mode)
	if m.Mode == 0 {
		perm = 0o755
	}
	root, release, err := s.root(ctx, m.SandboxId, "mkdir", m.Path, true)
	if err != nil {
		return nil, err
	}
	defer release()
	if err := root.Mkdir(ctx, m.Path, perm, m.Parents); err != nil {
		return nil, err
	}
	return connect.NewResponse(&v1.MkdirResponse{}), nil
}

func (s *service) Remove(ctx context.Context, req *connect.Request[v1.RemoveRequest]) (*connect.Response[v1.RemoveResponse], error) {
	m := req.Msg
	root, release, err := s.root(ctx, m.SandboxId, "remove", m.Path, true)
	if err != nil {
		return nil, err
	}
	defer release()
	if err := root.Remove(ctx, m.Path, m.Recursive); err != nil {
		return nil, err
	}
	return connect.NewResponse(&v1.RemoveResponse{}), nil
}

func (s *service) Upload(ctx context.Context, stream *connect.ClientStream[v1.UploadRequest]) (*connect.Response[v1.UploadResponse], error) {
	if !stream.Receive() {
		return nil, headerMissing("upload", stream.Err())
	}
	hdr := stream.Msg().GetHeader()
	if hdr == nil {
		return nil, invalid("upload: the first message must be the header")
	}
	root, release, err := s.root(ctx, hdr.SandboxId, "upload to", hdr.Dst, true)
	if err != nil {
		return nil, err
	}
	defer release()
	r := newStreamReader(stream, (*v1.UploadRequest).GetData, func(m *v1.UploadRequest) bool {
		_, ok := m.Msg.(*v1.UploadRequest_Data)
		return ok
	})
	if err := root.TarIn(ctx, hdr.Dst, r, safefs.Limits{}); err != nil {
		return nil, err
	}
	return connect.NewResponse(&v1.UploadResponse{}), nil
}

func (s *service) Download(ctx context.Context, req *connect.Request[v1.DownloadRequest], stream *connect.ServerStream[v1.DownloadResponse]) error {
	root, release, err := s.root(ctx, req.Msg.SandboxId, "download", req.Msg.Path, false)
	if err != nil {
		return err
	}
	defer release()
	return root.TarOut(ctx, req.Msg.Path, chunkWriter(func(b []byte) error {
		return stream.Send(&v1.DownloadResponse{Data: b})
	}))
}

type countingReader struct {
	r interface{ Read([]byte) (int, error) }
	n int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}
