"""A DQN Q-network that scores each of HYDRA's instruction samples with one set of shared weights.

HYDRA's Q-network (SB3's ``MlpPolicy``) reads the whole ``per_part`` observation ``[context, sample_1 .. sample_N,
p_1 .. p_N]`` as one vector, so it has to learn the same judgement once per slot, although the planner's list
order carries no meaning. :class:`PerSampleDQNPolicy` scores every slot with the same network instead:

* sample ``i`` (actions ``0 .. N-1``): one MLP (``net_arch``, shared by the N slots) over
  ``[context, sample_i, context * sample_i, sample_i - mean of the samples, p_i, rank of p_i, p_i - max p]``,
  where the context embedding holds the task, the question, the iteration and the memory, and the rank is the
  number of samples with a strictly higher probability over ``N - 1`` (ties share a rank);
* re-plan (action ``N``): a separate MLP over ``[context, mean of the samples, max p, mean p]``.

Permuting the N samples (and their probabilities) permutes their N Q-values and leaves re-plan's unchanged.
The layout (N and the embedding size) comes from the environment's ``describe()``
(:func:`per_sample_layout`), and is saved with the model (``policy_kwargs``), so ``DQN.load`` rebuilds it
wherever this module is importable; the exported ``q_network.pt`` (TorchScript) needs no clova-train at all.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from gymnasium import spaces
from stable_baselines3.common.policies import BasePolicy
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor, create_mlp
from stable_baselines3.dqn.policies import DQNPolicy, QNetwork
from torch import nn

__all__ = ["PerSampleDQNPolicy", "PerSampleQNetwork", "per_sample_layout", "sample_feature_dim"]


def sample_feature_dim(embedding_dim: int) -> int:
    """Size of one sample's feature vector (what the shared MLP reads)."""
    return 4 * embedding_dim + 3


def per_sample_layout(description: Mapping[str, Any]) -> tuple[int, int]:
    """``(N, embedding size)`` of a HYDRA ``per_part`` observation, from its environment's ``describe()``.

    Raises:
        ValueError: the observation is not ``[context, sample_1 .. sample_N, probabilities]`` back to back (one
            message saying what it is instead).
    """
    parts = description.get("observation_parts") or {}
    names = [name for name, _ in sorted(parts.items(), key=lambda item: item[1][0])]
    n = int(description.get("num_samples") or 0)
    expected = ["context", *(f"sample_{i + 1}" for i in range(n)), "probabilities"]
    if description.get("environment") != "hydra" or names != expected or n < 1:
        raise ValueError(f"a per-sample Q-network reads HYDRA's per_part observation {expected or '[context, ...]'}; "
                         f"this environment ({description.get('environment')!r}) gives {names}")
    dim = parts["context"][1] - parts["context"][0]
    position = 0
    for name in expected:
        start, end = parts[name]
        size = n if name == "probabilities" else dim
        if start != position or end - start != size:
            raise ValueError(f"observation part {name!r} spans [{start}, {end}); a per-sample Q-network expects "
                             f"[{position}, {position + size})")
        position = end
    return n, dim


