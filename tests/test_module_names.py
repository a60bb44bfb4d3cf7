import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from loka_trainer.module_names import canonical_named_modules, compiled_alone


def test_every_wrapper_is_left_out_of_the_names_and_the_modules_wherever_it_is_nested():
    inner = nn.Sequential(nn.Linear(4, 4), checkpoint_wrapper(nn.Linear(4, 4)))
    model = nn.Sequential(torch.compile(inner, backend="eager"), torch.compile(nn.Linear(4, 4), backend="eager"))
    assert [(fqn, type(m).__name__) for fqn, m in canonical_named_modules(model)] == [
        ("", "Sequential"), ("0", "Sequential"), ("0.0", "Linear"), ("0.1", "Linear"), ("1", "Linear")]
    assert compiled_alone(model) == ["0", "1"]  # the checkpoint wrapper's forward calls the module it holds now


def test_a_ddp_wrapper_is_left_out_wherever_it_is_nested_and_a_users_child_named_module_is_kept(tmp_path):
    import torch.distributed as dist

    from loka_trainer.module_names import canonical_fqns

    def tower() -> nn.Module:
        model = nn.Module()
        model.module, model.head = nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 4)
        return model

    names = [fqn for fqn, _ in canonical_named_modules(tower())]
    assert names == ["", "module", "module.0", "head"]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel
        assert [fqn for fqn, _ in canonical_named_modules(ddp(tower()))] == names
        outer = nn.ModuleDict({"dense": ddp(tower())})  # as TorchRec's DMP holds a DDP-wrapped dense part
        assert [fqn for fqn, _ in canonical_named_modules(outer)] == ["", "dense", *(f"dense.{n}" for n in names[1:])]
        assert canonical_fqns(outer)["dense.module.module.0"] == "dense.module.0"
    finally:
        dist.destroy_process_group()
