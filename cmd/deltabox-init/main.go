// Command deltabox-init is the pid 1 of every sandbox generation. The daemon
// starts it from beside its own executable when it is installed there (see
// sandbox.WithInitBinary): it links only the init (package initproc) and
// its protocol, so it boots in a fraction of the time and CPU of the whole
// deltabox binary, on the path of every checkpoint generation, restore and
// fork. Users never run it.
package main

import "github.com/deltabox/deltabox/internal/sandbox/initproc"

func main() { initproc.Run() }
