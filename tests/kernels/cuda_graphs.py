"""Helper for GPU tests: a training step run inside a replayed CUDA graph (imported by the GPU-only test files)."""
from __future__ import annotations

import torch


def replayed(step, replays: int = 3):
    """Warm ``step`` up once on a side stream (PyTorch's capture recipe), capture one call in a CUDA graph, replay
    the graph ``replays`` times and return what the captured call returned: its tensors hold the last replay's
    values (nothing runs during the capture itself)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return out
