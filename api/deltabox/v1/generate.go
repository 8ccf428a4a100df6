// Package deltaboxv1 is the DeltaBox API, version 1: the messages generated
// from deltabox.proto, a few hand-written helpers that both the daemon and
// the SDK use (mode.go), and the Connect client and handler in
// deltaboxv1connect.
package deltaboxv1

//go:generate ../../../scripts/gen-proto.sh
