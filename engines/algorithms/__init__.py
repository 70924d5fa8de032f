"""RL algorithms as small registries, one readable function each: advantages, policy losses, KL estimators,
loss aggregations, preference losses, off-policy importance corrections; the adaptive KL controller and the
staleness bound.

Importing the package loads no torch: the registries (:mod:`.catalog`) name their functions and import them on
first use, and the functions below are imported from their modules when first named."""
from __future__ import annotations

import importlib

from .catalog import (ADVANTAGES, IMPORTANCE_CORRECTIONS, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES,
                      PREFERENCE_LOSSES)
from .registry import Registry

# name -> the module (of this package) that defines it
_LAZY = {
    **dict.fromkeys(("distill", "dr_grpo", "group_stats", "grpo", "reinforce_plus_plus", "rloo", "sequence_scores"),
                    "advantages"),
    **dict.fromkeys(("seq_mean_token_mean", "seq_mean_token_sum", "token_mean"), "aggregation"),
    **dict.fromkeys(("Correction", "CorrectionCounts", "ImportanceWeights", "behaviour_weights", "no_corrections",
                     "truncated_importance_weights"), "importance"),
    **dict.fromkeys(("chord_mu", "chord_weights"), "chord"),
    **dict.fromkeys(("cispo",), "cispo"),
    **dict.fromkeys(("gae", "gae_advantages_and_returns", "gae_returns", "masked_whiten"), "gae"),
    **dict.fromkeys(("KlController",), "kl_control"),
    **dict.fromkeys(("opmd", "opmd_advantage"), "opmd"),
    **dict.fromkeys(("sapo",), "sapo"),
    **dict.fromkeys(("topr",), "topr"),
    **dict.fromkeys(("ValueLossOutput", "clipped_value_loss"), "value_loss"),
    **dict.fromkeys(("k1", "k2", "k3", "kl_penalty"), "kl"),
    **dict.fromkeys(("PolicyLossOutput", "gspo", "ppo_clip", "sft", "sft_phi"), "policy_losses"),
    **dict.fromkeys(("PreferenceLossOutput", "dpo", "ipo"), "preference"),
    **dict.fromkeys(("StalenessDecision", "StalenessPolicy", "apply_staleness", "is_stale"), "staleness"),
}

__all__ = ["ADVANTAGES", "IMPORTANCE_CORRECTIONS", "KL_ESTIMATORS", "LOSS_AGGREGATIONS", "POLICY_LOSSES",
           "PREFERENCE_LOSSES", "Registry", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value
