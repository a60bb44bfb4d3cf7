"""One target Linear of the LoKA Probe: its input hook, its activation and weight trackers, and how its full
weight reaches the weight tracker (gathered under FSDP2, folded in on a CUDA side stream). The callback that
drives them every ``interval`` steps is ``callbacks.probe.ProbeCallback``."""
from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from loka_trainer.probe.activation import ActivationTracker, summary_scalars
from loka_trainer.probe.weight import WeightTracker

if TYPE_CHECKING:
    from loka_trainer.callbacks.probe_config import ProbeConfig


def full_parameter(module: nn.Linear, name: str = "weight") -> tuple[torch.Tensor, bool]:
    """(the full parameter, whether it is a private copy): a DTensor (FSDP2 outside the unit's forward) is gathered,
    a collective every rank reaches since all ranks run the same callbacks; a plain parameter is returned as it is."""
    param = getattr(module, name)
    if not callable(getattr(param, "full_tensor", None)):
        return param, False
    full = param.full_tensor()  # on a one-rank mesh this may be the local shard itself, which the optimizer writes
    return full, full.untyped_storage().data_ptr() != param.to_local().untyped_storage().data_ptr()


class WeightUpdates:
    """Folds observed weights into their WeightTrackers on the weight's own device, off the training's path.

    On CUDA ``submit`` clones the weight on the current stream (ordered before the optimizer changes it) and queues
    the tracker update on one side stream: the update is a chain of small Cholesky factorizations, triangular
    solves and elementwise passes with no host sync, so the host thread never waits and the GPU overlaps it with
    training. On an H200 this is milliseconds per observation; the same
    update on the host took seconds of CPU per observation of wukong_h200 and fell behind at interval 100.
    On CPU the update runs inline. The trackers' state lives where the weights do (mean: 8 bytes per weight
    element with stats_dtype=float64).
    NOTE: callers wait() before reading trackers (save, state_dict, close).
    """

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def submit(self, tracker: WeightTracker, weight: torch.Tensor, *, private: bool = False) -> None:
        """weight: (O, I) full weight on any device; ``private``: nothing else writes it (a gathered copy), so the
        side stream may read it without a clone."""
        weight = weight.detach()
        if not weight.is_cuda:
            tracker.update(weight)
            return
        copy = weight if private else weight.clone()
        side = self._streams.get(weight.device)
        if side is None:
            side = self._streams[weight.device] = torch.cuda.Stream(weight.device)
        side.wait_stream(torch.cuda.current_stream(weight.device))
        with torch.cuda.stream(side):
            tracker.update(copy)
        copy.record_stream(side)  # its memory is not reused before the side stream has read it

    def wait(self) -> None:
        """Order the current stream after every queued update (no host wait), so reads of the trackers that
        follow on the current stream see them."""
        for device, side in self._streams.items():
            torch.cuda.current_stream(device).wait_stream(side)


def tracker_device(module: nn.Linear) -> Optional[torch.device]:
    """Where the layer's weight lives (CUDA under FSDP2 too), so that no observation copies the trackers' state
    host-to-device (a copy that waits for the GPU); None (the CPU) for a weight not materialized yet."""
    device = module.weight.device
    return None if device.type == "meta" else device


class LayerProbe:
    """Trackers, the input hook and the last TensorBoard scalars of one Linear."""

    def __init__(self, fqn: str, module: nn.Linear, cfg: ProbeConfig):
        self.fqn, self.module = fqn, module
        self.activation = ActivationTracker(module.in_features, max_full_covariance=cfg.max_full_covariance,
                                            covariance_block=cfg.covariance_block, stats_dtype=cfg.stats_dtype,
                                            device=tracker_device(module), sample_rows=cfg.sample_rows,
                                            seed=zlib.crc32(fqn.encode()))
        self.weight = WeightTracker(module.out_features, module.in_features, momentum=cfg.momentum,
                                    max_full_covariance=cfg.max_full_weight_factor, stats_dtype=cfg.stats_dtype)
        # Read by the (compiled) forward: dynamo guards on it, and on the stash being empty, so both stay stable.
        self.armed = False
        self.inputs: list[torch.Tensor] = []  # each (..., I): stashed by the armed hook, emptied in place by fold
        self.log_scalars = False  # set on the rank that writes TensorBoard; others skip the extra reductions
        self.weight_scalars: list[torch.Tensor] = []  # |W|, [|b|] of the last weight observation
        self.scalars: Optional[torch.Tensor] = None  # (4 or 5,) act mean, std, max|x|, |W|, [|b|]

    def stash_input(self, module: nn.Module, args: tuple) -> None:
        """Forward pre-hook, registered once for the run. args[0]: (..., I)."""
        if self.armed:
            self.inputs.append(args[0].detach())

    @torch.no_grad()
    def observe_weight(self, updates: WeightUpdates) -> None:
        """Fold the full weight (O, I) into the weight tracker (at an observed step's start)."""
        weight, private = full_parameter(self.module)
        updates.submit(self.weight, weight, private=private)
        # gathered on every rank (a collective), though only the rank that logs uses it
        bias = full_parameter(self.module, "bias")[0] if getattr(self.module, "bias", None) is not None else None
        if self.log_scalars:
            self.weight_scalars = [p.detach().float().norm() for p in (weight, bias) if p is not None]

    @torch.no_grad()
    def fold_inputs(self) -> None:
        """Disarm and fold the stashed inputs into the activation tracker; the TensorBoard scalars of the last
        input come from its moments (no extra pass over it)."""
        self.armed = False
        batch = None
        for x in self.inputs:
            batch = self.activation.update(x)
        if self.log_scalars and batch is not None:
            self.scalars = torch.cat([summary_scalars(batch), *(w.reshape(1).float() for w in self.weight_scalars)])
        self.inputs.clear()

    def state_bytes(self) -> int:
        """Bytes of this layer's trackers on their device: the activation moments (allocated at construction) and the
        weight tracker once started."""
        moments = sum(t.numel() * t.element_size() for t in self.activation.moments.tensors())
        return moments + self.weight.state_bytes

    def file_entry(self, merged_activation: dict) -> dict:
        return {"in_features": self.module.in_features, "out_features": self.module.out_features,
                "has_bias": getattr(self.module, "bias", None) is not None, "activation": merged_activation,
                "weight": self.weight.state_dict()}


SCALAR_NAMES = ("act_mean", "act_std", "act_max_abs", "weight_norm", "bias_norm")
