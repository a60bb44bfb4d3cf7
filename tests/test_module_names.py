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
