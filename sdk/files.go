package deltabox

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"io/fs"
	"time"

	"connectrpc.com/connect"

	v1 "github.com/deltabox/deltabox/api/deltabox/v1"
)

// Paths are absolute paths inside the sandbox. The daemon resolves them
// inside the sandbox's root: ".." and symlinks never lead out of it.

// FileInfo describes a file as the sandbox sees it.
type FileInfo struct {
	Name       string      `json:"name"`
	Path       string      `json:"path"`
	Size       int64       `json:"size"`
	Mode       fs.FileMode `json:"mode"`
	ModTime    time.Time   `json:"mod_time"`
	UID        uint32      `json:"uid"`
	GID        uint32      `json:"gid"`
	LinkTarget string      `json:"link_target,omitempty"`
}

// IsDir reports whether the file is a directory.
func (fi FileInfo) IsDir() bool { return fi.Mode.IsDir() }

func fileInfo(m *v1.FileInfo) FileInfo {
	fi := FileInfo{
		Name: m.GetName(), Path: m.GetPath(), Size: m.GetSize(),
		Mode: v1.GoFileMode(m.GetType(), m.GetMode()),
		UID:  m.GetUid(), GID: m.GetGid(), LinkTarget: m.GetLinkTarget(),
	}
	if m.ModTime != nil {
		fi.ModTime = m.ModTime.AsTime()
	}
	return fi
}

// DefaultReadFileMax is the largest file ReadFile returns; use ReadFileTo
// for larger ones.
const DefaultReadFileMax = 64 << 20

// ReadFile returns the content of a regular file (at most
// DefaultReadFileMax bytes; more fails with errdefs.ErrResourceExhausted).
func (s *Sandbox) ReadFile(ctx context.Context, path string) ([]byte, error) {
	var buf bytes.Buffer
	if _, err := s.ReadFileTo(ctx, path, &buf, DefaultReadFileMax); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// ReadFileTo streams the content of a regular file to w, at most max bytes
// (0: no limit; more fails with errdefs.ErrResourceExhausted). It returns
// the bytes written.
func (s *Sandbox) ReadFileTo(ctx context.Context, path string, w io.Writer, max int64) (int64, error) {
	stream, err := s.c.rpc.ReadFile(ctx, connect.NewRequest(&v1.ReadFileRequest{SandboxId: s.id, Path: path, MaxBytes: max}))
	if err != nil {
		return 0, s.c.err(err)
	}
	defer stream.Close()
	var n int64
	for stream.Receive() {
		m, err := w.Write(stream.Msg().Data)
		n += int64(m)
		if err != nil {
			return n, fmt.Errorf("read file %q: %w", path, err)
		}
	}
	return n, s.c.err(stream.Err())
}

// WriteFile replaces the file at path with data (atomically), creating
// missing parent directories. perm 0 means 0644.
func (s *Sandbox) WriteFile(ctx context.Context, path string, data []byte, perm fs.FileMode) error {
	_, err := s.WriteFileFrom(ctx, path, bytes.NewReader(data), perm)
	return err
}

// WriteFileFrom is WriteFile streaming the content from r; it returns the
// size written.
func (s *Sandbox) WriteFileFrom(ctx context.Context, path string, r io.Reader, perm fs.FileMode) (int64, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream := s.c.rpc.WriteFile(ctx)
	err := sendStream(stream.Send,
		&v1.WriteFileRequest{Msg: &v1.WriteFileRequest_Header{Header: &v1.WriteFileHeader{
			SandboxId: s.id, Path: path, Mode: v1.ModeBits(perm),
		}}},
		r, func(b []byte) *v1.WriteFileRequest {
			return &v1.WriteFileRequest{Msg: &v1.WriteFileRequest_Data{Data: b}}
		})
	if err != nil {
		// Do not let a half-read source become the file: cancel the call
		// rather than close it cleanly.
		cancel()
		stream.CloseAndReceive()
		return 0, fmt.Errorf("write file %q: %w", path, err)
	}
	res, err := stream.CloseAndReceive()
	if err != nil {
		return 0, s.c.err(err)
	}
	return res.Msg.Size, nil
}

// Stat describes path without following a final symlink.
func (s *Sandbox) Stat(ctx context.Context, path string) (FileInfo, error) {
	res, err := s.c.rpc.Stat(ctx, connect.NewRequest(&v1.StatRequest{SandboxId: s.id, Path: path}))
	if err != nil {
		return FileInfo{}, s.c.err(err)
	}
	return fileInfo(res.Msg.Info), nil
}

// ListDir lists a directory, sorted by name.
func (s *Sandbox) ListDir(ctx context.Context, path string) ([]FileInfo, error) {
	res, err := s.c.rpc.ListDir(ctx, connect.NewRequest(&v1.ListDirRequest{SandboxId: s.id, Path: path}))
	if err != nil {
		return nil, s.c.err(err)
	}
	out := make([]FileInfo, len(res.Msg.Entries))
	for i, m := range res.Msg.Entries {
		out[i] = fileInfo(m)
	}
	return out, nil
}

// Mkdir creates a directory (and its missing parents when parents is set).
// perm 0 means 0755.
func (s *Sandbox) Mkdir(ctx context.Context, path string, perm fs.FileMode, parents bool) error {
	_, err := s.c.rpc.Mkdir(ctx, connect.NewRequest(&v1.MkdirRequest{
		SandboxId: s.id, Path: path, Mode: v1.ModeBits(perm), Parents: parents,
	}))
	return s.c.err(err)
}

// Remove removes a file or an empty directory; with recursive, a whole tree.
func (s *Sandbox) Remove(ctx context.Context, path string, recursive bool) error {
	_, err := s.c.rpc.Remove(ctx, connect.NewRequest(&v1.RemoveRequest{SandboxId: s.id, Path: path, Recursive: recursive}))
	return s.c.err(err)
}

// Upload extracts the tar stream r into the directory dst (created if
// missing). The daemon refuses entries that would escape dst, device nodes,
// and archives over its size limits.
func (s *Sandbox) Upload(ctx context.Context, dst string, r io.Reader) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream := s.c.rpc.Upload(ctx)
	err := sendStream(stream.Send,
		&v1.UploadRequest{Msg: &v1.UploadRequest_Header{Header: &v1.UploadHeader{SandboxId: s.id, Dst: dst}}},
		r, func(b []byte) *v1.UploadRequest { return &v1.UploadRequest{Msg: &v1.UploadRequest_Data{Data: b}} })
	if err != nil {
		cancel() // an archive cut short must not look complete
		stream.CloseAndReceive()
		return fmt.Errorf("upload to %q: %w", dst, err)
	}
	_, err = stream.CloseAndReceive()
	return s.c.err(err)
}

// Download writes a tar stream of path (a file, or a directory and all
// below it) to w. Entry names are relative to path's parent: downloading
// /work/src gives "src", "src/main.go", ...
func (s *Sandbox) Download(ctx context.Context, path string, w io.Writer) error {
	stream, err := s.c.rpc.Download(ctx, connect.NewRequest(&v1.DownloadRequest{SandboxId: s.id, Path: path}))
	if err != nil {
		return s.c.err(err)
	}
	defer stream.Close()
	for stream.Receive() {
		if _, err := w.Write(stream.Msg().Data); err != nil {
			return fmt.Errorf("download %q: %w", path, err)
		}
	}
	return s.c.err(stream.Err())
}
