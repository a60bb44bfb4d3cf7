"""LoKA Probe callback: learns per-layer activation and weight statistics online (paper III-A).

Each target Linear carries one forward pre-hook for the whole run. Every ``interval`` steps the callback arms the
hooks; an armed hook stashes the layer's input (the real activation) and the callback folds the stashed inputs in
after the forward (``on_after_forward``, else at the step's end) and disarms. Under gradient accumulation (k
micro-batches per step, each followed by ``on_after_forward`` and ``on_after_backward``), ``on_after_backward`` arms
the hooks again, so every micro-batch of an observed step is folded, one micro-batch's inputs held at a time.
The weights are observed once per ``interval`` too, but spread over it: layer i of n at steps where
step % interval == i * interval // n (and every layer at the first observed step), so that no step pays for all of
them. Under ``torch.compile`` the armed flag is a guard, so each unit is compiled twice (observed and not) and
observed steps run compiled too: the hook's only work in the graph is returning the input, the statistics run outside
it. Under FSDP2 the weight is gathered with ``full_tensor()`` (a collective every rank reaches). Every
``save_interval`` steps and at the end of training, per-rank activation statistics are merged with collectives and
rank 0 writes ``<out_dir>/stats.pt`` on a background thread (atomic rename). Rank 0 also logs per-layer activation
mean / std / max|x| (of the rows folded in) and the weight (and bias) norms of the last weight observation to
TensorBoard.

Plain user loop (no trainer)::

    from loka_trainer.callbacks.base import TrainState
    from loka_trainer.callbacks.probe import ProbeCallback

    probe = ProbeCallback(interval=100, save_interval=10_000, out_dir="runs/exp/probe")
    state = TrainState(model=model)
    probe.on_train_start(state)          # attaches to the model's Linears
    for step, batch in enumerate(loader):
        state.step = step
        probe.on_step_start(state)       # arms the hooks every `interval` steps
        loss = model(batch)
        probe.on_after_forward(state)    # optional: frees the stashed inputs before the backward
        loss.backward(); opt.step(); opt.zero_grad()
        probe.on_step_end(state)         # saves every `save_interval` steps, in the background
    probe.on_train_end(state)            # final save, waits for the writer

Then: ``python -m loka_trainer.probe.report runs/exp/probe``.
"""
from __future__ import annotations

import dataclasses
import logging
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from loka_trainer.callbacks.base import Callback, TrainState
from loka_trainer.callbacks.probe_config import ProbeConfig, probe_out_dir, to_probe_config
from loka_trainer.callbacks.probe_layer import SCALAR_NAMES, LayerProbe, WeightUpdates
from loka_trainer.output_dirs import unwritable_reason
from loka_trainer.probe.activation import ActivationTracker
from loka_trainer.probe.distributed import all_reduce_moments
from loka_trainer.probe.stats_io import STATS_FILE, STATS_VERSION, AsyncSaver, seal_stats, to_cpu
from loka_trainer.probe.targets import ModuleFilter, select_linears
from loka_trainer.probe.weight import WeightTracker

log = logging.getLogger(__name__)


def check_writable_dir(path: Path) -> None:
    """Create ``path`` (with parents); one-line ValueError when it cannot be written, at the start of training
    instead of at the first save."""
    reason = unwritable_reason(path)
    if reason is None:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            reason = f"{type(exc).__name__}: {exc.strerror or exc}"
    if reason is not None:
        raise ValueError(f"ProbeCallback cannot write its statistics to {str(path)!r} ({reason})")


