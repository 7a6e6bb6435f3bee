"""rotate_into: RoPE written into a destination, bitwise apply_rotary; its inverse is RoPE's backward."""

from __future__ import annotations

import torch

from alchemist.model.rope import Rotation, apply_rotary, rotate_into


def test_rotate_into_is_apply_rotary_and_its_inverse_its_backward():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 8, generator=g, dtype=torch.float64)
    angles = torch.randn(7, 1, 4, generator=g, dtype=torch.float64)
    rot = Rotation(angles.cos(), angles.sin())
    out = torch.empty(7, 3, 16, dtype=torch.float64)[..., ::2]  # a strided destination, as the walk's views are
    rotate_into(x, rot, out)
    assert torch.equal(out, apply_rotary(x, rot))
    # The backward of y = RoPE(x): dL/dx = RoPE^T(dL/dy), the rotation by the opposite angle.
    x.requires_grad_()
    grad_y = torch.randn(7, 3, 8, generator=g, dtype=torch.float64)
    (apply_rotary(x, rot) * grad_y).sum().backward()
    grad_x = torch.empty_like(grad_y)
    rotate_into(grad_y, rot, grad_x, inverse=True)
    torch.testing.assert_close(grad_x, x.grad, rtol=0, atol=1e-14)
    assert torch.equal(grad_x, apply_rotary(grad_y, Rotation(rot.cos, -rot.sin)))
    assert rot.rows(2, 5).cos.shape[0] == 3 and torch.equal(rot.rows(5).sin, rot.sin[5:])
