"""``model.lora``: train low-rank adapters instead of the whole model (:mod:`streamrft.engines.lora` trains,
publishes and merges them)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

# the linear projections of a Llama-style decoder layer (attention and MLP); the output head stays full rank
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# written into a published version's manifest metadata: what the tensors are
PAYLOAD_KEY = "payload"
ADAPTER_PAYLOAD = "lora_adapter"


class LoraSettings(BaseModel):
    """``model.lora``: train low-rank adapters instead of the whole model (``peft``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int = Field(default=16, ge=1, le=1024, description="r, the adapters' inner dimension")
    alpha: float = Field(default=32.0, gt=0, description="scale: the update is (alpha / rank) · B @ A")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout on the adapters' input while training")
    target_modules: tuple[str, ...] = Field(
        default=DEFAULT_TARGETS, min_length=1,
        description="names (last part) of the linear modules that get adapters, e.g. q_proj, v_proj")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def metadata(self) -> dict[str, str]:
        """What a published adapter's manifest says about itself."""
        return {PAYLOAD_KEY: ADAPTER_PAYLOAD, "lora_rank": str(self.rank), "lora_alpha": repr(self.alpha),
                "lora_target_modules": ",".join(self.target_modules)}

    def peft_config(self, task_type: str | None = "CAUSAL_LM"):
        """peft's config of these adapters; ``task_type`` None for a model that is not a causal LM (the critic's
        backbone, whose value head is not peft's to know)."""
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=list(self.target_modules), bias="none", task_type=task_type)
