#!/bin/sh
# gen-proto.sh regenerates the Go code of the DeltaBox API from
# api/deltabox/v1/deltabox.proto. Needs protoc and the two plugins:
#   go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
#   go install connectrpc.com/connect/cmd/protoc-gen-connect-go@v1.21.1
set -eu
cd "$(dirname "$0")/.."
PATH="$(go env GOPATH)/bin:$PATH"
protoc -I api \
	--go_out=api --go_opt=paths=source_relative \
	--connect-go_out=api --connect-go_opt=paths=source_relative \
	deltabox/v1/deltabox.proto
