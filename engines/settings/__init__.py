"""The engines' settings: plain pydantic models that import no torch, so the run config (which composes them),
a ``--help`` or a config check never pays for the ML. The engines import these; never the other way round.

- :mod:`.training`: the optimiser and algorithm knobs of the training engine;
- :mod:`.lora`: LoRA adapters (``model.lora``);
- :mod:`.judge`: the ``judge`` reward's settings;
- :mod:`.limits`: caps on the work one task may ask for;
- :mod:`.reward_shaping`: the rollout worker's reward shaping (DAPO's overlong penalty).
"""
