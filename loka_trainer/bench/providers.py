"""Built-in providers: a plain (module, inputs) pair, the example models, a user's module factory named on the
command line, and any zoo model with its data."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
from torch import nn

from loka_trainer.bench.examples import MLPTree, NanoGPT
from loka_trainer.bench.plugins import Component, Provider
from loka_trainer.bench.preprocessors import batch_size_of
from loka_trainer.bench.tree import ModuleInputs


class ModuleProvider(Provider):
    """Wrap a model you already have: ``ModuleProvider(model, x)`` or ``ModuleProvider(model, (a, b), {"k": c})``.

    batch_size: the inputs' batch size, needed only for batch replication (default: `batch_size_of` the inputs:
    dim 0 of a tensor, the stride of a TorchRec KJT, the length of a trainer ``Batch``, whichever comes first,
    positional before keyword, inside tuples, lists and dicts too).
    """

    def __init__(self, model: nn.Module, args: Any, kwargs: Optional[dict] = None,
                 batch_size: Optional[int] = None) -> None:
        self.model = model
        self.args = args if isinstance(args, tuple) else (args,)
        self.kwargs = kwargs or {}
        self.batch_size = batch_size if batch_size is not None else batch_size_of((self.args, self.kwargs))

    def get_component(self, device: torch.device) -> Component:
        def move(x: Any) -> Any:
            return x.to(device) if hasattr(x, "to") and not isinstance(x, nn.Module) else x

        args = tuple(move(a) for a in self.args)
        kwargs = {k: move(v) for k, v in self.kwargs.items()}
        return Component(self.model.to(device), ModuleInputs(args, kwargs), self.batch_size)


def _mlp_tree(batch_size: int) -> tuple[nn.Module, torch.Tensor]:
    return MLPTree(), torch.randn(batch_size, 16)


def _nanogpt(batch_size: int) -> tuple[nn.Module, torch.Tensor]:
    model = NanoGPT()
    return model, torch.randint(0, 128, (batch_size, 32))


EXAMPLES: dict[str, Callable[[int], tuple[nn.Module, torch.Tensor]]] = {
    "mlp_tree": _mlp_tree,
    "nanogpt": _nanogpt,
}


class ExampleProvider(Provider):
    """One of ``EXAMPLES`` (no trainer needed) with random inputs of ``batch_size`` rows."""

    def __init__(self, name: str, batch_size: int = 8, seed: int = 0) -> None:
        if name not in EXAMPLES:
            raise ValueError(f"bench.example={name!r} is unknown; valid values: {sorted(EXAMPLES)}")
        self.name, self.batch_size, self.seed = name, batch_size, seed

    def get_component(self, device: torch.device) -> Component:
        torch.manual_seed(self.seed)
        model, x = EXAMPLES[self.name](self.batch_size)
        return ModuleProvider(model, x).get_component(device)


class FactoryProvider(Provider):
    """A user's module from the command line: ``bench.factory=package.module:function``, where
    ``function(batch_size) -> (module, example input)`` (as ``EXAMPLES``' entries; the input a tensor or a tuple of
    positional arguments). It is called here, so any error in it is one line before anything is written."""

    def __init__(self, spec: str, batch_size: int = 8, seed: int = 0) -> None:
        from loka_trainer.user_code import import_callable  # noqa: PLC0415

        factory = import_callable(spec, option="bench.factory", expects="a function(batch_size) -> (module, input)")
        torch.manual_seed(seed)
        try:
            made = factory(batch_size)
        except Exception as exc:  # noqa: BLE001 - the user's code: report it in one line
            raise ValueError(f"bench.factory {spec!r} failed: {type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
        if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module)):
            raise ValueError(f"bench.factory {spec!r} returned {type(made).__name__}, expected (module, input)")
        self.name = spec.rpartition(":")[2].rpartition(".")[2]
        self._provider = ModuleProvider(*made)

    def get_component(self, device: torch.device) -> Component:
        return self._provider.get_component(device)


class ZooProvider(Provider):
    """A zoo model (``loka_trainer.models.zoo``) and one batch of its data stream (``loka_trainer.data``).

    model_cfg / data_cfg: the typed configs the trainer uses; batch_size > 0 overrides ``data_cfg.batch_size``.
    The model's forward takes a ``Batch`` (KJTs inside); batch replication scales it whole (`replicate_object`).
    """

    def __init__(self, model_cfg: Any, data_cfg: Any, *, batch_size: int = 0, loka_mods: bool = False) -> None:
        self.model_cfg, self.data_cfg, self.loka_mods = model_cfg, data_cfg, loka_mods
        if batch_size > 0:
            self.data_cfg = dataclasses.replace(data_cfg, batch_size=batch_size)

    def get_component(self, device: torch.device) -> Component:
        from loka_trainer.data import build_stream, data_schema  # noqa: PLC0415 -- trainer parts only here
        from loka_trainer.models.zoo import build_model  # noqa: PLC0415

        schema = data_schema(self.data_cfg)
        model = build_model(self.model_cfg, schema=schema, loka_mods=self.loka_mods).to(device)
        batch = next(iter(build_stream(self.data_cfg, split="train", rank=0, world_size=1))).to(device)
        return Component(model, ModuleInputs((batch,), {}), len(batch))


PROVIDERS: dict[str, type[Provider]] = {
    "module": ModuleProvider,
    "example": ExampleProvider,
    "factory": FactoryProvider,
    "zoo": ZooProvider,
}
