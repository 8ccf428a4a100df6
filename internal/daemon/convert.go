//go:build linux

package daemon

import (
	"math"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	v1 "github.com/deltabox/deltabox/api/deltabox/v1"
	"github.com/deltabox/deltabox/internal/image"
	"github.com/deltabox/deltabox/internal/layer"
	"github.com/deltabox/deltabox/internal/safefs"
	"github.com/deltabox/deltabox/internal/sandbox"
)

// Conversions between the backend's types and the API's messages.

func timestamp(t time.Time) *timestamppb.Timestamp {
	if t.IsZero() {
		return nil
	}
	return timestamppb.New(t)
}

var sandboxStates = map[sandbox.State]v1.SandboxState{
	sandbox.StateCreating: v1.SandboxState_SANDBOX_STATE_CREATING,
	sandbox.StateRunning:  v1.SandboxState_SANDBOX_STATE_RUNNING,
	sandbox.StateStopped:  v1.SandboxState_SANDBOX_STATE_STOPPED,
	sandbox.StateDeleted:  v1.SandboxState_SANDBOX_STATE_DELETED,
}

func sandboxToProto(info sandbox.Info) *v1.Sandbox {
	img := info.Config.Image
	if img == "" {
		img = image.HostImage
	}
	return &v1.Sandbox{
		Id:      info.ID,
		Image:   img,
		Env:     info.Config.Env,
		Workdir: info.Config.Workdir,
		Labels:  info.Config.Labels,
		Limits: &v1.Limits{
			MemoryBytes: info.Config.Limits.MemoryBytes,
			Pids:        info.Config.Limits.Pids,
			Cpus:        info.Config.Limits.CPUs,
		},
		State:   sandboxStates[info.State],
		Created: timestamp(info.Created),
		InitPid: int32(info.InitPid),
		Head:    info.Head,
	}
}

var imageKinds = map[image.Kind]v1.ImageKind{
	image.KindHost:   v1.ImageKind_IMAGE_KIND_HOST,
	image.KindRootfs: v1.ImageKind_IMAGE_KIND_ROOTFS,
	image.KindOCI:    v1.ImageKind_IMAGE_KIND_OCI,
}

func imageToProto(info image.Info) *v1.Image {
	return &v1.Image{
		Name:    info.Name,
		Kind:    imageKinds[info.Kind],
		Created: timestamp(info.Created),
		Size:    info.Size,
		Env:     info.Env,
	}
}

func fileInfoToProto(fi safefs.FileInfo) *v1.FileInfo {
	return &v1.FileInfo{
		Name:       fi.Name,
		Path:       fi.Path,
		Size:       fi.Size,
		Type:       v1.FileTypeOf(fi.Mode),
		Mode:       v1.ModeBits(fi.Mode),
		ModTime:    timestamp(fi.ModTime),
		Uid:        fi.UID,
		Gid:        fi.GID,
		LinkTarget: fi.LinkTarget,
	}
}

func exitToProto(res sandbox.ExecResult) *v1.ExecResponse {
	return &v1.ExecResponse{Event: &v1.ExecResponse_Exit{Exit: &v1.ExecExit{
		ExitCode:        int32(res.ExitCode),
		TimedOut:        res.TimedOut,
		StdoutTruncated: res.StdoutTruncated,
		StderrTruncated: res.StderrTruncated,
		Duration:        durationpb.New(res.Duration),
	}}}
}

// millis converts the backend's fractional milliseconds to a duration.
func millis(ms float64) *durationpb.Duration {
	return durationpb.New(time.Duration(math.Round(ms * float64(time.Millisecond))))
}

var processPaths = map[ProcessPath]v1.ProcessPath{
	PathTemplate: v1.ProcessPath_PROCESS_PATH_TEMPLATE,
	PathCRIU:     v1.ProcessPath_PROCESS_PATH_CRIU,
	PathReplay:   v1.ProcessPath_PROCESS_PATH_REPLAY,
	PathNone:     v1.ProcessPath_PROCESS_PATH_NONE,
}

func processesToProto(ps []ProcessState) []*v1.ProcessState {
	out := make([]*v1.ProcessState, len(ps))
	for i, p := range ps {
		out[i] = &v1.ProcessState{Name: p.Name, Path: processPaths[p.Path], Reason: p.Reason}
	}
	return out
}

func checkpointToProto(ck Checkpoint) *v1.Checkpoint {
	return &v1.Checkpoint{
		Id:        ck.ID,
		Parent:    ck.Parent,
		SandboxId: ck.Sandbox,
		Name:      ck.Name,
		Labels:    ck.Labels,
		Created:   timestamp(ck.Created),
		Pause:     millis(ck.PauseMs),
		Processes: processesToProto(ck.Processes),
		Heads:     ck.Heads,
	}
}

func checkpointsToProto(cks []Checkpoint) []*v1.Checkpoint {
	out := make([]*v1.Checkpoint, len(cks))
	for i, ck := range cks {
		out[i] = checkpointToProto(ck)
	}
	return out
}

var changeKinds = map[layer.ChangeKind]v1.ChangeKind{
	layer.ChangeAdd:    v1.ChangeKind_CHANGE_KIND_ADDED,
	layer.ChangeModify: v1.ChangeKind_CHANGE_KIND_MODIFIED,
	layer.ChangeDelete: v1.ChangeKind_CHANGE_KIND_REMOVED,
}

func changesToProto(cs []layer.Change) []*v1.Change {
	out := make([]*v1.Change, len(cs))
	for i, c := range cs {
		out[i] = &v1.Change{Path: c.Path, Kind: changeKinds[c.Kind]}
	}
	return out
}