class PerSampleQNetwork(QNetwork):
    """Q-values ``[batch, N + 1]`` of a ``per_part`` observation: one shared MLP per sample slot, one for re-plan.

    Args:
        observation_space: the flat observation space (size ``(N + 1) * embedding_dim + N``).
        action_space: ``Discrete(N + 1)``.
        features_extractor: SB3's (a ``FlattenExtractor``).
        features_dim: the observation size.
        num_samples: N.
        embedding_dim: size of the context and of each sample embedding.
        net_arch: hidden layer sizes of both heads.
        activation_fn: activation of both heads.
        normalize_images: SB3's flag (no images here).
    """

    def __init__(self, observation_space: spaces.Space, action_space: spaces.Discrete,
                 features_extractor: BaseFeaturesExtractor, features_dim: int, num_samples: int, embedding_dim: int,
                 net_arch: list[int] | None = None, activation_fn: type[nn.Module] = nn.ReLU,
                 normalize_images: bool = True) -> None:
        BasePolicy.__init__(self, observation_space, action_space, features_extractor=features_extractor,
                            normalize_images=normalize_images)  # not QNetwork's: it would build the flat MLP
        expected = (num_samples + 1) * embedding_dim + num_samples
        if num_samples < 1 or embedding_dim < 1 or features_dim != expected or int(action_space.n) != num_samples + 1:
            raise ValueError(f"a per-sample Q-network over {num_samples} samples of {embedding_dim}-d embeddings "
                             f"takes {expected} observation entries and {num_samples + 1} actions, got "
                             f"{features_dim} and {int(action_space.n)}")
        self.net_arch = list(net_arch) if net_arch is not None else [64, 64]
        self.activation_fn = activation_fn
        self.features_dim = features_dim
        self.num_samples, self.embedding_dim = num_samples, embedding_dim
        self.sample_head = nn.Sequential(*create_mlp(sample_feature_dim(embedding_dim), 1, self.net_arch,
                                                     activation_fn))
        self.replan_head = nn.Sequential(*create_mlp(2 * embedding_dim + 2, 1, self.net_arch, activation_fn))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = self.extract_features(obs, self.features_extractor)
        n, d = self.num_samples, self.embedding_dim
        context = x[:, :d]
        samples = x[:, d:(n + 1) * d].reshape(-1, n, d)
        probabilities = x[:, (n + 1) * d:(n + 1) * d + n]
        higher = (probabilities.unsqueeze(1) > probabilities.unsqueeze(2)).to(x.dtype).sum(2)  # [b, i]: p_j > p_i
        rank = higher / max(n - 1, 1)
        best = probabilities.max(1, keepdim=True).values
        pooled = samples.mean(1)
        shared_context = context.unsqueeze(1).expand(-1, n, -1)
        features = torch.cat([shared_context, samples, shared_context * samples, samples - pooled.unsqueeze(1),
                              probabilities.unsqueeze(2), rank.unsqueeze(2), (probabilities - best).unsqueeze(2)], 2)
        sample_q = self.sample_head(features).squeeze(2)
        replan_q = self.replan_head(torch.cat([context, pooled, best, probabilities.mean(1, keepdim=True)], 1))
        return torch.cat([sample_q, replan_q], 1)

    def _get_constructor_parameters(self) -> dict[str, Any]:
        return super()._get_constructor_parameters() | {"num_samples": self.num_samples,
                                                        "embedding_dim": self.embedding_dim}


class PerSampleDQNPolicy(DQNPolicy):
    """SB3 DQN policy whose Q-network (and target) is a :class:`PerSampleQNetwork`.

    Args:
        observation_space, action_space, lr_schedule, net_arch, activation_fn, **kwargs: ``DQNPolicy``'s.
        num_samples: N (from :func:`per_sample_layout`).
        embedding_dim: the embedding size (from :func:`per_sample_layout`).
    """

    def __init__(self, observation_space: spaces.Space, action_space: spaces.Discrete, lr_schedule: Any,
                 net_arch: list[int] | None = None, activation_fn: type[nn.Module] = nn.ReLU, *,
                 num_samples: int, embedding_dim: int, **kwargs: Any) -> None:
        self._layout = (int(num_samples), int(embedding_dim))  # read by make_q_net, which DQNPolicy's init calls
        super().__init__(observation_space, action_space, lr_schedule, net_arch, activation_fn, **kwargs)

    @property
    def num_samples(self) -> int:
        return self._layout[0]

    @property
    def embedding_dim(self) -> int:
        return self._layout[1]

    def make_q_net(self) -> PerSampleQNetwork:
        net_args = self._update_features_extractor(self.net_args, features_extractor=None)
        return PerSampleQNetwork(**net_args, num_samples=self.num_samples,
                                 embedding_dim=self.embedding_dim).to(self.device)

    def _get_constructor_parameters(self) -> dict[str, Any]:
        return super()._get_constructor_parameters() | {"num_samples": self.num_samples,
                                                        "embedding_dim": self.embedding_dim}
