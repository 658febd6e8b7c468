"""The release's `no-align+fused-gelu-mlp` projector: fused patch features to the LLM's width.

fc1 (vision_dim -> 4 * vision_dim), GELU, fc2 (-> llm_dim), GELU, fc3 (llm_dim -> llm_dim); both GELUs are exact (erf).
Names are the release's (`projector.fc1/2/3`); at full size fc1 [8704, 2176], fc2 [4096, 8704], fc3 [4096, 4096].
"""

from __future__ import annotations

import torch
from torch import nn

ARCH_SPECIFIER = "no-align+fused-gelu-mlp"  # config.json `arch_specifier` this module implements


class FusedGeluMLPProjector(nn.Module):
    """Three-layer MLP for a fused (DINOv2 + SigLIP) backbone; widens 4x first, as the release does."""

    def __init__(self, vision_dim: int = 1024 + 1152, llm_dim: int = 4096) -> None:
        super().__init__()
        hidden = 4 * vision_dim  # the release's `initial_projection_dim` for fused backbones
        self.fc1 = nn.Linear(vision_dim, hidden)
        self.act_fn1 = nn.GELU(approximate="none")
        self.fc2 = nn.Linear(hidden, llm_dim)
        self.act_fn2 = nn.GELU(approximate="none")
        self.fc3 = nn.Linear(llm_dim, llm_dim)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [B, N, vision_dim] -> [B, N, llm_dim]."""
        return self.fc3(self.act_fn2(self.fc2(self.act_fn1(self.fc1(patches)))))
