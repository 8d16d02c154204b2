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
    """Return an approximately orthogonal matrix with the singular vectors of ``matrix``.

    ``matrix`` is one matrix (2-D) or a batch of matrices (3-D, ``[batch, rows, cols]``), each
    orthogonalised on its own: normalised by its own norm, iterated with batched matmuls. One
    batched call costs what one call per matrix would in arithmetic, with one kernel launch per
    product instead of one per matrix (the experts of an MoE layer). Works on the wide
    orientation (rows <= cols) so the Gram matrix is the small one.
    """
    if matrix.ndim not in (2, 3):
        raise ValueError(f"orthogonalize expects a matrix or a batch of matrices, got shape {tuple(matrix.shape)}")
    if steps < 0:
        raise ValueError(f"ns_steps must be >= 0, got {steps}")
    a, b, c = QUINTIC_COEFFS
    tall = matrix.size(-2) > matrix.size(-1)
    x = matrix.mT if tall else matrix
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        gram = x @ x.mT
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    return x.mT if tall else x