class ProbeCallback(Callback):
    """Learns activation (Welford/Chan) and weight (matrix-normal) statistics of target Linears.

    Args: the ProbeConfig fields as keyword arguments, plus
      module_filter_fn: optional ``(module, fqn) -> bool`` applied after the config filters.
      writer: optional TensorBoard SummaryWriter (default: one in <run_dir>/tensorboard/probe on rank 0, whatever
          ``out_dir``; without a run dir beside ``out_dir``).
      run_dir: run directory; stats go to <run_dir>/probe unless ``out_dir`` is set (else state.run_dir).
    """

    def __init__(self, *, module_filter_fn: Optional[ModuleFilter] = None, writer: Any = None,
                 run_dir: Optional[str | Path] = None, **fields: Any):
        self.config = to_probe_config(fields)
        self.module_filter_fn = module_filter_fn
        self.writer = writer
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.layers: dict[str, LayerProbe] = {}
        self.attached = False  # attach() ran (on_train_start runs it)
        self.rank, self.world_size = 0, 1
        self._handles: list = []  # the layers' input hooks, one per layer for the whole run
        self._weights_due: dict[int, list[LayerProbe]] = {}
        self._observing = False  # an observed step is in flight (hooks armed or inputs not folded yet)
        self._saver: Optional[AsyncSaver] = None
        self._weights = WeightUpdates()
        self._pending_state: Optional[dict] = None
        self._last_saved_step: Optional[int] = None
        self._scalars = PendingScalars()

    @classmethod
    def from_config(cls, cfg: Any, *, run_dir: Optional[str | Path] = None, **kwargs: Any) -> "ProbeCallback":
        """From a ProbeConfig, a dict or a Hydra DictConfig (``callbacks.probe``)."""
        if dataclasses.is_dataclass(cfg):
            fields = dataclasses.asdict(cfg)
        elif hasattr(cfg, "items"):
            fields = dict(cfg.items())
        else:
            raise TypeError(f"cfg must be a ProbeConfig, dict or DictConfig, got {type(cfg).__name__}")
        return cls(run_dir=run_dir, **kwargs, **fields)

    @property
    def out_dir(self) -> Optional[Path]:
        return probe_out_dir(self.config.out_dir, self.run_dir)

    @property
    def stats_path(self) -> Optional[Path]:
        return self.out_dir / STATS_FILE if self.out_dir is not None else None

    # ----- attaching -------------------------------------------------------------------------------------
    def attach(self, model: nn.Module, *, rank: int = 0, world_size: int = 1) -> dict[str, nn.Linear]:
        """Pick the target Linears of ``model`` and create their trackers. Returns {fqn: module}."""
        cfg = self.config
        targets = select_linears(model, include=cfg.include, exclude=cfg.exclude, module_types=cfg.module_types,
                                 min_features=cfg.min_features, module_filter_fn=self.module_filter_fn)
        if not targets:
            warnings.warn("ProbeCallback: no Linear matched the filters; nothing will be observed")
        self._remove_hooks()
        self.layers = {fqn: LayerProbe(fqn, module, cfg) for fqn, module in targets.items()}
        self._handles = [layer.module.register_forward_pre_hook(layer.stash_input) for layer in self.layers.values()]
        self._weights_due = {}  # step % interval -> the layers whose weights are observed then
        for index, layer in enumerate(self.layers.values()):
            self._weights_due.setdefault(index * cfg.interval // len(self.layers), []).append(layer)
        self.rank, self.world_size, self.attached = rank, world_size, True
        if self._pending_state is not None:
            self._apply_state(self._pending_state)
            self._pending_state = None
        return targets

    def on_train_start(self, state: TrainState) -> None:
        if state.run_dir is not None and self.run_dir is None:
            self.run_dir = Path(state.run_dir)
        if not self.layers:
            self.attach(state.model, rank=state.rank, world_size=state.world_size)
        self.rank, self.world_size = state.rank, state.world_size
        if self.rank == 0 and self.out_dir is None:
            raise ValueError("ProbeCallback needs an output place: set out_dir=... or TrainState.run_dir")
        if self.rank == 0:
            check_writable_dir(self.out_dir)
        if self.rank == 0 and self.config.tensorboard and self.writer is None:
            from torch.utils.tensorboard import SummaryWriter  # lazy: only rank 0 with TensorBoard on pays

            events_root = self.run_dir if self.run_dir is not None else self.out_dir.parent  # run's own events
            self.writer = SummaryWriter(log_dir=str(events_root / "tensorboard" / "probe"),
                                        purge_step=state.step + 1 if state.step else None)  # as TensorBoardLogger
        for layer in self.layers.values():
            layer.log_scalars = self.writer is not None and self.rank == 0
        if self.rank == 0:
            log.info("LoKA probe: %d layers, interval %d, state %.2f GiB (%s), stats -> %s", len(self.layers),
                     self.config.interval, self.state_bytes() / 2**30, self.config.stats_dtype, self.stats_path)

    def state_bytes(self) -> int:
        """Device memory the trackers of every target layer hold once each has been observed (weights included)."""
        return sum(layer.state_bytes() for layer in self.layers.values())

    # ----- observing -------------------------------------------------------------------------------------
    def on_step_start(self, state: TrainState) -> None:
        if not self.attached:  # else every step would pass unobserved and no file would be written
            raise RuntimeError("ProbeCallback: call on_train_start(state) (or attach(model)) before the first step")
        phase = state.step % self.config.interval
        arming = phase == 0 and not self._observing
        due = self._weights_due.get(phase, [])
        for layer in due:
            layer.observe_weight(self._weights)
        if arming:
            for layer in self.layers.values():
                if layer.weight.count == 0 and layer not in due:  # a layer's first weight comes with its first input
                    layer.observe_weight(self._weights)
                layer.armed = True
            self._observing = True

    def on_after_forward(self, state: TrainState) -> None:
        self._fold_inputs()

    def on_after_backward(self, state: TrainState) -> None:
        """Arm the hooks again while an observed step is in flight: under gradient accumulation another
        micro-batch's forward follows, and it is observed too (folded after its own forward, so the stash holds one
        micro-batch's inputs at a time). With no further forward the step's end disarms them unused."""
        self._arm_again()

    def on_eval_start(self, state: TrainState) -> None:
        """Evaluation inside an observed step (Lightning may validate between the micro-batches of an accumulated
        step): fold what the step's forwards stashed and disarm, so that no evaluation input is observed."""
        self._fold_inputs()

    def on_eval_end(self, state: TrainState) -> None:
        """Re-arm for the observed step's next micro-batch, if evaluation came inside one."""
        self._arm_again()

    def _arm_again(self) -> None:
        """Arm every hook while an observed step is in flight (no-op between observed steps)."""
        if self._observing:
            for layer in self.layers.values():
                layer.armed = True

    def on_step_end(self, state: TrainState) -> None:
        if self.writer is not None:
            self._scalars.write(self.writer, wait=False)
        if self._observing:
            self._fold_inputs()
            self._observing = False
            self._log_scalars(state.step)
        if (state.step + 1) % self.config.save_interval == 0:
            self.save(state.step)

    def _fold_inputs(self) -> None:
        """Disarm every hook and fold what it stashed (no-op between observed steps)."""
        if self._observing:
            for layer in self.layers.values():
                layer.fold_inputs()

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _log_scalars(self, step: int) -> None:
        """Queue the observed step's per-layer scalars for TensorBoard (written once they reach the host)."""
        if self.writer is None or self.rank != 0:
            return
        tags, values = [], []
        for fqn, layer in self.layers.items():
            if layer.scalars is None:
                continue
            tags += [f"probe/{fqn}/{name}" for name in SCALAR_NAMES[: layer.scalars.numel()]]
            values.append(layer.scalars)
            layer.scalars = None
        if values:
            self._scalars.submit(step, tags, torch.cat(values))

    # ----- saving ----------------------------------------------------------------------------------------
    def save(self, step: int) -> None:
        """Merge per-rank activation stats (collective: call on every rank) and write them from rank 0 in the
        background. Only the device-side clone is paid here; serialization and disk I/O are not."""
        self._weights.wait()
        merged = {fqn: all_reduce_moments(lp.activation.moments) for fqn, lp in self.layers.items()}
        self._last_saved_step = step  # on every rank: on_train_end must agree on whether to call save again
        if self.rank != 0:
            return
        snapshot = {"version": STATS_VERSION, "step": step, "world_size": self.world_size, "layers": {}}
        for fqn, lp in self.layers.items():
            if lp.weight.count == 0 or float(merged[fqn].count) <= 1:
                continue  # a layer not called yet has nothing to sample from
            activation = {**lp.activation.state_dict(), **dataclasses.asdict(merged[fqn])}
            snapshot["layers"][fqn] = {k: _device_clone(v) for k, v in lp.file_entry(activation).items()}
        if not snapshot["layers"]:
            return
        if self._saver is None:
            self._saver = AsyncSaver()
        self._saver.submit(lambda: seal_stats(to_cpu(snapshot)), self.stats_path)

    def on_train_end(self, state: TrainState) -> None:
        if self._last_saved_step != state.step and self._holds_statistics():
            self.save(state.step)
        self.close()

    def _holds_statistics(self) -> bool:
        """Whether any layer's weight was observed in this run or restored from a checkpoint: the same answer on
        every rank (weights are observed at the same steps everywhere and restored on every rank), so that the
        collective save is called by all ranks or none. A run resumed past its last observed step holds the
        checkpoint's statistics, which the file must still get."""
        return any(layer.weight.count > 0 for layer in self.layers.values())

    def on_exception(self, state: TrainState, exc: BaseException) -> None:
        self.close()  # finish writes already queued; the last complete file stays valid

    def close(self) -> None:
        """Remove hooks, order the queued weight updates, finish and stop the stats writer, flush TensorBoard."""
        self._fold_inputs()
        self._observing = False
        self._remove_hooks()
        self._weights.wait()
        if self._saver is not None:
            saver, self._saver = self._saver, None
            saver.close()
        if self.writer is not None:
            self._scalars.write(self.writer, wait=True)
            self.writer.flush()

    def wait(self) -> None:
        """Block until queued saves are on disk."""
        if self._saver is not None:
            self._saver.wait()

    # ----- checkpointing ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Rank-local partial statistics (merging needs all ranks, which state_dict may not be called on):
        {"rank": int, "layers": {fqn: {"activation": ActivationTracker.state_dict() (its ``calls`` numbers the
        row samples, so a resumed run samples the rows the uninterrupted run would), "weight": ...}}}."""
        self._weights.wait()
        return {"rank": self.rank, "layers": {fqn: {"activation": lp.activation.state_dict(),
                                                     "weight": lp.weight.state_dict()}
                                               for fqn, lp in self.layers.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._weights.wait()
        if self.layers:
            self._apply_state(state_dict)
        else:
            self._pending_state = state_dict

    def on_checkpoint_load(self, state: TrainState) -> None:
        """Attach to ``state.model`` now if a loaded state waits for it, so that a state that does not fit this
        run's layers or settings is refused while the checkpoint is loaded (the trainer's one-line error), not at
        the first step."""
        if self._pending_state is not None and not self.layers:
            self.attach(state.model, rank=state.rank, world_size=state.world_size)

    def _apply_state(self, state: dict) -> None:
        """ValueError naming the layer when its saved statistics do not fit its tracker (another shape, or other
        ``max_full_covariance`` / ``covariance_block`` / ``max_full_weight_factor`` settings)."""
        # A checkpoint written by another rank carries that rank's rows: adopting them here would count them
        # twice in the merge, so only the (rank-identical) weight statistics are restored in that case.
        same_rank = state.get("rank", 0) == self.rank
        for fqn, entry in state.get("layers", {}).items():
            if fqn not in self.layers:
                warnings.warn(f"ProbeCallback: checkpoint layer {fqn!r} is not a target now; skipped")
                continue
            try:
                self.layers[fqn].weight.load_state_dict(entry["weight"])
                if same_rank:
                    self.layers[fqn].activation.load_state_dict(entry["activation"])
            except ValueError as exc:
                raise ValueError(f"Probe statistics of layer {fqn!r} do not fit: {exc}") from None


def check_saved_state(state: dict[str, Any], config: ProbeConfig, *, rank: int = 0) -> None:
    """ValueError (one line, naming the layer) when a saved ``ProbeCallback.state_dict()`` holds a layer's statistics
    in another shape than ``config``'s trackers keep (other ``max_full_covariance``, ``covariance_block`` or
    ``max_full_weight_factor``), as ``load_state_dict`` would refuse it once attached. Every layer of ``state`` is
    checked, targets of this run or not. Shapes only: the tensors go to the meta device, so a memory-mapped state
    is not read; the activation statistics are checked where ``rank`` is the state's, as they are loaded."""
    for fqn, entry in state.get("layers", {}).items():
        activation, weight = _to_meta(entry["activation"]), _to_meta(entry["weight"])
        try:
            if state.get("rank", 0) == rank:
                ActivationTracker(activation["mean"].shape[0], max_full_covariance=config.max_full_covariance,
                                  covariance_block=config.covariance_block,
                                  device=torch.device("meta")).load_state_dict(activation)
            if int(weight["count"]) > 0:
                WeightTracker(*weight["mean"].shape, momentum=config.momentum,
                              max_full_covariance=config.max_full_weight_factor).load_state_dict(weight)
        except ValueError as exc:
            raise ValueError(f"Probe statistics of layer {fqn!r} do not fit: {exc}") from None


