"""trainer.dense_optimizer: Adam and AdamW run torch's fused implementation, with the same updates as the default."""
from __future__ import annotations

import pytest
import torch

from loka_trainer.config import DENSE_OPTIMIZERS


@pytest.mark.parametrize("name, plain", [("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW)])
def test_adam_family_is_fused_and_steps_like_the_default(name, plain):
    torch.manual_seed(0)
    weights = [torch.randn(16, 8, requires_grad=True), torch.randn(8, requires_grad=True)]
    twins = [w.detach().clone().requires_grad_() for w in weights]
    fused, default = DENSE_OPTIMIZERS[name](weights, lr=1e-2), plain(twins, lr=1e-2)
    assert fused.defaults["fused"] is True and not default.defaults["fused"]
    for _ in range(3):
        grads = [torch.randn_like(w) for w in weights]
        for opt, params in ((fused, weights), (default, twins)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
    for a, b in zip(weights, twins):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
