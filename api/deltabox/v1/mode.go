package deltaboxv1

import "io/fs"

// ChunkSize is the largest payload both ends put in one message of a byte
// stream (exec output, file data, tar archives, image imports).
const ChunkSize = 64 << 10

// FileTypeOf returns the FileType of a Go file mode.
func FileTypeOf(m fs.FileMode) FileType {
	switch m.Type() {
	case 0:
		return FileType_FILE_TYPE_REGULAR
	case fs.ModeDir:
		return FileType_FILE_TYPE_DIRECTORY
	case fs.ModeSymlink:
		return FileType_FILE_TYPE_SYMLINK
	case fs.ModeNamedPipe:
		return FileType_FILE_TYPE_FIFO
	case fs.ModeSocket:
		return FileType_FILE_TYPE_SOCKET
	case fs.ModeDevice | fs.ModeCharDevice:
		return FileType_FILE_TYPE_CHAR_DEVICE
	case fs.ModeDevice:
		return FileType_FILE_TYPE_BLOCK_DEVICE
	}
	return FileType_FILE_TYPE_UNSPECIFIED
}

// ModeBits returns the chmod-style bits (permissions, setuid 04000, setgid
// 02000, sticky 01000) of a Go file mode.
func ModeBits(m fs.FileMode) uint32 {
	b := uint32(m.Perm())
	if m&fs.ModeSetuid != 0 {
		b |= 0o4000
	}
	if m&fs.ModeSetgid != 0 {
		b |= 0o2000
	}
	if m&fs.ModeSticky != 0 {
		b |= 0o1000
	}
	return b
}

// GoFileMode is the inverse of FileTypeOf and ModeBits.
func GoFileMode(t FileType, bits uint32) fs.FileMode {
	m := fs.FileMode(bits & 0o777)
	if bits&0o4000 != 0 {
		m |= fs.ModeSetuid
	}
	if bits&0o2000 != 0 {
		m |= fs.ModeSetgid
	}
	if bits&0o1000 != 0 {
		m |= fs.ModeSticky
	}
	switch t {
	case FileType_FILE_TYPE_DIRECTORY:
		m |= fs.ModeDir
	case FileType_FILE_TYPE_SYMLINK:
		m |= fs.ModeSymlink
	case FileType_FILE_TYPE_FIFO:
		m |= fs.ModeNamedPipe
	case FileType_FILE_TYPE_SOCKET:
		m |= fs.ModeSocket
	case FileType_FILE_TYPE_CHAR_DEVICE:
		m |= fs.ModeDevice | fs.ModeCharDevice
	case FileType_FILE_TYPE_BLOCK_DEVICE:
		m |= fs.ModeDevice
	}
	return m
}