def _to_meta(entry: dict[str, Any]) -> dict[str, Any]:
    return {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in entry.items()}


class PendingScalars:
    """TensorBoard scalars on their way to the host: one asynchronous copy per observed step, written at a later
    step's end once it has landed, so that logging never makes the host wait for the GPU (a ``tolist()`` per layer
    would, on every observed step)."""

    def __init__(self) -> None:
        self._queue: list[tuple[int, list[str], torch.Tensor, Optional[torch.cuda.Event]]] = []

    def submit(self, step: int, tags: list[str], values: torch.Tensor) -> None:
        """values: (len(tags),) on any device."""
        event = None
        if values.is_cuda:
            values = values.to("cpu", non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self._queue.append((step, tags, values, event))

    def write(self, writer: Any, *, wait: bool) -> None:
        """Write the queued scalars whose copy has finished (all of them with ``wait``), oldest first."""
        while self._queue:
            step, tags, values, event = self._queue[0]
            if event is not None and not event.query():
                if not wait:
                    return
                event.synchronize()
            for tag, value in zip(tags, values.tolist()):
                writer.add_scalar(tag, value, step)
            self._queue.pop(0)


def _device_clone(value: Any) -> Any:
    """Clone tensors on their device (cheap, async on GPU) so later tracker updates do not change a snapshot."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _device_clone(v) for k, v in value.items()}
    return value
