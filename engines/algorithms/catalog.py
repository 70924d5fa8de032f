"""The built-in algorithms of each registry, by name and place: the one list of what exists. Nothing is
imported here (no torch): a name is checked without loading its function, which is imported when first used.
A new built-in is a function in its module and a line here."""
from .registry import Registry

PACKAGE = "streamrft.engines.algorithms"

ADVANTAGES: Registry = Registry("advantage estimator", group="streamrft.advantages", builtins={
    "grpo": f"{PACKAGE}.advantages:grpo",
    "grpo_reward_to_go": f"{PACKAGE}.advantages:grpo_reward_to_go",
    "dr_grpo": f"{PACKAGE}.advantages:dr_grpo",
    "rloo": f"{PACKAGE}.advantages:rloo",
    "reinforce_plus_plus": f"{PACKAGE}.advantages:reinforce_plus_plus",
    "distill": f"{PACKAGE}.advantages:distill",
    "opmd": f"{PACKAGE}.opmd:opmd_advantage",
    "gae": f"{PACKAGE}.gae:gae",
    "remax": f"{PACKAGE}.remax:remax",
    "gigpo": f"{PACKAGE}.gigpo:gigpo",
    "step_grpo": f"{PACKAGE}.gigpo:step_grpo",
})

POLICY_LOSSES: Registry = Registry("policy loss", group="streamrft.policy_losses", builtins={
    "ppo_clip": f"{PACKAGE}.policy_losses:ppo_clip",
    "decoupled_ppo": f"{PACKAGE}.policy_losses:decoupled_ppo",
    "gspo": f"{PACKAGE}.policy_losses:gspo",
    "sft": f"{PACKAGE}.policy_losses:sft",
    "cispo": f"{PACKAGE}.cispo:cispo",
    "sapo": f"{PACKAGE}.sapo:sapo",
    "topr": f"{PACKAGE}.topr:topr",
    "opmd": f"{PACKAGE}.opmd:opmd",
    "sft_phi": f"{PACKAGE}.policy_losses:sft_phi",
})

LOSS_AGGREGATIONS: Registry = Registry("loss aggregation", group="streamrft.loss_aggregations", builtins={
    "token-mean": f"{PACKAGE}.aggregation:token_mean",
    "seq-mean-token-sum": f"{PACKAGE}.aggregation:seq_mean_token_sum",
    "seq-mean-token-mean": f"{PACKAGE}.aggregation:seq_mean_token_mean",
})

KL_ESTIMATORS: Registry = Registry("KL estimator", group="streamrft.kl_estimators", builtins={
    "k1": f"{PACKAGE}.kl:k1",
    "k2": f"{PACKAGE}.kl:k2",
    "k3": f"{PACKAGE}.kl:k3",
})

PREFERENCE_LOSSES: Registry = Registry("preference loss", group="streamrft.preference_losses", builtins={
    "dpo": f"{PACKAGE}.preference:dpo",
    "ipo": f"{PACKAGE}.preference:ipo",
})

# Off-policy corrections between the sampler and the trainer (importance.py): the ratio per token, per sequence or
# its geometric mean, truncated (*_tis) or masked outside a band (*_mis; icepop is the token-level one).
IMPORTANCE_CORRECTIONS: Registry = Registry("importance correction", group="streamrft.importance_corrections",
                                            builtins={
    "tis": f"{PACKAGE}.importance:tis",
    "icepop": f"{PACKAGE}.importance:icepop",
    "seq_tis": f"{PACKAGE}.importance:seq_tis",
    "seq_mis": f"{PACKAGE}.importance:seq_mis",
    "geo_tis": f"{PACKAGE}.importance:geo_tis",
    "geo_mis": f"{PACKAGE}.importance:geo_mis",
})
