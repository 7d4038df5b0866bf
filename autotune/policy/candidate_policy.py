"""The chooser of real runs' network (``envs.acquisition``): one scorer shared by every candidate slot.

A candidate's logit is a small MLP of its own features and the global ones (the same weights for every slot,
so what it learns of one candidate holds for all, in any order); the value is an MLP of the whole
observation. ``net_arch`` gives both MLPs' hidden widths, tanh between layers. Used by MaskablePPO
(``policy=CandidatePolicy``) and written and read by ``autotune.policy.policy_file`` like any policy (its
layout, ``envs.acquisition.LAYOUT``, names this network).
"""

from __future__ import annotations

import torch
from sb3_contrib.common.maskable.policies import MaskableActorCriticPolicy
from torch import nn

from envs.acquisition import CANDIDATE_FEATURES, GLOBAL_FEATURES, MAX_CANDIDATES


def _mlp(inputs: int, widths: list[int], activation_fn, outputs: int | None) -> nn.Sequential:
    layers: list[nn.Module] = []
    for w in widths:
        layers += [nn.Linear(inputs, w), activation_fn()]
        inputs = w
    if outputs is not None:
        layers.append(nn.Linear(inputs, outputs))
    return nn.Sequential(*layers)


class CandidateScorer(nn.Module):
    """``forward_actor``: one logit per slot; ``forward_critic``: the value's latent features."""

    def __init__(self, widths: list[int], activation_fn) -> None:
        super().__init__()
        per_slot = len(CANDIDATE_FEATURES) + len(GLOBAL_FEATURES)
        self.score = _mlp(per_slot, widths, activation_fn, 1)
        self.value = _mlp(MAX_CANDIDATES * len(CANDIDATE_FEATURES) + len(GLOBAL_FEATURES), widths, activation_fn, None)
        self.latent_dim_pi = MAX_CANDIDATES
        self.latent_dim_vf = widths[-1]

    def forward_actor(self, x: torch.Tensor) -> torch.Tensor:
        k, f = MAX_CANDIDATES, len(CANDIDATE_FEATURES)
        slots = x[:, : k * f].reshape(-1, k, f)
        glob = x[:, k * f :].unsqueeze(1).expand(-1, k, -1)
        return self.score(torch.cat([slots, glob], dim=-1)).squeeze(-1)

    def forward_critic(self, x: torch.Tensor) -> torch.Tensor:
        return self.value(x)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.forward_actor(x), self.forward_critic(x)


class CandidatePolicy(MaskableActorCriticPolicy):
    """MaskablePPO's actor-critic with ``CandidateScorer``: the slots' logits are the action distribution's."""

    def _build_mlp_extractor(self) -> None:
        self.mlp_extractor = CandidateScorer(list(self.net_arch), self.activation_fn)

    def _build(self, lr_schedule) -> None:
        super()._build(lr_schedule)
        self.action_net = nn.Identity()  # the scorer's logits are the moves' logits
        self.optimizer = self.optimizer_class(self.parameters(), lr=lr_schedule(1), **self.optimizer_kwargs)
