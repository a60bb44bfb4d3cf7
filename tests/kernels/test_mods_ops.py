"""Plain-torch twins of the fused Mods kernels: forward and the closed-form dz against autograd."""
from __future__ import annotations

import pytest
import torch

from loka_trainer.kernels.mods_ops import linear_mods, mods_backward_ref, mods_forward_ref
from loka_trainer.kernels.mods_ref import block_norm, hard_swish


@pytest.mark.parametrize("block", [16, 64])
def test_closed_form_dz_matches_autograd(block):
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(24, 128, generator=g) * 2).double().requires_grad_()
    dh = torch.randn(24, 128, generator=g).double()
    hard_swish(block_norm(z, block)).backward(dh)
    _, u, r = mods_forward_ref(z.detach(), block, 1e-6)
    # u is stored in bf16 (what the kernel saves), so compare at bf16 precision
    assert float((mods_backward_ref(dh, u, r, block).double() - z.grad).norm() / z.grad.norm()) < 1e-2


def test_forward_ref_matches_mods_reference():
    z = torch.randn(8, 512)
    h, u, r = mods_forward_ref(z, 256, 1e-6)
    torch.testing.assert_close(h.float(), hard_swish(block_norm(z, 256)), rtol=1e-2, atol=1e-2)
    assert r.shape == (8, 2) and torch.allclose(u.float().unflatten(-1, (2, 256)).square().mean(-1),
                                                torch.ones(8, 2), atol=2e-2)


def test_unknown_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="valid:"):
        linear_mods(torch.randn(4, 32), torch.randn(256, 32), mode="fast")
