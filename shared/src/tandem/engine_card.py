"""The engine behind the gateway as its `/v1/models` shows it, and whether a run's adapters fit it.

The gateway lists the engine's base model as the card with a `root` (the hub id or path the
engine was started with; the card's `id` is the name it serves it under) and, under `lora`, the
adapters the engine can load (`max_rank`, `target_modules`). A run is checked against it when it
is created, so that a run the engine could not serve is refused with the fix, not after its first
train step when the engine refuses to load the version.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.errors import ValidationFailed
from tandem.runs import RunSpec, same_base_model

__all__ = ["FUSED_MODULES", "EngineCard"]

FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""SGLang's names for the projections it fuses: in an engine's target modules they stand for their parts."""


@dataclass(frozen=True)
class EngineCard:
    """The engine's base model: what it loaded (`model`), the name it serves it under, its LoRA limits."""

    model: str
    served_name: str
    lora: dict[str, Any] | None = None
    """The card's `lora`: `max_rank` and `target_modules` ("all": any) where the gateway says them."""

    @classmethod
    def of(cls, models: dict[str, Any]) -> EngineCard | None:
        """The base model's card in a `/v1/models` answer (the one with a `root`); None when there is none."""
        cards = models.get("data")
        for card in cards if isinstance(cards, list) else []:
            if isinstance(card, dict) and isinstance(card.get("root"), str) and card["root"]:
                lora = card.get("lora")
                return cls(str(card["root"]), str(card.get("id") or ""), lora if isinstance(lora, dict) else None)
        return None

    def fit(self, spec: RunSpec, gateway_url: str, *, subject: str | None = None) -> RunSpec:
        """The spec to register: refused unless its base model is the engine's (`runs.same_base_model`)
        and its adapters load there; the engine's served name (`base`) is replaced by the model
        itself, which is what the trainer loads. `gateway_url` is named in the refusals. A run named
        as the engine serves its base model is refused: `model=<that name>` reaches the base model,
        so the run's own rollouts would never come from its adapters. `subject` names what asks in
        the refusals (default: the run, by name)."""
        who = subject or f"run {spec.name!r}"
        if self.served_name and spec.name == self.served_name:
            raise ValidationFailed(
                f"run name {spec.name!r} is the name the engine behind {gateway_url} serves its base model "
                f"under: model={spec.name!r} would reach the base model, never the run's adapters; choose "
                "another run name",
                field="name",
            )
        if not same_base_model(spec.base_model, self.model, self.served_name):
            raise ValidationFailed(
                f"{who} asks for base_model {spec.base_model!r}, but the engine behind "
                f"{gateway_url} serves {self.model!r} (as {self.served_name!r}); its adapters would "
                f"not fit: create the run with base_model={self.model!r}, or start the stack with that model "
                "(TANDEM_ENGINE__MODEL)",
                field="base_model",
            )
        self._check_lora(spec, gateway_url, who)
        if spec.base_model == self.served_name != self.model and not same_base_model(spec.base_model, self.model):
            return spec.model_copy(update={"base_model": self.model})  # a name no trainer could load
        return spec

    def _check_lora(self, spec: RunSpec, gateway_url: str, who: str) -> None:
        """Refuse a run whose adapters the engine would refuse to load (after their first step):
        a rank above its max_lora_rank, or modules outside its target modules ("all": any; SGLang's
        fused names stand for their parts)."""
        if self.lora is None:
            return
        max_rank = self.lora.get("max_rank")
        if isinstance(max_rank, int) and spec.lora.r > max_rank:
            raise ValidationFailed(
                f"{who} asks for lora.r={spec.lora.r}, but the engine behind {gateway_url} "
                f"loads adapters up to rank {max_rank}: create the run with r <= {max_rank}, or start the "
                f"stack with TANDEM_ENGINE__MAX_LORA_RANK >= {spec.lora.r}",
                field="lora.r",
            )
        modules = self.lora.get("target_modules")
        if isinstance(modules, list) and "all" not in modules:
            allowed = {str(m) for m in modules}
            allowed |= {part for fused, parts in FUSED_MODULES.items() if fused in allowed for part in parts}
            missing = sorted(set(spec.lora.target_modules) - allowed)
            if missing:
                raise ValidationFailed(
                    f"{who} targets {missing}, but the engine behind {gateway_url} "
                    f"prepares LoRA only for {modules}: drop them from lora.target_modules, or start the "
                    "stack with them in TANDEM_ENGINE__LORA_TARGET_MODULES",
                    field="lora.target_modules",
                )
