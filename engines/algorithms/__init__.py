"""RL algorithms as small registries, one readable function each: advantages, policy losses, KL estimators,
loss aggregations, preference losses; plus truncated importance sampling and the staleness bound."""
from .advantages import ADVANTAGES, distill, dr_grpo, group_stats, grpo, reinforce_plus_plus, rloo, sequence_scores
from .aggregation import LOSS_AGGREGATIONS, seq_mean_token_mean, seq_mean_token_sum, token_mean
from .importance import ImportanceWeights, truncated_importance_weights
from .kl import KL_ESTIMATORS, k1, k2, k3, kl_penalty
from .policy_losses import POLICY_LOSSES, PolicyLossOutput, gspo, ppo_clip, sft
from .preference import PREFERENCE_LOSSES, PreferenceLossOutput, dpo, ipo
from .registry import Registry
from .staleness import StalenessDecision, StalenessPolicy, apply_staleness, is_stale

__all__ = [name for name in dir() if not name.startswith("_")]
