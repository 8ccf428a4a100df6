//go:build linux

package daemon

import (
	"context"
	"slices"
	"strings"

	"connectrpc.com/connect"

	v1 "github.com/deltabox/deltabox/api/deltabox/v1"
	"github.com/deltabox/deltabox/internal/layer"
)

// The checkpoint handlers: they validate at the edge and call the backend's
// Checkpointer.

func (s *service) CreateCheckpoint(ctx context.Context, req *connect.Request[v1.CreateCheckpointRequest]) (*connect.Response[v1.CreateCheckpointResponse], error) {
	m := req.Msg
	if err := validSandboxID(m.SandboxId); err != nil {
		return nil, err
	}
	if err := validCheckpointName(m.Name); err != nil {
		return nil, err
	}
	if err := validLabels(m.Labels); err != nil {
		return nil, err
	}
	ck, err := s.b.Checkpoint(ctx, m.SandboxId, CheckpointOptions{Name: m.Name, Labels: m.Labels})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&v1.CreateCheckpointResponse{Checkpoint: checkpointToProto(ck)}), nil
}

func (s *service) Restore(ctx context.Context, req *connect.Request[v1.RestoreRequest]) (*connect.Response[v1.RestoreResponse], error) {
	m := req.Msg
	if err := validSandboxID(m.SandboxId); err != nil {
		return nil, err
	}
	if err := validCheckpointID(m.CheckpointId); err != nil {
		return nil, err
	}
	res, err := s.b.Restore(ctx, m.SandboxId, m.CheckpointId)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&v1.RestoreResponse{
		Duration:  millis(res.RestoreMs),
		Processes: processesToProto(res.Processes),
	}), nil
}

func (s *service) Fork(ctx context.Context, req *connect.Request[v1.ForkRequest]) (*connect.Response[v1.ForkResponse], error) {
	m := req.Msg
	if err := validCheckpointID(m.CheckpointId); err != nil {
		return nil, err
	}
	if err := validForkCount(m.N); err != nil {
		return nil, err
	}
	res, err := s.b.Fork(ctx, m.CheckpointId, int(m.N))
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&v1.ForkResponse{SandboxIds: res.IDs, Duration: millis(res.ForkMs)}), nil
}

func (s *service) GetTree(ctx context.Context, req *connect.Request[v1.GetTreeRequest]) (*connect.Response[v1.GetTreeResponse], error) {
	if id := req.Msg.Id; id != "" {
		if err := validTreeID(id); err != nil {
			return nil, err
		}
	}
	t, err := s.b.Tree(ctx, req.Msg.Id)
	if err != nil {
		return nil, err
	}
	sbs := make([]*v1.Sandbox, len(t.Sandboxes))
	for i, info := range t.Sandboxes {
		sbs[i] = sandboxToProto(info)
	}
	return connect.NewResponse(&v1.GetTreeResponse{Checkpoints: checkpointsToProto(t.Checkpoints), Sandboxes: sbs}), nil
}

func (s *service) GetCheckpoint(ctx context.Context, req *connect.Request[v1.GetCheckpointRequest]) (*connect.Response[v1.GetCheckpointResponse], error) {
	if err := validCheckpointID(req.Msg.Id); err != nil {
		return nil, err
	}
	ck, err := s.b.GetCheckpoint(ctx, req.Msg.Id)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&v1.GetCheckpointResponse{Checkpoint: checkpointToProto(ck)}), nil
}

func (s *service) ListCheckpoints(ctx context.Context, _ *connect.Request[v1.ListCheckpointsRequest]) (*connect.Response[v1.ListCheckpointsResponse], error) {
	cks, err := s.b.ListCheckpoints(ctx)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&v1.ListCheckpointsResponse{Checkpoints: checkpointsToProto(cks)}), nil
}

func (s *service) DeleteCheckpoint(ctx context.Context, req *connect.Request[v1.DeleteCheckpointRequest]) (*connect.Response[v1.DeleteCheckpointResponse], error) {
	if err := validCheckpointID(req.Msg.Id); err != nil {
		return nil, err
	}
	if err := s.b.DeleteCheckpoint(ctx, req.Msg.Id, req.Msg.Recursive); err != nil {
		return nil, err
	}
	return connect.NewResponse(&v1.DeleteCheckpointResponse{}), nil
}

func (s *service) Diff(ctx context.Context, req *connect.Request[v1.DiffRequest]) (*connect.Response[v1.DiffResponse], error) {
	m := req.Msg
	if err := validTreeID(m.From); err != nil {
		return nil, err
	}
	if err := validTreeID(m.To); err != nil {
		return nil, err
	}
	changes, err := s.b.Diff(ctx, m.From, m.To)
	if err != nil {
		return nil, err
	}
	// Sorted here, so that every client sees the same order whatever the
	// layer store walks in.
	slices.SortStableFunc(changes, func(a, b layer.Change) int { return strings.Compare(a.Path, b.Path) })
	return connect.NewResponse(&v1.DiffResponse{Changes: changesToProto(changes)}), nil
}
