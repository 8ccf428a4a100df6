package deltabox

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"

	"github.com/deltabox/deltabox/errdefs"
)

// CopyIn copies a local file or directory into the sandbox, like `cp -r`:
// when dst is an existing directory (or ends in "/"), the copy goes inside it
// under the source's name; otherwise it becomes dst. Symlinks are copied as
// symlinks; sockets and devices are skipped. Files are owned by the
// sandbox's root. dst is an absolute path.
func (s *Sandbox) CopyIn(ctx context.Context, local, dst string) error {
	abs, err := filepath.Abs(local)
	if err != nil {
		return err
	}
	if _, err := os.Lstat(abs); err != nil {
		return fmt.Errorf("copy %s: %w", local, err)
	}
	dir, name := path.Dir(dst), path.Base(dst)
	if strings.HasSuffix(dst, "/") {
		dir, name = dst, filepath.Base(abs)
	} else if fi, err := s.Stat(ctx, dst); err == nil && fi.IsDir() {
		dir, name = dst, filepath.Base(abs)
	} else if err != nil && !errors.Is(err, errdefs.ErrNotFound) {
		return err
	}
	pr, pw := io.Pipe()
	go func() { pw.CloseWithError(writeTar(pw, abs, name)) }()
	err = s.Upload(ctx, dir, pr)
	pr.Close()
	return err
}

// CopyOut copies a file or directory of the sandbox to the local path
// local, like `cp -r`: when local is an existing directory the copy goes
// inside it under the source's name; otherwise it becomes local. Nothing is
// written outside that target, whatever the archive holds.
func (s *Sandbox) CopyOut(ctx context.Context, src, local string) error {
	dir, name := filepath.Dir(local), filepath.Base(local)
	if fi, err := os.Stat(local); err == nil && fi.IsDir() {
		dir, name = local, ""
	}
	pr, pw := io.Pipe()
	go func() { pw.CloseWithError(s.Download(ctx, src, pw)) }()
	err := extractTar(pr, dir, path.Base(path.Clean(src)), name)
	pr.CloseWithError(errors.New("copy stopped"))
	return err
}

// writeTar writes a tar stream of src (not following symlinks) whose top
// entry is called name.
func writeTar(w io.Writer, src, name string) error {
	tw := tar.NewWriter(w)
	err := filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		var link string
		switch fi.Mode().Type() {
		case 0, fs.ModeDir:
		case fs.ModeSymlink:
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		default:
			return nil // sockets, devices, fifos: not copied
		}
		hdr, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, p)
		if err != nil {
			return err
		}
		hdr.Name = name
		if rel != "." {
			hdr.Name = path.Join(name, filepath.ToSlash(rel))
		}
		if fi.IsDir() {
			hdr.Name += "/"
		}
		hdr.Uid, hdr.Gid, hdr.Uname, hdr.Gname = 0, 0, "", ""
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if fi.Mode().IsRegular() {
			f, err := os.Open(p)
			if err != nil {
				return err
			}
			_, err = io.Copy(tw, f)
			f.Close()
			return err
		}
		return nil
	})
	if err != nil {
		return err
	}
	return tw.Close()
}

// extractTar extracts r into dir through an os.Root, so that no entry or
// symlink can write outside dir. The top component from is renamed to to
// (unless to is empty). Ownership is not restored.
func extractTar(r io.Reader, dir, from, to string) error {
	root, err := os.OpenRoot(dir)
	if err != nil {
		return err
	}
	defer root.Close()
	rename := func(name string) (string, error) {
		name = path.Clean(name)
		if path.IsAbs(name) || name == ".." || strings.HasPrefix(name, "../") {
			return "", fmt.Errorf("archive entry %q leaves the target: %w", name, errdefs.ErrInvalidArgument)
		}
		if to != "" {
			if first, rest, _ := strings.Cut(name, "/"); first == from {
				name = path.Join(to, rest)
			}
		}
		return name, nil
	}
	tr := tar.NewReader(r)
	for {
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		name, err := rename(hdr.Name)
		if err != nil {
			return err
		}
		mode := hdr.FileInfo().Mode()
		if d := path.Dir(name); d != "." {
			if err := root.MkdirAll(d, 0o755); err != nil {
				return err
			}
		}
		switch hdr.Typeflag {
		case tar.TypeDir:
			if err := root.MkdirAll(name, mode.Perm()|0o700); err != nil {
				return err
			}
		case tar.TypeReg:
			f, err := root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, mode.Perm())
			if err != nil {
				return err
			}
			_, err = io.Copy(f, tr)
			if cerr := f.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				return err
			}
			if err := root.Chmod(name, mode.Perm()); err != nil {
				return err
			}
			root.Chtimes(name, hdr.ModTime, hdr.ModTime)
		case tar.TypeSymlink:
			root.Remove(name)
			if err := root.Symlink(hdr.Linkname, name); err != nil {
				return err
			}
		case tar.TypeLink:
			old, err := rename(hdr.Linkname)
			if err != nil {
				return err
			}
			root.Remove(name)
			if err := root.Link(old, name); err != nil {
				return err
			}
		}
	}
}
