"""Quintic Newton-Schulz iteration that maps a matrix to (approximately) its orthogonal factor.

The coefficients (3.4445, -4.7750, 2.0315) are the ones published with Muon by Keller Jordan:
they push all singular values into roughly [0.7, 1.2] in five iterations rather than converging
exactly, which is what the optimizer needs and costs a handful of matmuls.
"""

from __future__ import annotations

import torch

__all__ = ["QUINTIC_COEFFS", "orthogonalize"]

QUINTIC_COEFFS = (3.4445, -4.7750, 2.0315)


def orthogonalize(matrix: torch.Tensor, steps: int, eps: float = 1e-7) -> torch.Tensor:
    """Return an approximately orthogonal matrix with the singular vectors of ``matrix`` (2-D).

    Works on the wide orientation (rows <= cols) so the Gram matrix is the small one.
    """
    if matrix.ndim != 2:
        raise ValueError(f"orthogonalize expects a 2-D tensor, got shape {tuple(matrix.shape)}")
    if steps < 0:
        raise ValueError(f"ns_steps must be >= 0, got {steps}")
    a, b, c = QUINTIC_COEFFS
    tall = matrix.size(0) > matrix.size(1)
    x = matrix.mT if tall else matrix
    x = x / (x.norm() + eps)
    for _ in range(steps):
        gram = x @ x.mT
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    return x.mT if tall else x
