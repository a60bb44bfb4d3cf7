"""The hooks a user registered on a module that LoKA swaps for another (``LoKALinear``, ``FusedLinearMods``).

A swap builds a new module, so without this every hook on the old one (a forward hook that logs activations, the
LoKA Probe's input hook, a state_dict hook) would stop running without a word. The new module takes over the old
one's hook dicts themselves, so the handles the user holds still remove them.
"""
from __future__ import annotations

from torch import nn

# nn.Module's hook registries, by what a hook there sees
FORWARD_PRE_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs")  # the module's input
OUTPUT_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_hooks",
                "_backward_pre_hooks")  # its output or the gradients at its boundary
STATE_DICT_HOOKS = ("_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                    "_load_state_dict_post_hooks")
ALL_HOOKS = FORWARD_PRE_HOOKS + OUTPUT_HOOKS + STATE_DICT_HOOKS


def held_hooks(module: nn.Module, kinds: tuple[str, ...] = ALL_HOOKS) -> list[str]:
    """The registries among ``kinds`` in which ``module`` holds at least one hook."""
    return [kind for kind in kinds if getattr(module, kind, None)]


def carry_hooks(old: nn.Module, new: nn.Module, kinds: tuple[str, ...] = ALL_HOOKS) -> None:
    """Give ``new`` (the module that replaces ``old``) ``old``'s hook registries among ``kinds``: the same dict
    objects, so a handle from ``old.register_*_hook`` removes the hook from ``new``."""
    for kind in kinds:
        setattr(new, kind, getattr(old, kind))
    if "_backward_hooks" in kinds:
        new._is_full_backward_hook = old._is_full_backward_hook
